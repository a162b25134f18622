"""Grammar masks on the GPT-2 vocabulary: llguidance vs xgrammar (why TinyLoop uses llguidance: docs/structured.md).

For one JSON schema (nested object, array of enums, bounded integer and number, a pattern, required fields) and
one valid document of it (55 GPT-2 tokens), each library's tokenizer set-up, schema compile (first and a
second, different schema) and the time to compute the allowed-token mask at every position of the document
(then EOS must be allowed). One thread, CPU. xgrammar is optional (`pip install xgrammar`); without it only
llguidance is measured.

    .venv/bin/python benchmarks/grammar_masks.py [--repeats 3]
"""
import json
import statistics
import time

from tinyloop.tokenizer import Tokenizer

tok = Tokenizer.gpt2()
V = tok.vocab_size
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["name", "age", "tags", "address", "score"], "additionalProperties": False}
DOC = {"name": "Ada Lovelace of the Analytical Engine", "age": 36, "tags": ["red", "blue", "green"],
       "address": {"city": "London", "zip": "12345"}, "score": 0.875}
text = json.dumps(DOC)
ids = tok.encode(text)

def llg():
    import llguidance, llguidance.torch as lt
    from llguidance.tiktoken import lltokenizer_from_encoding
    t0 = time.perf_counter(); lt_tok = lltokenizer_from_encoding(tok._enc, n_vocab=V, eos_token=tok.eos_id); t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    m = llguidance.LLMatcher(lt_tok, g); t_comp = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    mask = lt.allocate_token_bitmask(1, V)
    times = []
    for i in ids:
        t0 = time.perf_counter(); lt.fill_next_token_bitmask(m, mask, 0); times.append(time.perf_counter() - t0)
        assert (mask[0, i // 32] >> (i % 32)) & 1, ("token not allowed", i)
        assert m.consume_token(i), m.get_error()
    t0 = time.perf_counter(); lt.fill_next_token_bitmask(m, mask, 0); times.append(time.perf_counter() - t0)
    assert (mask[0, tok.eos_id // 32] >> (tok.eos_id % 32)) & 1 and m.is_accepting()
    t0 = time.perf_counter(); llguidance.LLMatcher(lt_tok, g); t_comp2 = time.perf_counter() - t0
    return t_tok, t_comp, t_comp2, times

def xgr():
    import xgrammar as xgr
    vocab = [tok.token_bytes(i) for i in range(V)]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[tok.eos_id])
    comp = xgr.GrammarCompiler(info, max_threads=1)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter(); cg = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False); t_comp = time.perf_counter() - t0
    m = xgr.GrammarMatcher(cg)
    mask = xgr.allocate_token_bitmask(1, V)
    times = []
    for i in ids:
        t0 = time.perf_counter(); m.fill_next_token_bitmask(mask, 0); times.append(time.perf_counter() - t0)
        assert (mask[0, i // 32] >> (i % 32)) & 1, ("token not allowed", i)
        assert m.accept_token(i)
    t0 = time.perf_counter(); m.fill_next_token_bitmask(mask, 0); times.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); comp.compile_json_schema(json.dumps({**SCHEMA, "title": "x"}), any_whitespace=False); t_comp2 = time.perf_counter() - t0
    return t_tok, t_comp, t_comp2, times

def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print("tokens in the document:", len(ids))
    for _ in range(args.repeats):
        for name, fn in (("llguidance", llg), ("xgrammar", xgr)):
            try:
                t_tok, t_comp, t_comp2, times = fn()
            except ImportError as e:
                print(f"{name}: not installed ({e})")
                continue
            ms = sorted(t * 1000 for t in times)
            print(f"{name}: tokenizer {t_tok * 1000:.0f} ms, compile {t_comp * 1000:.1f} ms (another schema "
                  f"{t_comp2 * 1000:.1f} ms), mask per token median {statistics.median(ms):.3f} ms, "
                  f"p90 {ms[int(0.9 * len(ms))]:.3f} ms, max {ms[-1]:.3f} ms, mean {statistics.mean(ms):.3f} ms")


if __name__ == "__main__":
    main()
