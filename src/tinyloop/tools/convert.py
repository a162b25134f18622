"""`tinyloop convert SRC_DIR OUT.tinyloop`: a local Hugging Face snapshot of a looped family -> a `.tinyloop` file.

Families (recognised by `config.json`'s `model_type`, never by a name):

    ouro          ByteDance Ouro (1.4B, 2.6B, -Thinking): `total_ut_steps` passes of the same layers, sandwich
                  norms (the attention and MLP outputs are normed before the residual add), the final norm
                  ending every step, a learned exit gate, an untied head, GQA
    huginn_raven  Huginn-0125: prelude, a recurrent block re-entered through a concat adapter from a zero
                  state, coda; norms after each residual add, q/k biases, a sqrt(dim) embedding scale,
                  interleaved RoPE, a tied head
    nanbeige      Nanbeige4.2 (NanbeigeForCausalLM): `num_hidden_layers` Llama pre-norm layers run `num_loops`
                  times, the final norm ending every loop (or only the last, `skip_loop_final_norm`), GQA with
                  an explicit `head_dim` (q wider than the hidden size), half-split RoPE, an untied head; the
                  options its code has but the released checkpoints leave off are refused by name

Tensors stream shard by shard (`safetensors.safe_open`), each one cast to the target dtype as it is read,
so the model is held once. Huginn's fused projections are split into TinyLoop's names and its
interleaved RoPE pairs (2i, 2i+1) are permuted to the half-split pairs (i, i + D/2) TinyLoop computes:
the same permutation on the q and k rows (and their biases) leaves every attention score unchanged, so the
model computes the same function. The tokenizer (`tokenizer.json`), its chat template and the union of the
snapshot's EOS ids are embedded. Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..config import ConfigError, ModelConfig
from ..modelfile import DTYPES, expected_tensors, make_header, tokenizer_blob
from ..modelfile_writer import ModelFileWriter
from ..modellayout import SEPARATE_VERSION
from ..tokenizer import HFTokenizer, TokenizerError
from ..version import __version__

FAMILIES = ("ouro", "huginn_raven", "nanbeige")


class ConvertError(ValueError):
    """A snapshot this converter cannot turn into a TinyLoop model; the message names what and where."""


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise ConvertError(f"{path.parent}: no {path.name}")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConvertError(f"{path}: not valid JSON ({exc})") from None


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _need(cond: bool, src: Path, what: str) -> None:
    if not cond:
        raise ConvertError(f"{src / 'config.json'}: {what}")


# -- configs ------------------------------------------------------------------------------------------
def ouro_config(hf: dict[str, Any], src: Path, eos: list[int]) -> ModelConfig:
    d, H = hf["hidden_size"], hf["num_attention_heads"]
    _need(hf.get("head_dim", d // H) * H == d, src, f"head_dim {hf.get('head_dim')} x {H} heads != hidden_size {d}")
    _need(hf.get("hidden_act", "silu") == "silu", src, f"hidden_act {hf.get('hidden_act')!r} (only silu is supported)")
    _need(not hf.get("rope_scaling"), src, f"rope_scaling {hf.get('rope_scaling')!r} is not supported")
    _need(not hf.get("use_sliding_window"), src, "use_sliding_window is not supported")
    _need(not hf.get("attention_bias", False), src, "attention_bias is not supported for Ouro")
    steps = int(hf.get("total_ut_steps", 4))
    return ModelConfig(dim=d, n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H,
                       ffn_dim=hf["intermediate_size"], n_prelude=0, n_core=hf["num_hidden_layers"], n_coda=0,
                       vocab_size=hf["vocab_size"], default_loops=steps, max_loops=max(64, 4 * steps),
                       max_seq_len=hf.get("max_position_embeddings", 4096), norm_eps=hf.get("rms_norm_eps", 1e-6),
                       rope_theta=float(hf.get("rope_theta", 10000.0)), mlp="swiglu",
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), injection="none", loop_norm=True,
                       head_norm=False, norm_placement="sandwich", exit_gate=True,
                       eos_token_id=eos[0], eos_token_ids=tuple(eos[1:]))


def huginn_config(hf: dict[str, Any], src: Path, eos: list[int]) -> ModelConfig:
    d, H = hf["n_embd"], hf["n_heads"]
    _need(not hf.get("bias", False), src, "bias = true (biased linear layers) is not supported")
    _need(hf.get("tie_embeddings", True), src, "an untied Huginn head is not supported")
    steps = hf.get("mean_recurrence", 32)
    return ModelConfig(dim=d, n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H,
                       ffn_dim=hf["intermediate_size"], n_prelude=hf["n_layers_in_prelude"],
                       n_core=hf["n_layers_in_recurrent_block"], n_coda=hf["n_layers_in_coda"],
                       vocab_size=hf.get("padded_vocab_size") or hf["vocab_size"], default_loops=steps,
                       max_loops=max(64, 4 * steps), max_seq_len=hf.get("block_size", 4096),
                       norm_eps=hf.get("norm_eps", 1e-6), rope_theta=float(hf.get("rope_base", 50000.0)),
                       mlp="swiglu", tie_embeddings=True, injection="concat-adapter", loop_norm=False,
                       post_loop_norm=True, norm_placement="sandwich-residual", qk_bias=bool(hf.get("qk_bias", False)),
                       embed_scale=math.sqrt(d), state_init_std=float((hf.get("init_values") or {}).get(
                           "std", math.sqrt(2 / (5 * d)))),
                       eos_token_id=eos[0], eos_token_ids=tuple(eos[1:]))


# Options of Nanbeige's code that no released checkpoint turns on; each changes the forward (or the cache),
# so a config that sets one is refused by name rather than converted into a different model.
NANBEIGE_OFF = ("enable_double_loop_split", "loop_share_kv", "mhc_diff_for_loop", "enable_hyper_connection",
                "enable_mhc", "enable_h_res_identity", "enable_depth_attention", "qk_layernorm",
                "ngram_insert_all_layers", "ngram_compressed_tokenizer", "attention_bias", "mlp_bias")
NANBEIGE_UNSET = ("emb_neighbor_num", "emb_split_num", "ngram_vocab_size_ratio", "insert_ngram_layer_idx",
                  "mhc_double_stream_position_for_loop")


def nanbeige_config(hf: dict[str, Any], src: Path, eos: list[int]) -> ModelConfig:
    on = [k for k in NANBEIGE_OFF if hf.get(k)] + [k for k in NANBEIGE_UNSET if hf.get(k) not in (None, [])]
    _need(not on, src, f"{', '.join(f'{k} = {hf[k]!r}' for k in on)}: not supported (TinyLoop runs Nanbeige's "
                       "plain loop: no LoopSplit, shared-loop KV, hyper-connections, depth attention, n-gram "
                       "embeddings, q/k norms or biases)")
    quant = hf.get("quantization_config")
    method = quant.get("quant_method", quant) if isinstance(quant, dict) else quant
    _need(not quant, src, f"quantization_config {method!r}: a pre-quantized checkpoint (the FP8 / GPTQ-Int8 "
                          "variants) is not converted; convert the 16-bit one and run tinyloop quantize "
                          "(or pull NAME:int4)")
    _need(hf.get("hidden_act", "silu") == "silu", src, f"hidden_act {hf.get('hidden_act')!r} (only silu is supported)")
    scaling = hf.get("rope_scaling")
    _need(not scaling or (scaling.get("rope_type", scaling.get("type")) in (None, "default")
                          and float(scaling.get("factor", 1.0)) == 1.0),
          src, f"rope_scaling {scaling!r} is not supported")
    d, H = hf["hidden_size"], hf["num_attention_heads"]
    weights = hf.get("loop_loss_weights") or []
    steps = len(weights) + 1 if weights else int(hf.get("num_loops", 1))  # the reference's own rule
    _need(steps >= 1, src, f"num_loops {steps} must be >= 1")
    skip = bool(hf.get("skip_loop_final_norm", False))
    return ModelConfig(dim=d, n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H,
                       head_dim=hf.get("head_dim") or d // H, ffn_dim=hf["intermediate_size"], n_prelude=0,
                       n_core=hf["num_hidden_layers"], n_coda=0, vocab_size=hf["vocab_size"], default_loops=steps,
                       max_loops=max(64, 4 * steps), max_seq_len=hf.get("max_position_embeddings", 4096),
                       norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(hf.get("rope_theta", 10000.0)),
                       mlp="swiglu", tie_embeddings=bool(hf.get("tie_word_embeddings", False)), injection="none",
                       norm_placement="pre", loop_norm=not skip, head_norm=skip,
                       eos_token_id=eos[0], eos_token_ids=tuple(eos[1:]))


# -- tensors ------------------------------------------------------------------------------------------
def _half_split(cfg: ModelConfig) -> torch.Tensor:
    """Head-dim permutation: new index j < D/2 takes interleaved 2j, j >= D/2 takes 2(j - D/2) + 1."""
    D = cfg.head_dim
    return torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])


Emit = Callable[[str, torch.Tensor], None]


def ouro_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    parts = name.split(".")
    if name == "model.embed_tokens.weight":
        emit("embed.weight", t)
    elif name == "lm_head.weight":
        if not cfg.tie_embeddings:
            emit("lm_head.weight", t)
    elif name == "model.norm.weight":
        emit("core_norm.weight", t)  # ends every step; with head_norm off it is the only final norm
    elif name.startswith("model.early_exit_gate."):
        emit("exit_gate." + parts[-1], t)
    elif name.startswith("model.layers.") and len(parts) >= 5:
        i, rest = parts[2], ".".join(parts[3:])
        table = {"input_layernorm.weight": "attn_norm.weight", "input_layernorm_2.weight": "attn_out_norm.weight",
                 "post_attention_layernorm.weight": "mlp_norm.weight",
                 "post_attention_layernorm_2.weight": "mlp_out_norm.weight",
                 "self_attn.q_proj.weight": "attn.wq.weight", "self_attn.k_proj.weight": "attn.wk.weight",
                 "self_attn.v_proj.weight": "attn.wv.weight", "self_attn.o_proj.weight": "attn.wo.weight",
                 "mlp.gate_proj.weight": "mlp.w_gate.weight", "mlp.up_proj.weight": "mlp.w_up.weight",
                 "mlp.down_proj.weight": "mlp.w_down.weight"}
        if rest not in table:
            return False
        emit(f"core.{i}.{table[rest]}", t)
    else:
        return False
    return True


def huginn_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    H, Hkv, D, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
    perm = _half_split(cfg)
    parts = name.split(".")
    if name == "transformer.wte.weight":
        emit("embed.weight", t)
    elif name == "transformer.ln_f.weight":
        emit("norm.weight", t)
    elif name == "transformer.adapter.weight":
        emit("adapter.weight", t)
    elif name in ("freqs_cis", "transformer.freqs_cis", "lm_head.weight"):
        pass  # RoPE table (recomputed) / the tied head
    elif name.startswith("transformer.") and parts[1] in ("prelude", "core_block", "coda") and len(parts) >= 5:
        group = {"prelude": "prelude", "core_block": "core", "coda": "coda"}[parts[1]]
        base, rest = f"{group}.{parts[2]}", ".".join(parts[3:])
        simple = {"norm_1.weight": "attn_norm.weight", "norm_2.weight": "attn_out_norm.weight",
                  "norm_3.weight": "mlp_norm.weight", "norm_4.weight": "mlp_out_norm.weight",
                  "attn.proj.weight": "attn.wo.weight", "mlp.proj.weight": "mlp.w_down.weight"}
        if rest in simple:
            emit(f"{base}.{simple[rest]}", t)
        elif rest == "attn.Wqkv.weight":
            if t.shape[0] != (H + 2 * Hkv) * D:
                raise ConvertError(f"{name} has shape {list(t.shape)}, the config needs [{(H + 2 * Hkv) * D}, {d}]")
            q, k, v = t.split([H * D, Hkv * D, Hkv * D], dim=0)
            emit(f"{base}.attn.wq.weight", q.reshape(H, D, -1)[:, perm].reshape(H * D, -1))
            emit(f"{base}.attn.wk.weight", k.reshape(Hkv, D, -1)[:, perm].reshape(Hkv * D, -1))
            emit(f"{base}.attn.wv.weight", v)
        elif rest == "attn.qk_bias":
            if tuple(t.shape) != (2, 1, H, D):
                raise ConvertError(f"{name} has shape {list(t.shape)}, the config needs [2, 1, {H}, {D}]")
            emit(f"{base}.attn.qk_bias", torch.cat([t[0, 0], t[1, 0, :Hkv]])[:, perm])
        elif rest == "mlp.fc.weight":
            if t.shape[0] != 2 * cfg.ffn_dim:
                raise ConvertError(f"{name} has shape {list(t.shape)}, the config needs [{2 * cfg.ffn_dim}, {d}]")
            gate, up = t.split(cfg.ffn_dim, dim=0)
            emit(f"{base}.mlp.w_gate.weight", gate)
            emit(f"{base}.mlp.w_up.weight", up)
        else:
            return False
    else:
        return False
    return True


LLAMA_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight",
               "self_attn.q_proj.weight": "attn.wq.weight", "self_attn.k_proj.weight": "attn.wk.weight",
               "self_attn.v_proj.weight": "attn.wv.weight", "self_attn.o_proj.weight": "attn.wo.weight",
               "mlp.gate_proj.weight": "mlp.w_gate.weight", "mlp.up_proj.weight": "mlp.w_up.weight",
               "mlp.down_proj.weight": "mlp.w_down.weight"}


def nanbeige_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    parts = name.split(".")
    if name == "model.embed_tokens.weight":
        emit("embed.weight", t)
    elif name == "lm_head.weight":
        if not cfg.tie_embeddings:
            emit("lm_head.weight", t)
    elif name == "model.norm.weight":
        # the same norm ends every loop (loop_norm) or, with skip_loop_final_norm, only the last (head_norm)
        emit("core_norm.weight" if cfg.loop_norm else "norm.weight", t)
    elif name.startswith("model.layers.") and len(parts) >= 5:
        i, rest = parts[2], ".".join(parts[3:])
        if rest == "self_attn.rotary_emb.inv_freq":
            _check_inv_freq(cfg, name, t)  # a patched checkpoint stores the RoPE buffer; TinyLoop recomputes it
        elif rest in LLAMA_LAYER:
            emit(f"core.{i}.{LLAMA_LAYER[rest]}", t)
        else:
            return False
    else:
        return False
    return True


def _check_inv_freq(cfg: ModelConfig, name: str, t: torch.Tensor) -> None:
    """A stored RoPE `inv_freq` must be the one `rope_theta` and `head_dim` give (the reference computes it
    in fp32: rel. error ~1e-7; bf16 storage rounds to 2^-9 relative): a zeroed buffer (a loader bug that
    saved it so) or another theta would make the converted model differ from the checkpoint's own."""
    D = cfg.head_dim
    want = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    if tuple(t.shape) != (D // 2,) or not torch.allclose(t.double(), want, rtol=1e-2, atol=0):
        raise ConvertError(f"{name} is not the RoPE frequencies of rope_theta {cfg.rope_theta:g} and head_dim {D} "
                           f"(first values {t.flatten()[:3].tolist()}); the checkpoint would not run as saved")


def shard_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        if not names:
            raise ConvertError(f"{index}: no weight_map")
        missing = [n for n in names if not (src / n).exists()]
        if missing:
            raise ConvertError(f"{src}: shard {missing[0]} named by {index.name} is missing")
        return [src / n for n in names]
    single = src / "model.safetensors"
    if single.exists():
        return [single]
    raise ConvertError(f"{src}: no model.safetensors or model.safetensors.index.json (only safetensors "
                       "checkpoints are read; pickled .bin files are refused)")


def iter_tensors(files: list[Path], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm import tqdm

    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            total += len(list(h.keys()))
    bar = tqdm(total=total, desc="convert", unit="tensor", disable=not progress)
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():
                    yield key, h.get_tensor(key)
                    bar.update(1)
        except (OSError, RuntimeError) as exc:  # safetensors' own errors
            raise ConvertError(f"{f}: cannot read ({exc})") from None
    bar.close()


# -- tokenizer ----------------------------------------------------------------------------------------
def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def load_tokenizer(src: Path, hf: dict[str, Any], gen: dict[str, Any]) -> HFTokenizer:
    tj = src / "tokenizer.json"
    if not tj.exists():
        raise ConvertError(f"{src}: no tokenizer.json (the tokenizer is embedded in the model file)")
    tc = _read_json(src / "tokenizer_config.json", required=False)
    template = tc.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (src / "chat_template.jinja").exists():
        template = (src / "chat_template.jinja").read_text(encoding="utf-8")
    text = tj.read_text(encoding="utf-8")
    eos_token, bos_token = _token_text(tc.get("eos_token")), _token_text(tc.get("bos_token"))
    from tokenizers import Tokenizer as _HF

    try:
        probe = _HF.from_str(text)
    except Exception as exc:  # noqa: BLE001
        raise ConvertError(f"{tj}: cannot be read ({exc})") from None
    eos = _ids(hf.get("eos_token_id")) + _ids(gen.get("eos_token_id"))
    if eos_token is not None and probe.token_to_id(eos_token) is not None:
        eos.append(probe.token_to_id(eos_token))
    eos = list(dict.fromkeys(eos))  # the union, first seen first
    if not eos:
        raise ConvertError(f"{src}: no eos token id in config.json, generation_config.json or tokenizer_config.json")
    try:
        return HFTokenizer(text, eos_ids=eos, eos_token=eos_token or probe.id_to_token(eos[0]),
                           chat_template=template, bos_token=bos_token)
    except TokenizerError as exc:
        raise ConvertError(f"{tj}: {exc}") from None


# -- the whole conversion -----------------------------------------------------------------------------
CONFIGS = {"ouro": ouro_config, "huginn_raven": huginn_config, "nanbeige": nanbeige_config}
TENSORS = {"ouro": ouro_tensor, "huginn_raven": huginn_tensor, "nanbeige": nanbeige_tensor}


def model_config(hf: dict[str, Any], src: Path, eos: list[int]) -> ModelConfig:
    """A checkpoint's config.json -> ModelConfig, or ConvertError saying why the architecture is not
    supported. Needs no weights: `tinyloop pull` runs it on config.json before downloading any."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ConvertError(f"{src / 'config.json'}: model_type {family!r} is not a looped family this converter "
                           f"reads ({', '.join(FAMILIES)})")
    try:
        return CONFIGS[family](hf, src, eos)
    except KeyError as exc:
        raise ConvertError(f"{src / 'config.json'}: missing {exc.args[0]!r}") from None
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConvertError(f"{src / 'config.json'}: {exc}") from None


def convert(src: str | Path, out: str | Path, *, dtype: str = "bfloat16", progress: bool = True,
            provenance: dict[str, Any] | None = None) -> Path:
    """Convert the snapshot `src` into the model file `out` (atomically); `provenance` is added to the
    header's (`tinyloop pull` records the repository and commit there)."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise ConvertError(f"{src}: not a directory (give a local Hugging Face snapshot)")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConvertError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    hf = _read_json(src / "config.json")
    gen = _read_json(src / "generation_config.json", required=False)
    family = hf.get("model_type")
    model_config(hf, src, [0])  # the architecture is refused before the tokenizer and the weights are read
    tokenizer = load_tokenizer(src, hf, gen)
    cfg = model_config(hf, src, sorted(set(tokenizer.eos_ids), key=tokenizer.eos_ids.index))
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConvertError(f"{src}: tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary only "
                           f"{cfg.vocab_size}")
    torch_dtype = DTYPES[dtype]
    expected = expected_tensors(cfg, {"dtype": dtype}, SEPARATE_VERSION)  # what the checkpoint's names map to
    header = make_header(cfg, torch_dtype, tokenizer, {"converted_from": str(src.resolve()), "family": family,
                                                       "source_dtype": hf.get("torch_dtype"),
                                                       "converter_version": __version__, **(provenance or {})})
    files = shard_files(src)
    # Streamed: the file's layout is known from the config, so each tensor is cast and written at its place
    # as it is read (one tensor in memory at a time, one shard mapped), then the file is moved into place.
    # The file has the run-time layout (q/k/v and gate/up fused): the writer puts each projection at its rows.
    layout = expected_tensors(cfg, {"dtype": dtype})
    with ModelFileWriter(out, {k: (shape, torch_dtype) for k, (shape, _) in layout.items()}, header,
                         tokenizer_blob(tokenizer)) as writer:
        def emit(name: str, t: torch.Tensor) -> None:
            if name not in expected:
                raise ConvertError(f"{src}: tensor maps to {name!r}, which this config does not have")
            shape = expected[name][0]
            if tuple(t.shape) != shape:
                raise ConvertError(f"{src}: {name} has shape {list(t.shape)}, the config needs {list(shape)}")
            writer.add(name, t)

        convert_one = TENSORS[family]
        for name, t in iter_tensors(files, progress):
            if not convert_one(cfg, name, t, lambda n, x, src_name=name: _emit_named(emit, src_name, n, x)):
                raise ConvertError(f"{src}: unexpected tensor {name!r} with shape {list(t.shape)} for {family}")
        missing = sorted(set(expected) - writer.written)
        if missing:
            raise ConvertError(f"{src}: the checkpoint has no tensor for {missing[0]!r}"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return out


def _emit_named(emit: Emit, src_name: str, name: str, t: torch.Tensor) -> None:
    try:
        emit(name, t)
    except ConvertError as exc:
        raise ConvertError(f"{exc} (from {src_name!r})") from None
