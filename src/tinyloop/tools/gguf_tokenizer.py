"""A GGUF file's tokenizer as a Hugging Face `tokenizer.json` (tools/gguf.py's import): llama.cpp's
`tokenizer.ggml.*` arrays (BPE with its pre-tokenizer by name, or SentencePiece's scores) rebuilt as the
tokenizer llama.cpp runs, so that TinyLoop encodes as llama.cpp does (tests/tools/test_gguf.py)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..model.families import ConvertError
from ..tokenizer import HFTokenizer, TokenizerError

if TYPE_CHECKING:
    from .gguf_file import GGUFFile

# tokenizer.ggml.token_type (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(regex: str) -> list[dict[str, Any]]:
    return [{"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            _byte_level(False)]


# tokenizer.ggml.pre -> (the pre-tokenizers llama.cpp's regexes for that name amount to, ignore_merges), as
# Hugging Face pre-tokenizers (llama.cpp src/llama-vocab.cpp: the same regexes by the same names)
_PRE: dict[str, tuple[list[dict[str, Any]], bool]] = {}
for _n in ("gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion"):
    _PRE[_n] = ([_byte_level(True)], False)
for _n in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"):  # digits apart
    _PRE[_n] = ([{"type": "Digits", "individual_digits": True}, _byte_level(True)], False)
for _n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"):
    _PRE[_n] = (_split(_LLAMA3_REGEX), True)
for _n in ("qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan"):
    _PRE[_n] = (_split(_QWEN2_REGEX), False)
PRE_TOKENIZERS = tuple(sorted(_PRE))


def tokenizer_json(g: GGUFFile) -> tuple[str, dict[str, Any]]:
    """The GGUF's tokenizer as a Hugging Face tokenizer.json text, and its special ids and flags."""
    model = g.get("tokenizer.ggml.model")
    if model is None:
        raise ConvertError(f"{g.path}: no tokenizer in the metadata (tokenizer.ggml.model)")
    if model not in ("gpt2", "llama"):
        raise ConvertError(f"{g.path}: tokenizer.ggml.model {model!r} is not read (only 'gpt2', byte-level BPE: "
                           "SmolLM, Llama-3, Qwen, ...; and 'llama', SentencePiece BPE with byte fallback: "
                           "Llama-2, TinyLlama, Mistral)")
    pre = g.get("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre not in _PRE:
        raise ConvertError(f"{g.path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer this importer knows "
                           f"({', '.join(PRE_TOKENIZERS)})")
    tokens = g.get("tokenizer.ggml.tokens")
    merges = g.get("tokenizer.ggml.merges") or []
    if not tokens:
        raise ConvertError(f"{g.path}: no tokenizer.ggml.tokens")
    types = g.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ConvertError(f"{g.path}: {len(types)} token types for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    if len(vocab) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise ConvertError(f"{g.path}: token {dup!r} appears twice in tokenizer.ggml.tokens")
    if model == "llama":
        merges = _spm_merges(g, tokens, types, vocab)
    for m in merges:
        parts = m.split(" ") if isinstance(m, str) else m
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
            raise ConvertError(f"{g.path}: merge {m!r} does not join two tokens of the vocabulary")

    def special_id(key: str) -> int | None:
        v = g.get(f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if not 0 <= int(v) < len(tokens):
            raise ConvertError(f"{g.path}: tokenizer.ggml.{key} {v} is outside the vocabulary (0..{len(tokens) - 1})")
        return int(v)

    ids = {k: special_id(f"{k}_token_id") for k in ("bos", "eos", "eot", "eom", "padding", "unknown")}
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", model == "llama"))   # (llama.cpp's defaults)
    add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False))
    if add_bos and ids["bos"] is None:
        raise ConvertError(f"{g.path}: tokenizer.ggml.add_bos_token is set but there is no bos_token_id")
    if add_eos and ids["eos"] is None:
        raise ConvertError(f"{g.path}: tokenizer.ggml.add_eos_token is set but there is no eos_token_id")
    # control tokens (llama.cpp never splits them; its parser takes them whole where the text has them) and
    # user-defined ones (stored as their text) are the tokenizer's added tokens, matched before the BPE
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] == CONTROL}
             for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    pre_tokenizers, ignore_merges = _PRE.get(pre, _PRE["gpt2"])
    if add_bos or add_eos:
        single = ([{"SpecialToken": {"id": tokens[ids["bos"]], "type_id": 0}}] if add_bos else []) \
            + [{"Sequence": {"id": "A", "type_id": 0}}] \
            + ([{"SpecialToken": {"id": tokens[ids["eos"]], "type_id": 0}}] if add_eos else [])
        pair = single + [{"Sequence": {"id": "B", "type_id": 1}}]
        specials = {tokens[ids[k]]: {"id": tokens[ids[k]], "ids": [ids[k]], "tokens": [tokens[ids[k]]]}
                    for k, on in (("bos", add_bos), ("eos", add_eos)) if on}
        post = {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}
    else:
        post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    if model == "llama":
        spec = _spm_spec(g, tokens, ids, vocab, merges, added, post)
        return json.dumps(spec, ensure_ascii=False), {**ids, "add_bos": add_bos, "add_eos": add_eos,
                                                      "tokens": tokens, "pre": pre}
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre_tokenizers[0] if len(pre_tokenizers) == 1 else
        {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": list(merges)},
    }
    return json.dumps(spec, ensure_ascii=False), {**ids, "add_bos": add_bos, "add_eos": add_eos,
                                                  "tokens": tokens, "pre": pre}


