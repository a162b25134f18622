"""NVIDIA Nemotron-Labs Dory1.0 (`model_type` "dory", DoryForCausalLM, `dory_format_version` 1): a normalized
transformer (nGPT) with an input block (TinyLoop's prelude), a recurrent block run `n_recurrent_loops` times
(the core) and an output block (the coda). Each layer is ONE sublayer, by `hybrid_layer_pattern`: `S`
sliding-window attention, `*` full attention, `-` MLP. Everything lives on the unit sphere:

    justnorm(x)   = x * rsqrt(sum(x^2) + 1e-6)                      (in fp32, over the last axis)
    layer(h)      = justnorm(a + |alpha * ngpt_alpha_init / std| * (justnorm(f(h)) - a)),  a = justnorm(h)
    attention f   q, k, v, g = projections of h (no biases; q and g are heads x head_dim wide, wider than the
                  hidden size in the release); NeoX RoPE (profile 1: rope_theta, partial_rotary_factor;
                  profile 2: rope_theta_2, partial_rotary_factor_2, per layer by rope_profile_layers);
                  q = (sqk * sqrt(head_dim) / std)^2 * justnorm(q) per head, k = justnorm(k) per head; GQA at
                  scale 1/sqrt(head_dim) (S layers: a query at t sees keys t-W+1 .. t); the output times
                  sigmoid(g * (s_gate * sqrt(g0) / std)^2) (g0 = attention_output_gate_logit_scale_init, or
                  sqrt(hidden)); justnorm over all heads; o_proj
    MLP f         justnorm(silu(gate * suv_gate * sqrt(hidden)) * (up * suv_up * sqrt(hidden))); down_proj
    loops         x0 = the input block's output; state = x0; each loop h = justnorm(state + x0), the recurrent
                  layers, state = justnorm(h); then the output block; no final norm
    logits        lm_head(x) * logit_scale / std (logit_scale: one per token)

`recurrent_kv_cache_mode`: "per_loop" keeps one cache per loop of each recurrent attention layer; "last_loop"
one per layer that every loop overwrites with the current call's keys (loop r sees this call's tokens at loop
r and earlier calls' tokens at the last loop they ran: `ModelConfig.kv_mode`, `cache.SlotLayout`).

This module owns the mapping of config.json onto `ModelConfig` (refusing, by name, everything that is not
Dory v1), of the checkpoint's tensor names onto TinyLoop's, and the math above (`NGPTBlock`, used by
`model.looped.LoopedTransformer` for a config with a `layer_pattern`). Its native math beside the shared kernels:
`kernels/csrc/dory.cpp` (described from `NGPTBlock.native_fields`; tests/kernels/test_dory_native.py holds it to this).

Partial rotary: the checkpoint rotates pairs (i, i + R/2) of the first R = head_dim * factor dims and leaves
the rest; TinyLoop's RoPE turns pairs (j, j + D/2). The converter permutes each head's q and k rows (and sqk)
so the checkpoint's pair (i, i + R/2) lands on (i, i + D/2) and the unrotated dims fill the other pairs, which
`ModelConfig.rotary_dim` turns at frequency 0: the same permutation of q and k leaves every score unchanged,
and the per-head justnorm and the elementwise sqk commute with it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...config import ConfigError, ModelConfig
from ..layers import MLP, Attention, apply_rope_full
from ..layers import l2norm as justnorm   # x / sqrt(sum(x^2) + 1e-6), in fp32 (shared: the loops' sphere)
from . import ConvertError, Emit, Family, need


# -- the math --------------------------------------------------------------------------------------------
class NGPTAttention(Attention):
    """An `S` or `*` layer's attention (an `Attention`, so fusing q/k/v, fp16 and quantized weights treat it
    as any other): q, k, v and the output gate g projected, RoPE of the layer's profile, nGPT q/k norms and
    scales, attention over the step context (the layer's window), the gate, justnorm, o_proj."""

    def __init__(self, cfg: ModelConfig, window: int, profile: int):
        nn.Module.__init__(self)
        H, Hkv, D, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
        self.n_heads, self.n_kv_heads, self.head_dim = H, Hkv, D
        self.wq = nn.Linear(d, H * D, bias=False)
        self.wk = nn.Linear(d, Hkv * D, bias=False)
        self.wv = nn.Linear(d, Hkv * D, bias=False)
        self.wg = nn.Linear(d, H * D, bias=False)       # the output gate's projection
        self.wo = nn.Linear(H * D, d, bias=False)
        self.wqkv: nn.Module | None = None
        self.qk_bias = self.q_norm = self.k_norm = self.ve_gate = None   # (Attention's options: none here)
        self.qk_norm, self.ve_channels = False, 0
        self.sqk = nn.Parameter(torch.ones(H * D))
        self.s_gate = nn.Parameter(torch.ones(H * D))
        self.window, self.profile = window, profile
        std = cfg.family_params["ngpt_std"]
        self.sqk_factor = math.sqrt(D) / std
        g0 = cfg.family_params.get("gate_logit_init") or math.sqrt(d)
        self.gate_factor = math.sqrt(g0) / std

    def forward(self, x: torch.Tensor, ctx, slot: int | None, ve: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.project_qkv(x)
        cos_full, sin_signed = ctx.rope_full(self.profile)
        qk = justnorm(apply_rope_full(qkv[:, :, :H + Hkv], cos_full, sin_signed))   # every head on its sphere
        sqk = (self.sqk.to(qk.dtype) * self.sqk_factor).square().view(H, D)
        q = (qk[:, :, :H] * sqk).to(x.dtype)
        k = qk[:, :, H:].to(x.dtype)
        out = ctx.attend(slot, q, k, qkv[:, :, H + Hkv:], self.window)              # (B, T, H, D), >= fp32
        g = self.wg(x).to(out.dtype)
        sg = (self.s_gate.to(out.dtype) * self.gate_factor).square()
        out = justnorm(out.reshape(B, T, H * D) * torch.sigmoid(g * sg))            # over all heads
        return self.wo(out.to(x.dtype))


class NGPTMLP(MLP):
    """A `-` layer: swiglu with the suv scales, justnorm before the down projection (an `MLP`: w_gate and
    w_up fuse into w_gate_up as any swiglu's)."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.kind = "swiglu"
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w_gate_up: nn.Module | None = None
        self.suv_gate = nn.Parameter(torch.ones(cfg.ffn_dim))
        self.suv_up = nn.Parameter(torch.ones(cfg.ffn_dim))
        self.suv_factor = math.sqrt(cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w_gate_up is not None:
            g, u = self.w_gate_up(x).chunk(2, dim=-1)
        else:
            g, u = self.w_gate(x), self.w_up(x)
        f = torch.promote_types(x.dtype, torch.float32)
        g = g.to(f) * (self.suv_gate.to(f) * self.suv_factor)
        u = u.to(f) * (self.suv_up.to(f) * self.suv_factor)
        return self.w_down(justnorm(F.silu(g) * u).to(x.dtype))


class NGPTBlock(nn.Module):
    """One Dory layer: one sublayer (`attn` or `mlp`, the other None) and the nGPT residual step toward its
    normalized output, at the per-unit rate |alpha * ngpt_alpha_init / std|."""

    def __init__(self, cfg: ModelConfig, block: int):
        super().__init__()
        kind = cfg.layer_pattern[block]
        self.kind = kind
        if kind == "-":
            self.attn, self.mlp = None, NGPTMLP(cfg)
        else:
            self.attn = NGPTAttention(cfg, cfg.sliding_window if kind == "S" else 0, cfg.block_profile(block))
            self.mlp = None
        self.alpha = nn.Parameter(torch.ones(cfg.dim))
        self.alpha_factor = cfg.family_params.get("ngpt_alpha_init", ALPHA_INIT) / cfg.family_params["ngpt_std"]

    def forward(self, x: torch.Tensor, ctx, slot: int | None, ve: torch.Tensor | None = None) -> torch.Tensor:
        out = self.mlp(x) if self.mlp is not None else self.attn(x, ctx, slot)
        a, b = justnorm(x), justnorm(out)
        rate = (self.alpha.to(a.dtype) * self.alpha_factor).abs()
        return justnorm(a + rate * (b - a)).to(x.dtype)

    def native_fields(self) -> dict[str, Any]:
        """What the native library reads of this layer (kernels/executor.py describes it; kernels/layers.py
        `describe` says how): its projections in the shared block fields and, as block kind "ngpt"
        (csrc/dory.cpp), the rest in that file's struct (`NATIVE`): its kind (1 attention, 2 MLP), window, RoPE
        profile, output gate and each scale vector as the product `forward` forms, by the same torch expression
        in fp32 (so the library multiplies by the very values the PyTorch path does)."""
        f = torch.float32
        own: dict[str, Any] = {"alpha": (self.alpha.detach().to(f) * self.alpha_factor).abs()}
        if self.mlp is not None:
            m = self.mlp
            own.update(kind=2, suv_gate=m.suv_gate.detach().to(f) * m.suv_factor,
                       suv_up=m.suv_up.detach().to(f) * m.suv_factor)
            return {"up": [m.w_gate_up] if m.w_gate_up is not None else [m.w_gate, m.w_up], "down": m.w_down,
                    "own": (NATIVE, own)}
        a = self.attn
        own.update(kind=1, window=a.window, profile=a.profile, wg=a.wg,
                   sqk=(a.sqk.detach().to(f) * a.sqk_factor).square(),
                   s_gate=(a.s_gate.detach().to(f) * a.gate_factor).square())
        return {"qkv": [a.wqkv] if a.wqkv is not None else [a.wq, a.wk, a.wv], "wo": a.wo, "own": (NATIVE, own)}


# csrc/dory.cpp's struct NGPT, field by field in its order (kernels/layers.py own_struct lays it out)
NATIVE = ("ngpt", (("kind", "i32"), ("window", "i32"), ("profile", "i32"), ("wg", "linear"), ("sqk", "f32[]"),
                   ("s_gate", "f32[]"), ("alpha", "f32[]"), ("suv_gate", "f32[]"), ("suv_up", "f32[]")))


ALPHA_INIT = 0.05   # ngpt_alpha_init where a config leaves it out


def params(std: float, alpha_init: float = ALPHA_INIT, gate_init: float = 0.0) -> dict:
    """The family's own scalars (`ModelConfig.family_params`): nGPT's init std, which divides every learned scale
    (sqk, s_gate, alpha, the logits'); the residual step's alpha init (|alpha * ngpt_alpha_init / std|); g0 of the
    attention output gate (0: sqrt(dim))."""
    return {"ngpt_std": float(std), "ngpt_alpha_init": float(alpha_init), "gate_logit_init": float(gate_init)}


def check(cfg: ModelConfig) -> None:
    """The family's own scalars, checked where a model is built from them: ConfigError naming the field."""
    p = cfg.family_params
    std = p.get("ngpt_std")
    if not isinstance(std, (int, float)) or not std > 0:
        raise ConfigError(f"nGPT blocks need family_params.ngpt_std > 0, got {std!r}")
    for name in ("ngpt_alpha_init", "gate_logit_init"):
        v = p.get(name, 0.0)
        if not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"family_params.{name} must be a number >= 0, got {v!r}")
    unknown = sorted(set(p) - {"ngpt_std", "ngpt_alpha_init", "gate_logit_init"})
    if unknown:
        raise ConfigError(f"unknown family_params for nGPT blocks: {unknown}")


def init_ngpt(model: nn.Module) -> None:
    """Random weights for a model built from scratch (tests, benchmarks): projections N(0, std), every scale
    vector near std (so each learned scale / std is near 1, as after nGPT's init), the logit scale too."""
    std = model.cfg.family_params["ngpt_std"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.uniform_(0.7 * std, 1.3 * std)


# -- config.json ---------------------------------------------------------------------------------------
# What Dory v1 is (DoryConfig.validate_architecture): any other value changes the forward, refused by name
REQUIRED = {"ngpt": True, "fngpt": True, "ngpt_enable_final_norm": False, "attention_output_gate": True,
            "attention_bias": False, "mlp_bias": False, "mlp_hidden_act": "silu", "tie_word_embeddings": False,
            "initial_state": "input_copy", "input_transform": "residual", "output_transform": "replace",
            "mixer_type": None}
KV_MODES = {"per_loop": "per_loop", "last_loop": "last_loop"}


def _rotary_dim(D: int, factor: Any, key: str, bad: list[str]) -> int:
    try:
        f = float(factor)
    except (TypeError, ValueError):
        bad.append(f"{key} = {factor!r} (a fraction of head_dim)")
        return 0
    r = int(D * f)
    if not (0 < f <= 1) or r <= 0 or r % 2:
        bad.append(f"{key} = {factor!r} (the rotary dims head_dim x factor = {r} must be even and in 1..{D})")
        return 0
    return 0 if r == D else r


def trained_depths(loops: int) -> tuple[int, int]:
    """The depths Dory was trained to be used at (`ModelConfig.trained_loops`): every one from 1 to its
    `n_recurrent_loops` (GGUF: `recurrent_loop_count`), the release's 1-4 (arXiv 2611.03998: post-trained to
    send harder prompts to deeper loops, each depth usable on its own)."""
    return (1, loops)


def config(hf: dict[str, Any], src: Path, eos: list[int], names=None) -> ModelConfig:
    """config.json -> ModelConfig, with DoryConfig's defaults for what it leaves out; ConvertError naming every
    field that is not Dory v1."""
    bad: list[str] = []
    version = hf.get("dory_format_version", 1)
    if version != 1:
        bad.append(f"dory_format_version = {version!r} (TinyLoop reads format version 1)")
    arch = hf.get("architectures") or ["DoryForCausalLM"]
    if "DoryForCausalLM" not in arch:
        bad.append(f"architectures = {arch!r} (DoryForCausalLM)")
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", quant) if isinstance(quant, dict) else quant
        algo = quant.get("quant_algo") if isinstance(quant, dict) else None
        bad.append(f"quantization_config {method!r}{f' ({algo})' if algo else ''}: a pre-quantized checkpoint (the "
                   "NVFP4 release) is not converted; convert the BF16 one and quantize it with TinyLoop (pull NAME:int4)")
    for key, want in REQUIRED.items():
        if hf.get(key, want) != want:
            bad.append(f"{key} = {hf[key]!r} (Dory v1: {want!r})")
    if hf.get("rope_scaling"):
        bad.append(f"rope_scaling = {hf['rope_scaling']!r} (Dory v1 has none)")
    d, H = hf["hidden_size"], hf["num_attention_heads"]
    Hkv = hf.get("num_key_value_heads") or H
    D = hf.get("attention_head_dim") or hf.get("head_dim") or d // H
    if hf.get("head_dim") not in (None, D):
        bad.append(f"head_dim = {hf['head_dim']!r} (attention_head_dim is {D}; they must agree)")
    for swa, full, value in (("swa_num_attention_heads", "num_attention_heads", H),
                             ("swa_num_key_value_heads", "num_key_value_heads", Hkv),
                             ("swa_head_dim", "attention_head_dim", D)):
        if hf.get(swa) not in (None, value):
            bad.append(f"{swa} = {hf[swa]!r} (sliding-window heads shaped unlike the full ones: {full} {value})")
    if H % Hkv:
        bad.append(f"num_attention_heads = {H} (not a multiple of num_key_value_heads {Hkv})")
    n = hf["num_hidden_layers"]
    P, K = hf.get("n_input_layers", 0), hf.get("n_output_layers", 0)
    C = hf.get("n_recurrent_layers")
    C = n - P - K if C is None else C
    if min(P, C, K) < 0 or P + C + K != n:
        bad.append(f"n_input_layers {P} + n_recurrent_layers {C} + n_output_layers {K} != num_hidden_layers {n}")
    if C < 1:
        bad.append(f"n_recurrent_layers = {C} (a looped model needs a recurrent block)")
    pattern = hf.get("hybrid_layer_pattern")
    pattern = "S-S-S-*-" * (n // 8) if pattern is None else pattern
    if not isinstance(pattern, str) or len(pattern) != n or set(pattern) - set("S*-"):
        bad.append(f"hybrid_layer_pattern = {pattern!r} (one of S, *, - per layer: {n})")
        pattern = ""
    loops = hf.get("n_recurrent_loops", 1)
    if not isinstance(loops, int) or isinstance(loops, bool) or loops < 1:
        bad.append(f"n_recurrent_loops = {loops!r} (a positive integer)")
        loops = 1
    mode = hf.get("recurrent_kv_cache_mode", "per_loop")
    if mode not in KV_MODES:
        bad.append(f"recurrent_kv_cache_mode = {mode!r} (per_loop or last_loop)")
    profiles = hf.get("rope_profile_layers")
    profiles = [1] * n if profiles is None else profiles
    no_rope = hf.get("no_rope_layers")
    no_rope = [0] * n if no_rope is None else no_rope
    if not isinstance(profiles, list) or len(profiles) != n or any(p not in (0, 1, 2) for p in profiles):
        bad.append(f"rope_profile_layers = {profiles!r} (1 or 2 per layer)")
        profiles = [1] * n
    elif 0 in profiles:
        bad.append(f"rope_profile_layers = {profiles!r}: profile 0 (NoPE layers) is not Dory v1")
    if not isinstance(no_rope, list) or len(no_rope) != n or any(no_rope):
        bad.append(f"no_rope_layers = {no_rope!r} (NoPE layers are not Dory v1: all 0)")
    window = hf.get("swa_window_size", 1024)
    if "S" in pattern and (not isinstance(window, int) or window <= 0):
        bad.append(f"swa_window_size = {window!r} (S layers need a positive window)")
    std = hf.get("init_method_std", 0.02)
    if not isinstance(std, (int, float)) or not std > 0:
        bad.append(f"init_method_std = {std!r} (must be positive)")
    theta = float(hf.get("rope_theta", 10000))
    theta2 = hf.get("rope_theta_2")
    theta2 = theta if theta2 is None else float(theta2)
    f1 = hf.get("partial_rotary_factor", 1.0)
    f2 = hf.get("partial_rotary_factor_2")
    f2 = f1 if f2 is None else f2
    r1 = _rotary_dim(D, f1, "partial_rotary_factor", bad)
    r2 = _rotary_dim(D, f2, "partial_rotary_factor_2", bad)
    g0 = hf.get("attention_output_gate_logit_scale_init")
    g0 = math.sqrt(d) if g0 is None else g0
    if not isinstance(g0, (int, float)) or not g0 > 0:
        bad.append(f"attention_output_gate_logit_scale_init = {g0!r} (must be positive)")
    need(not bad, src, "; ".join(bad) + ": not supported (TinyLoop runs NVIDIA Dory format version 1)")
    attn_profiles = [p for p, c in zip(profiles, pattern) if c != "-"]
    two = 2 in attn_profiles and (theta2, r2) != (theta, r1)   # a second profile that differs from the first
    return ModelConfig(dim=d, n_heads=H, n_kv_heads=Hkv, head_dim=D, ffn_dim=hf["intermediate_size"], n_prelude=P,
                       n_core=C, n_coda=K, vocab_size=hf["vocab_size"], default_loops=loops,
                       max_loops=max(64, 4 * loops), max_seq_len=hf.get("max_position_embeddings", 8192),
                       rope_theta=theta, rotary_dim=r1, rope_theta_2=theta2 if two else 0.0,
                       rotary_dim_2=r2 if two else 0, rope_profile=tuple(profiles) if two else (),
                       mlp="swiglu", tie_embeddings=False, injection="add", loop_start="embed", loop_norm=False,
                       head_norm=False, layer_pattern=pattern, sliding_window=window if "S" in pattern else 0,
                       family_params=params(std, hf.get("ngpt_alpha_init", ALPHA_INIT), g0),
                       kv_mode=KV_MODES[mode], trained_loops=trained_depths(loops),
                       eos_token_id=eos[0], eos_token_ids=tuple(eos[1:]))


# -- tensors -------------------------------------------------------------------------------------------
def rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor | None:
    """perm[j] = the checkpoint's dim that TinyLoop's head dim j takes (None: the identity, full rotary). The
    checkpoint's pairs (i, i + R/2), i < R/2, land on (i, i + D/2); its unrotated dims R.. fill pairs R/2 ..
    D/2 - 1 (the first half of them at j < D/2, the second half at j >= D/2 + R/2)."""
    D, R = head_dim, rotary_dim
    if R in (0, D):
        return None
    rest = (D - R) // 2
    return torch.cat([torch.arange(0, R // 2), torch.arange(R, R + rest),
                      torch.arange(R // 2, R), torch.arange(R + rest, D)])


def block_of(cfg: ModelConfig, layer: int) -> tuple[str, int]:
    """A checkpoint layer index -> (TinyLoop's block prefix, the block's number in prelude-core-coda order)."""
    P, C = cfg.n_prelude, cfg.n_core
    if layer < P:
        return f"prelude.{layer}", layer
    if layer < P + C:
        return f"core.{layer - P}", layer
    if layer < P + C + cfg.n_coda:
        return f"coda.{layer - P - C}", layer
    raise ConvertError(f"layer {layer} is past the config's {P + C + cfg.n_coda} layers")


_ATTN = {"mixer.v_proj.weight": "attn.wv.weight", "mixer.g_proj.weight": "attn.wg.weight",
         "mixer.o_proj.weight": "attn.wo.weight", "mixer.s_gate": "attn.s_gate", "attn_alpha": "alpha"}
_MLP = {"mixer.gate_proj.weight": "mlp.w_gate.weight", "mixer.up_proj.weight": "mlp.w_up.weight",
        "mixer.down_proj.weight": "mlp.w_down.weight", "mixer.suv_gate": "mlp.suv_gate",
        "mixer.suv_up": "mlp.suv_up", "mlp_alpha": "alpha"}
_PERMUTED = {"mixer.q_proj.weight": "attn.wq.weight", "mixer.k_proj.weight": "attn.wk.weight",
             "mixer.sqk": "attn.sqk"}
TOP = {"backbone.embeddings.weight": "embed.weight", "lm_head.weight": "lm_head.weight",
       "lm_head.logit_scale": "logit_scale"}


def tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    """One checkpoint tensor -> TinyLoop's name(s); False for a name that is not Dory's. q, k and sqk rows are
    permuted within each head where the layer's rotary is partial (`rotary_permutation`)."""
    if name in TOP:
        emit(TOP[name], t)
        return True
    parts = name.split(".")
    if len(parts) < 4 or parts[:2] != ["backbone", "layers"] or not parts[2].isdigit():
        return False
    base, b = block_of(cfg, int(parts[2]))
    rest, kind = ".".join(parts[3:]), cfg.layer_pattern[b]
    table = _MLP if kind == "-" else {**_ATTN, **_PERMUTED}
    if rest not in table:
        return False
    if rest in _PERMUTED:
        D = cfg.head_dim
        perm = rotary_permutation(D, cfg.rotary_dim_2 if cfg.block_profile(b) == 2 else cfg.rotary_dim)
        if perm is not None:
            if t.shape[0] % D:
                raise ConvertError(f"{name} has shape {list(t.shape)}: rows are not whole heads of {D}")
            t = t.reshape(t.shape[0] // D, D, *t.shape[1:])[:, perm].reshape(t.shape)
    emit(f"{base}.{table[rest]}", t)
    return True


# -- llama.cpp's GGUF (`general.architecture` "dory"; read by tools/gguf.py) ------------------------------
GGUF_TOP = {"token_embd.weight": "embed.weight", "output.weight": "lm_head.weight",
            "dory_logit_scale.weight": "logit_scale"}
GGUF_ATTN = {"attn_q.weight": "attn.wq.weight", "attn_k.weight": "attn.wk.weight", "attn_v.weight": "attn.wv.weight",
             "attn_gate.weight": "attn.wg.weight", "attn_output.weight": "attn.wo.weight",
             "dory_sqk.weight": "attn.sqk", "dory_s_gate.weight": "attn.s_gate", "dory_alpha.weight": "alpha"}
GGUF_MLP = {"ffn_gate.weight": "mlp.w_gate.weight", "ffn_up.weight": "mlp.w_up.weight",
            "ffn_down.weight": "mlp.w_down.weight", "dory_suv_gate.weight": "mlp.suv_gate",
            "dory_suv_up.weight": "mlp.suv_up", "dory_alpha.weight": "alpha"}


def _gguf_int(g: Any, key: str, default: Any = None) -> int:
    v = g.arch_key(key, default)
    if isinstance(v, list):   # (per-layer arrays: one value throughout, or refused)
        if len(set(v)) != 1:
            raise ConvertError(f"{g.path}: {g.arch}.{key} differs between layers ({sorted(set(v))})")
        v = v[0]
    if v is None:
        raise ConvertError(f"{g.path}: no {g.arch}.{key} in the metadata")
    return int(v)


def gguf_config(g: Any, eos: list[int]) -> ModelConfig:
    """A `dory` GGUF's metadata (llama.cpp's keys: `dory.input_layer_count`, `recurrent_layer_count`,
    `output_layer_count`, `recurrent_loop_count`, `layer_pattern`, `rope.profile`, `rope.freq_base(_2)`,
    `init_std`, `alpha_init`, `gate_init`, `recurrent_kv_cache_mode`, `attention.sliding_window`) -> ModelConfig;
    ConvertError naming each key that is not Dory v1."""
    bad: list[str] = []
    d, H = _gguf_int(g, "embedding_length"), _gguf_int(g, "attention.head_count")
    Hkv = _gguf_int(g, "attention.head_count_kv", H)
    D = _gguf_int(g, "attention.key_length", d // H)
    if _gguf_int(g, "attention.value_length", D) != D:
        bad.append(f"{g.arch}.attention.value_length {g.arch_key('attention.value_length')} != key_length {D}")
    rot = _gguf_int(g, "rope.dimension_count", D)
    if not 0 < rot <= D or rot % 2:
        bad.append(f"{g.arch}.rope.dimension_count = {rot} (even, in 1..{D})")
    P, C, K = (_gguf_int(g, f"{k}_layer_count") for k in ("input", "recurrent", "output"))
    n = _gguf_int(g, "block_count")
    if P + C + K != n or C < 1:
        bad.append(f"{g.arch}.input/recurrent/output_layer_count {P} + {C} + {K} != block_count {n}")
    loops = _gguf_int(g, "recurrent_loop_count", 1)
    pattern = g.arch_key("layer_pattern")
    if not isinstance(pattern, str) or len(pattern) != n or set(pattern) - set("S*-"):
        bad.append(f"{g.arch}.layer_pattern = {pattern!r} (one of S, *, - per layer: {n})")
        pattern = ""
    profiles = g.arch_key("rope.profile") or [1] * n
    if len(profiles) != n or any(p not in (1, 2) for p in profiles):
        bad.append(f"{g.arch}.rope.profile = {profiles!r} (1 or 2 per layer; 0, NoPE, is not Dory v1)")
        profiles = [1] * n
    mode = g.arch_key("recurrent_kv_cache_mode", "per_loop")
    if mode not in KV_MODES:
        bad.append(f"{g.arch}.recurrent_kv_cache_mode = {mode!r} (per_loop or last_loop)")
    window = g.arch_key("attention.sliding_window")
    if "S" in pattern and not (isinstance(window, int) and window > 0):
        bad.append(f"{g.arch}.attention.sliding_window = {window!r} (S layers need a positive window)")
    scales = {k: g.arch_key(k) for k in ("init_std", "alpha_init", "gate_init")}
    for k, v in scales.items():
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            bad.append(f"{g.arch}.{k} = {v!r} (must be positive)")
    names = set(g.tensors)
    biased = sorted(x for x in names if x.endswith(".bias"))
    if biased:
        bad.append(f"tensor {biased[0]!r} (biased projections are not Dory v1)")
    if "output.weight" not in names:
        bad.append("no output.weight (a tied head is not Dory v1)")
    if bad:
        raise ConvertError(f"{g.path}: {'; '.join(bad)}: not supported (TinyLoop runs NVIDIA Dory format version 1)")
    theta = float(g.arch_key("rope.freq_base", 10000.0))
    theta2 = float(g.arch_key("rope.freq_base_2", theta))
    r = 0 if rot == D else rot
    two = any(p == 2 for p, c in zip(profiles, pattern) if c != "-") and theta2 != theta
    tokens = g.get("tokenizer.ggml.tokens") or []
    vocab = g.shape("token_embd.weight")[0]
    return ModelConfig(dim=d, n_heads=H, n_kv_heads=Hkv, head_dim=D, ffn_dim=_gguf_int(g, "feed_forward_length"),
                       n_prelude=P, n_core=C, n_coda=K, vocab_size=max(vocab, len(tokens)), default_loops=loops,
                       max_loops=max(64, 4 * loops), max_seq_len=_gguf_int(g, "context_length", 8192),
                       rope_theta=theta, rotary_dim=r, rope_theta_2=theta2 if two else 0.0,
                       rotary_dim_2=r if two else 0, rope_profile=tuple(profiles) if two else (), mlp="swiglu",
                       tie_embeddings=False, injection="add", loop_start="embed", loop_norm=False, head_norm=False,
                       layer_pattern=pattern, sliding_window=window if "S" in pattern else 0,
                       family_params=params(scales["init_std"], scales["alpha_init"], scales["gate_init"]),
                       kv_mode=KV_MODES[mode],
                       trained_loops=trained_depths(loops), eos_token_id=eos[0], eos_token_ids=tuple(eos[1:]))


def gguf_tensor(cfg: ModelConfig, g: Any, name: str, t: torch.Tensor, emit: Emit) -> bool:
    """One GGUF tensor -> TinyLoop's name; False for a name that is not Dory's. llama.cpp's Dory converter keeps
    Hugging Face's q/k row order (NeoX RoPE: no interleaving permutation), so only partial rotary permutes."""
    if name in GGUF_TOP:
        emit(GGUF_TOP[name], t)
        return True
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return False
    base, b = block_of(cfg, int(parts[1]))
    rest = ".".join(parts[2:])
    table = GGUF_MLP if cfg.layer_pattern[b] == "-" else GGUF_ATTN
    if rest not in table:
        return False
    if rest in ("attn_q.weight", "attn_k.weight", "dory_sqk.weight"):
        perm = rotary_permutation(cfg.head_dim, cfg.rotary_dim_2 if cfg.block_profile(b) == 2 else cfg.rotary_dim)
        if perm is not None:
            D = cfg.head_dim
            t = t.reshape(t.shape[0] // D, D, *t.shape[1:])[:, perm].reshape(t.shape)
    emit(f"{base}.{table[rest]}", t)
    return True


FAMILY = Family(name="dory", summary="NVIDIA Nemotron-Labs Dory1.0 (DoryForCausalLM)", config=config,
                tensors=lambda cfg, hf: tensor, builds=lambda cfg: cfg.ngpt, block=NGPTBlock, init=init_ngpt,
                check=check, logit_divisor=lambda cfg: cfg.family_params["ngpt_std"],
                extra={"gguf_config": gguf_config, "gguf_tensor": gguf_tensor})
