"""The native library's C interface (`csrc/tinyloop.h`) in ctypes, and which executor this process uses.

`TINYLOOP_EXECUTOR=native|torch` forces one; unset (or `auto`), the native executor is used when its
library builds here, and the PyTorch path otherwise (said once, on stderr). `TINYLOOP_NATIVE_ISA=portable`
loads the scalar build instead of the host-tuned one (tests compare them).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
import sys
import threading

from .build import NativeBuildError, library_path

EXECUTORS = ("auto", "native", "torch")

TL_F32, TL_F16, TL_BF16, TL_Q8, TL_Q4, TL_Q2 = range(6)
TL_KV_F32, TL_KV_F16, TL_KV_BF16, TL_KV_I8, TL_KV_I4, TL_KV_I4H = range(6)
TL_EXIT = {"latent": 1, "gate": 2, "kl": 3}
_p = ctypes.c_void_p
_i = ctypes.c_int32


class TlLinear(ctypes.Structure):
    _fields_ = [("kind", _i), ("n", _i), ("k", _i), ("group", _i), ("w", _p), ("scales", _p), ("zeros", _p),
                ("act_q8", _i), ("streamed", _i), ("packed", _p), ("out_scale", _p), ("mins", _p),
                ("packed_f32", _i)]


class TlBlock(ctypes.Structure):
    _fields_ = [("qkv", TlLinear * 3), ("n_qkv", _i), ("wo", TlLinear), ("up", TlLinear * 2), ("n_up", _i),
                ("down", TlLinear), ("attn_norm", _p), ("mlp_norm", _p), ("attn_out_norm", _p),
                ("mlp_out_norm", _p), ("qk_bias", _p), ("q_norm", _p), ("k_norm", _p), ("ve_gate", _p),
                ("ve_table", _p), ("ve_kind", _i), ("ve_col", _i), ("own", _i), ("own_fields", _p)]


class TlReadout(ctypes.Structure):
    _fields_ = [("n_blocks", _i), ("blocks", ctypes.POINTER(TlBlock)), ("slots", ctypes.POINTER(_i)),
                ("state_proj", TlLinear)]


class TlModel(ctypes.Structure):
    _fields_ = [("dim", _i), ("n_heads", _i), ("n_kv_heads", _i), ("head_dim", _i), ("ffn_dim", _i), ("vocab", _i),
                ("n_prelude", _i), ("n_core", _i), ("n_coda", _i), ("swiglu", _i), ("injection", _i),
                ("placement", _i), ("loop_norm", _i), ("post_loop_norm", _i), ("norm_eps", ctypes.c_float),
                ("embed_scale", ctypes.c_float), ("embed", _p), ("embed_kind", _i), ("blocks", ctypes.POINTER(TlBlock)),
                ("core_norm", _p), ("final_norm", _p), ("adapter", TlLinear), ("rope_cos", _p), ("rope_sin", _p),
                ("rope_len", _i), ("gate_w", _p), ("gate_b", ctypes.c_double),
                ("readouts", ctypes.POINTER(TlReadout)), ("n_readouts", _i), ("head", ctypes.POINTER(TlLinear)),
                ("head_norm", _p), ("head_eps", ctypes.c_float), ("loop_start", _i), ("relu2", _i), ("inj_decay", _p),
                ("inj_dt", _p), ("inj_B", TlLinear), ("prelude_norm", _p), ("state_proj", TlLinear), ("qk_norm", _i),
                ("qk_eps", ctypes.c_float), ("ve_channels", _i), ("e_width", _i), ("logit_softcap", ctypes.c_float),
                ("sphere", _i), ("rope_cos2", _p), ("rope_sin2", _p), ("slot_map", _p), ("slot_loops", _i)]


class TlKV(ctypes.Structure):
    _fields_ = [("format", _i), ("page_size", _i), ("k", _p), ("v", _p), ("k_scale", _p), ("k_offset", _p),
                ("v_scale", _p), ("v_offset", _p)]


class TlRow(ctypes.Structure):
    _fields_ = [("token", _i), ("pos", _i), ("loops", _i), ("window", _i), ("table", _p), ("stride", _i),
                ("n_blocks", _i), ("exit_kind", _i), ("min_loops", _i), ("threshold", ctypes.c_double),
                ("survival", ctypes.c_double), ("loops_run", _i), ("first_loop", _i), ("readout", _i),
                ("state_e", _p), ("state_h", _p), ("out_e", _p), ("out_h", _p),
                ("tree_n", _i), ("store", _i), ("tree_base", _i), ("tree_keys", _p), ("tree_pos", _p)]


class TlSampling(ctypes.Structure):
    _fields_ = [("key", ctypes.c_uint32), ("inv_temp", ctypes.c_float), ("top_k", _i), ("top_p", ctypes.c_float),
                ("mask", _p)]


GRAMMAR_CB = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32, ctypes.c_int32)   # tl_gen.grammar: forced tokens, -1 to end


class TlRound(ctypes.Structure):
    _fields_ = [("k", _i), ("d", _i), ("V", _i), ("draft_readout", _i), ("draft_head", ctypes.POINTER(TlLinear)),
                ("draft_ids", _p), ("draft_norm", _p), ("draft_eps", ctypes.c_float), ("backlog_h", _p),
                ("head", ctypes.POINTER(TlLinear)), ("head_norm", _p), ("head_eps", ctypes.c_float), ("vocab", _i),
                ("tokens", _p), ("verify", _p), ("last_h", _p), ("draft_ms", ctypes.c_double),
                ("verify_ms", ctypes.c_double), ("n_emitted", _i), ("row_loops", _i), ("inv_temp", ctypes.c_float),
                ("n0", _i), ("seed", ctypes.c_uint64), ("top_k", _i), ("top_p", ctypes.c_float), ("ahead", _i),
                ("head_rows", _i), ("rounds", _i), ("stop", _p), ("n_stop", _i), ("out", _p), ("out_n", _p),
                ("n_rounds", _i)]


class TlTree(ctypes.Structure):
    _fields_ = [("depth", _i), ("K", _i), ("d", _i), ("V", _i), ("draft_readout", _i), ("last_readout", _i),
                ("draft_head", ctypes.POINTER(TlLinear)), ("draft_ids", _p), ("draft_norm", _p),
                ("draft_eps", ctypes.c_float), ("head", ctypes.POINTER(TlLinear)), ("head_norm", _p),
                ("head_eps", ctypes.c_float), ("vocab", _i), ("tokens", _p), ("parents", _p), ("emitted", _p),
                ("path", _p), ("n_nodes", _i), ("n_emitted", _i), ("draft_ms", ctypes.c_double),
                ("verify_ms", ctypes.c_double), ("inv_temp", ctypes.c_float), ("n0", _i), ("seed", ctypes.c_uint64),
                ("top_k", _i), ("top_p", ctypes.c_float), ("n_verified", _i), ("head_rows", _i)]


class TlGen(ctypes.Structure):
    _fields_ = [("steps", _i), ("head", ctypes.POINTER(TlLinear)), ("head_norm", _p), ("head_eps", ctypes.c_float),
                ("vocab", _i), ("inv_temp", ctypes.c_float), ("n0", _i), ("seed", ctypes.c_uint64), ("top_k", _i),
                ("top_p", ctypes.c_float), ("stop", _p), ("n_stop", _i), ("mask", _p), ("grammar", GRAMMAR_CB),
                ("forced", _p), ("tokens", _p), ("loops", _p), ("n_out", _i)]


_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_said = False


def load(isa: str | None = None) -> ctypes.CDLL:
    """The native library (built and cached on first use); NativeBuildError if it cannot be had."""
    isa = isa or os.environ.get("TINYLOOP_NATIVE_ISA", "native")
    with _lock:
        if isa in _libs:
            return _libs[isa]
        lib = ctypes.CDLL(str(library_path(isa)))
        P = ctypes.POINTER
        lib.tl_decode.argtypes = [P(TlModel), P(TlKV), P(TlRow), _i, _p, _p, ctypes.c_int64]
        lib.tl_decode.restype = ctypes.c_int
        lib.tl_scratch_floats.argtypes = [P(TlModel), _i, _i]
        lib.tl_scratch_floats.restype = ctypes.c_int64
        lib.tl_linear_forward.argtypes = [P(TlLinear), _p, _i, _p, _p]
        lib.tl_pack_int4_size.argtypes = [P(TlLinear)]
        lib.tl_pack_int4_size.restype = ctypes.c_int64
        lib.tl_pack_int4.argtypes = [P(TlLinear), _p]
        lib.tl_pack_int4.restype = _i
        lib.tl_linear_forward.restype = ctypes.c_int
        lib.tl_head.argtypes = [P(TlLinear), _p, _i, _p, ctypes.c_float, _i, _p, _p, _p, _p, ctypes.c_float]
        lib.tl_head.restype = ctypes.c_int
        lib.tl_noise_key.argtypes = [ctypes.c_uint64, ctypes.c_int64]
        lib.tl_noise_key.restype = ctypes.c_uint32
        lib.tl_gumbel.argtypes = [ctypes.c_uint32, _p, _i, _p]
        lib.tl_gumbel.restype = None
        lib.tl_choose.argtypes = [_p, _i, _p, ctypes.c_float, ctypes.c_uint32]
        lib.tl_choose.restype = _i
        lib.tl_draw.argtypes = [_p, _i, _p, P(TlSampling)]
        lib.tl_draw.restype = _i
        lib.tl_spec_round.argtypes = [P(TlModel), P(TlKV), P(TlRow), P(TlRound), _p, ctypes.c_int64]
        lib.tl_spec_round.restype = ctypes.c_int
        lib.tl_round_scratch_floats.argtypes = [P(TlModel), P(TlRound), _i]
        lib.tl_round_scratch_floats.restype = ctypes.c_int64
        lib.tl_spec_pipeline.argtypes = [P(TlModel), P(TlKV), P(TlRow), P(TlRound), _p, ctypes.c_int64]
        lib.tl_spec_pipeline.restype = ctypes.c_int
        lib.tl_pipeline_scratch_floats.argtypes = [P(TlModel), P(TlRound), _i]
        lib.tl_pipeline_scratch_floats.restype = ctypes.c_int64
        lib.tl_tree_round.argtypes = [P(TlModel), P(TlKV), P(TlRow), P(TlTree), _p, ctypes.c_int64]
        lib.tl_tree_round.restype = ctypes.c_int
        lib.tl_tree_scratch_floats.argtypes = [P(TlModel), P(TlTree), _i]
        lib.tl_tree_scratch_floats.restype = ctypes.c_int64
        lib.tl_generate.argtypes = [P(TlModel), P(TlKV), P(TlRow), P(TlGen), _p, ctypes.c_int64]
        lib.tl_generate.restype = ctypes.c_int
        lib.tl_generate_scratch_floats.argtypes = [P(TlModel), P(TlGen), _i]
        lib.tl_generate_scratch_floats.restype = ctypes.c_int64
        lib.tl_block_kind.argtypes = [ctypes.c_char_p]
        lib.tl_block_kind.restype = _i
        lib.tl_set_threads.argtypes = [_i]
        lib.tl_set_panel_min_rows.argtypes = [_i]
        lib.tl_set_panel_min_rows.restype = _i
        lib.tl_set_batch_invariant.argtypes = [_i]
        lib.tl_set_batch_invariant.restype = _i
        lib.tl_set_batch_invariant(1 if batch_invariant_setting() else 0)
        lib.tl_set_amx.argtypes = [_i]
        lib.tl_set_amx.restype = _i
        lib.tl_amx.restype = _i
        lib.tl_threads.restype = _i
        lib.tl_isa.restype = ctypes.c_char_p
        _libs[isa] = lib
        return lib


def batch_invariant_setting() -> bool:
    """Batch-invariant mode, on unless `TINYLOOP_BATCH_INVARIANT=0`: no layer takes the outer-product panels
    (matmul.cpp), so 16-bit and fp32-activation quantized layers give a row the same result whatever else
    shares the step, as int4/int8 layers with int8 activations always do. Off, those layers run many rows
    (a prefill chunk, a large batch) faster: docs/decode.md, "Batch invariance"."""
    return os.environ.get("TINYLOOP_BATCH_INVARIANT", "1").strip().lower() not in ("0", "false", "no", "off")


def loaded() -> ctypes.CDLL | None:
    """A native library this process has loaded already (any build: their shared functions agree bit for bit),
    or None; loads nothing."""
    return next(iter(_libs.values()), None)


_CHOICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("tinyloop_executor", default=None)


@contextlib.contextmanager
def choose(executor: str | None):
    """Within the block, `executor_setting()` is `executor` (None: the environment's). Engine.load uses it so
    that the quantized layers a load builds follow the executor asked for."""
    token = _CHOICE.set(executor if executor not in (None, "auto") else None)
    try:
        yield
    finally:
        _CHOICE.reset(token)


def executor_setting() -> str:
    v = _CHOICE.get() or os.environ.get("TINYLOOP_EXECUTOR", "auto").strip().lower() or "auto"
    if v not in EXECUTORS:
        raise ValueError(f"TINYLOOP_EXECUTOR must be one of {EXECUTORS}, got {v!r}")
    return v


def native_wanted() -> bool:
    """Whether this process runs the native executor: forced, or `auto` and the library builds here.
    `native` forced where it cannot build raises NativeBuildError."""
    global _said
    setting = executor_setting()
    if setting == "torch":
        return False
    try:
        load()
        return True
    except NativeBuildError as exc:
        if setting == "native":
            raise
        if not _said:
            _said = True
            print(f"tinyloop: native executor unavailable ({str(exc).splitlines()[0]}); "
                  "running the PyTorch path", file=sys.stderr)
        return False


# -- what the native code runs (torch-free: `tinyloop info` asks without loading torch) ---------------------
_PLACEMENTS = {"pre": 0, "sandwich": 1, "sandwich-residual": 2, "post": 3}
_LOOP_STARTS = {"state": 0, "embed": 1, "skip": 2}
_INJECTIONS = {"none": 0, "add": 1, "concat-adapter": 2, "diagonal": 3}


def unsupported_features(cfg) -> list[str]:
    """The config's features the C++ code does not implement: a model with any of them is served by the
    PyTorch path (`model.fast.attach_executor` warns once and falls back). ReLU^2, the diagonal injection, the
    prelude norm, C, q/k norms, value embeddings and the soft-cap run natively, and so do a family's own blocks
    (a block kind its csrc file registers: nGPT's, with sliding-window layers, partial rotary and a second RoPE
    profile), the last_loop KV mode and a per-token logit scale."""
    out = []
    if cfg.mlp not in ("swiglu", "gelu", "relu2"):
        out.append(f"the {cfg.mlp} MLP")
    if cfg.injection not in _INJECTIONS:
        out.append(f"the {cfg.injection} injection")
    if cfg.norm_placement not in _PLACEMENTS:
        out.append(f"{cfg.norm_placement}-norm blocks")
    if cfg.loop_start not in _LOOP_STARTS:
        out.append(f"loop 0 starting as {cfg.loop_start!r}")
    if cfg.value_embeds and cfg.head_dim > 1024:
        out.append("value embeddings on heads wider than 1024")
    # partial rotary and the second profile: nGPT's layers read them (the tables carry both); the shared blocks
    # read profile 1 only
    if not getattr(cfg, "layer_pattern", "") and (getattr(cfg, "rotary_dim", 0) or getattr(cfg, "rope_theta_2", 0)
                                                  or getattr(cfg, "rope_profile", ())):
        out.append("partial rotary or a second RoPE profile outside nGPT blocks")
    return out


def config_refusal(cfg) -> str | None:
    """Why the native executor refuses a model of this config (None: it runs it, the weights permitting), as
    `NativeExecutor` says it and `tinyloop info` shows it."""
    missing = unsupported_features(cfg)
    if missing:
        return f"not implemented natively: {', '.join(missing)}"
    if cfg.dim % 8 or cfg.head_dim % 8:
        return "dim and head_dim must be multiples of 8"
    return None


def describe() -> str:
    """Which executor a model loaded now would use, without compiling anything (`tinyloop info`): "torch"
    (forced, or no library), "native (ISA)" when the library is built, or what is missing."""
    from .build import cache_dir, compiler

    try:
        setting = executor_setting()
    except ValueError as exc:
        return f"invalid setting ({exc})"
    if setting == "torch":
        return "torch (TINYLOOP_EXECUTOR=torch)"
    if compiler() is None:
        return "torch (no C++ compiler for the native executor)"
    try:
        library_path(os.environ.get("TINYLOOP_NATIVE_ISA", "native"), build=False)
    except NativeBuildError:
        return (f"native (not built yet in {cache_dir()}: built on first load, or by "
                "`python -m tinyloop.kernels.build`)")
    return f"native ({load().tl_isa().decode()})"