def _spm_merges(g: GGUFFile, tokens: list[str], types: list[int], vocab: dict[str, int]) -> list:
    """SentencePiece BPE (`tokenizer.ggml.model` llama) keeps scores, not merges: a piece made of two pieces is
    merged before any piece of a lower score (llama.cpp's tokenizer merges the best-scored bigram first). The
    merges Hugging Face's SentencePiece converter derives: every split of a normal piece into two pieces of the
    vocabulary, ranked by the piece's score (highest first), ties in vocabulary order."""
    scores = g.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ConvertError(f"{g.path}: a SentencePiece vocabulary (tokenizer.ggml.model 'llama') needs "
                           "tokenizer.ggml.scores, one per token")
    merges = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL or len(piece) < 2:
            continue
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges += [(float(scores[i]), lr) for lr in local]
    merges.sort(key=lambda m: -m[0])   # (stable: ties keep vocabulary order)
    return [list(lr) for _, lr in merges]


def _spm_spec(g: GGUFFile, tokens: list[str], ids: dict[str, Any], vocab: dict[str, int], merges: list,
              added: list[dict[str, Any]], post: dict[str, Any]) -> dict[str, Any]:
    """A SentencePiece BPE vocabulary as Hugging Face's Llama tokenizer has it: spaces as U+2581, a leading one
    before each run of text (`tokenizer.ggml.add_space_prefix`; llama.cpp adds it after every special token
    too, as the normalizer's per-segment Prepend does), byte fallback through the <0xNN> tokens."""
    space = "\u2581"
    norm = [{"type": "Replace", "pattern": {"String": " "}, "content": space}]
    if g.get("tokenizer.ggml.add_space_prefix", True):
        norm.insert(0, {"type": "Prepend", "prepend": space})
    unk = tokens[ids["unknown"]] if ids.get("unknown") is not None else None
    if post.get("type") == "ByteLevel":
        post = None
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": norm}, "pre_tokenizer": None, "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": space}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def gguf_tokenizer(g: GGUFFile) -> HFTokenizer:
    """The GGUF's tokenizer and chat template as TinyLoop's `HFTokenizer`. EOS ids: the eos, eot and eom
    tokens (llama.cpp ends generation at each of them), first seen first."""
    text, info = tokenizer_json(g)
    tokens = info["tokens"]
    eos = list(dict.fromkeys(i for i in (info["eos"], info["eot"], info["eom"]) if i is not None))
    if not eos:
        raise ConvertError(f"{g.path}: no tokenizer.ggml.eos_token_id (nor eot/eom) in the metadata")
    template = g.get("tokenizer.chat_template")
    try:
        return HFTokenizer(text, eos_ids=eos, eos_token=tokens[eos[0]], chat_template=template,
                           bos_token=tokens[info["bos"]] if info["bos"] is not None else None)
    except TokenizerError as exc:
        raise ConvertError(f"{g.path}: the tokenizer rebuilt from its metadata cannot be read ({exc})") from None
