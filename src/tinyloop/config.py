"""Model architecture config: one frozen dataclass, presets, and (de)serialisation.

The `.tinyloop` file header stores `ModelConfig.to_dict()`; nothing about the architecture is ever
inferred from a file name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MLP_KINDS = ("gelu", "swiglu", "relu2")   # relu2: w_down(relu(w_up(x))^2)
INJECTIONS = ("none", "add", "concat-adapter", "diagonal")
# What loop 0 starts from (with an injection):
#   state  the state is zeros (or, with a state seed, the family's random draw), injected as every loop's
#   embed  the state is the prelude output e, injected as every loop's (retrofitted OLMo's "embed-init")
#   skip   loop 0 runs the core on e itself, no injection; later loops inject (its "skip-adapter")
LOOP_STARTS = ("state", "embed", "skip")
# Where a block's norms sit (f = attention or MLP, n1/n2 its two norms):
#   pre                x = x + f(n1(x))                  (GPT-2/llama; one norm per branch)
#   sandwich           x = x + n2(f(n1(x)))              (the branch output is normed too)
#   sandwich-residual  x = n2(x + f(n1(x)))              (the residual stream is normed after the add)
#   post               x = x + n2(f(x))                  (OLMo-2: only the branch output is normed)
NORM_PLACEMENTS = ("pre", "sandwich", "sandwich-residual", "post")
# nGPT single-sublayer blocks (`ModelConfig.ngpt`): one character per block, prelude, core, coda:
#   S  sliding-window attention (`sliding_window`)    *  full attention    -  MLP
LAYER_KINDS = "S*-"
# Where a recurrent (core) layer's keys live across loops:
#   per_loop   one cache per loop: loop r attends to every token's loop-r keys
#   last_loop  one cache per core layer that every loop overwrites with the current call's keys: loop r sees
#              this call's tokens at loop r and earlier calls' tokens at the last loop they ran
KV_MODES = ("per_loop", "last_loop")


class ConfigError(ValueError):
    """A config that cannot describe a model."""


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_heads: int
    ffn_dim: int
    n_prelude: int
    n_core: int
    n_coda: int
    vocab_size: int = 50257
    n_kv_heads: int | None = None  # None -> n_heads (no GQA)
    # Width of one attention head. None -> dim // n_heads; set where n_heads * head_dim != dim (e.g.
    # 48 heads of 128 on a 3072 hidden, so q and the attention output are wider than the residual stream).
    head_dim: int | None = None
    default_loops: int = 8
    max_loops: int = 64
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3's RoPE frequency rescaling (rope_type "llama3"): (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); () none. See `model.layers.rope_frequencies`.
    rope_llama3: tuple[float, ...] = ()
    mlp: str = "swiglu"
    tie_embeddings: bool = True
    # How each loop receives the prelude output e:
    #   none           - loop 0 starts from e, later loops see only the state
    #   add            - every loop's input is state + e (state starts at 0)
    #   concat-adapter - every loop's input is Linear(2*dim -> dim)(cat(state, e))
    #   diagonal       - every loop's input is state * exp(-softplus(dt) * exp(A_log)) + softplus(dt) * (e B^T)
    #                    (per-channel decay and step dt, B (dim, dim); state starts at 0)
    injection: str = "add"
    loop_start: str = "state"           # LOOP_STARTS
    # RMSNorm at the end of every loop (keeps the state's scale fixed). Without it the loops form a
    # tied-weight pre-norm residual stack (Universal-Transformer style) whose updates accumulate.
    loop_norm: bool = True
    eos_token_id: int = 50256
    # Architecture features of imported families (defaults: TinyLoop's own models; see docs/models.md)
    norm_placement: str = "pre"
    qk_bias: bool = False               # a learned bias on q and k (per head and dim), added before RoPE
    embed_scale: float = 1.0            # the embedding is multiplied by this (e.g. sqrt(dim))
    post_loop_norm: bool = False        # the final norm also ends the recurrence, before the coda
    head_norm: bool = True              # the final norm before the LM head (off where the loop norm already did)
    exit_gate: bool = False             # a learned per-loop exit gate Linear(dim -> 1) with bias
    # A family's random initial state rule (used only when a model is given a state seed; the default
    # state is zeros): N(0, std) truncated at +-3 std, times embed_scale. 0: the family has no such rule.
    state_init_std: float = 0.0
    eos_token_ids: tuple[int, ...] = ()  # more ids that end generation, besides eos_token_id
    # Read-in and read-out pieces (docs/models.md):
    prelude_norm: bool = False          # an RMSNorm ends the prelude (its output is the loop input e)
    state_proj: bool = False            # Linear(dim -> dim) on the state after the last loop, before the coda (C)
    qk_norm: bool = False               # parameter-free RMSNorm of each q and k head after RoPE
    # OLMo-2's q/k norms: an RMSNorm with weights over all q heads together (n_heads * head_dim wide) and
    # one over all k heads (n_kv_heads * head_dim), right after the projection, before any bias and RoPE
    qk_norm_full: bool = False
    logit_softcap: float = 0.0          # logits -> c * tanh(logits / c) when c > 0
    # Blocks (numbered prelude 0.., then core, then coda) whose attention values get a per-token value
    # embedding: v + 2 * sigmoid(Linear(ve_gate_channels -> n_kv_heads)(x[:ve_gate_channels])) * ve[token],
    # the gate per kv head, ve an Embedding(vocab, n_kv_heads * head_dim) of the block's own
    value_embeds: tuple[int, ...] = ()
    ve_gate_channels: int = 32
    # RoPE beyond one base: `rotary_dim` (0: head_dim) rotates the pairs (j, j + D/2) for j <
    # rotary_dim / 2 at theta^(-2j / rotary_dim) and leaves the others as they are (a checkpoint's partial
    # rotary, its q/k rows permuted to that order at conversion by the family's module); a second profile
    # (`rope_theta_2`, `rotary_dim_2`) and one profile, 1 or 2, per block in `rope_profile` (() : all 1)
    rotary_dim: int = 0
    rope_theta_2: float = 0.0
    rotary_dim_2: int = 0
    rope_profile: tuple[int, ...] = ()
    # single-sublayer blocks on the sphere (`ngpt`): non-empty, one LAYER_KINDS character per block, each block
    # one sublayer made by the family that builds them (`model.families`: Family.builds); loops enter as
    # l2norm(state + e), end with l2norm, no final norm, the head's logits scaled per token by the `logit_scale`
    # vector (over the family's `logit_divisor`)
    layer_pattern: str = ""
    sliding_window: int = 0             # the keys an S block's query sees: its own and the W - 1 before it
    kv_mode: str = "per_loop"           # KV_MODES
    # The depths the model was trained to be used at, (shallowest, deepest), as its family declares them
    # (`model.families`: e.g. every depth 1..n the checkpoint was trained at); () : none declared. `loops` beyond
    # it is still allowed up to max_loops; `reasoning_effort` picks a depth inside it (`effort_loops`, docs/server.md)
    trained_loops: tuple[int, ...] = ()
    # A family's own scalars, by name (its init scales, a gate's initial logit, ...): read and checked by the module
    # of the family that builds the model's blocks (`model.families`: Family.check), nothing else reads them
    family_params: dict[str, Any] = field(default_factory=dict, hash=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        object.__setattr__(self, "n_kv_heads", kv)
        explicit_head_dim = self.head_dim is not None
        if self.n_heads > 0 and not explicit_head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        object.__setattr__(self, "value_embeds", tuple(sorted({int(i) for i in self.value_embeds})))
        object.__setattr__(self, "rope_llama3", tuple(float(v) for v in self.rope_llama3))
        object.__setattr__(self, "rope_profile", tuple(int(v) for v in self.rope_profile))
        object.__setattr__(self, "trained_loops", tuple(int(v) for v in self.trained_loops))
        r3 = self.rope_llama3
        n_blocks = self.n_prelude + self.n_core + self.n_coda
        checks = [
            (self.dim > 0 and self.n_heads > 0, "dim and n_heads must be positive"),
            (explicit_head_dim or self.dim % self.n_heads == 0,
             f"dim {self.dim} must be divisible by n_heads {self.n_heads} (or head_dim given)"),
            (kv > 0 and self.n_heads % kv == 0, f"n_heads {self.n_heads} must be a multiple of n_kv_heads {kv}"),
            (self.head_dim > 0 and self.head_dim % 2 == 0, "head dim must be positive and even (RoPE)"),
            (self.ffn_dim > 0, "ffn_dim must be positive"),
            (self.n_prelude >= 0 and self.n_coda >= 0, "n_prelude and n_coda must be >= 0"),
            (self.n_core >= 1, "n_core must be >= 1"),
            (1 <= self.default_loops <= self.max_loops, "need 1 <= default_loops <= max_loops"),
            (self.vocab_size > 0, "vocab_size must be positive"),
            (self.max_seq_len > 0, "max_seq_len must be positive"),
            (self.mlp in MLP_KINDS, f"mlp must be one of {MLP_KINDS}"),
            (self.injection in INJECTIONS, f"injection must be one of {INJECTIONS}"),
            (self.loop_start in LOOP_STARTS, f"loop_start must be one of {LOOP_STARTS}"),
            (self.norm_placement in NORM_PLACEMENTS, f"norm_placement must be one of {NORM_PLACEMENTS}"),
            (self.embed_scale > 0, "embed_scale must be positive"),
            (not r3 or (len(r3) == 4 and r3[0] > 0 and 0 < r3[1] < r3[2] and r3[3] > 0),
             "rope_llama3 must be (factor > 0, low_freq_factor, high_freq_factor > low_freq_factor > 0, "
             "original_max_position_embeddings > 0)"),
            (self.state_init_std >= 0, "state_init_std must be >= 0"),
            (self.head_norm or self.loop_norm or bool(self.layer_pattern),
             "head_norm may be off only when loop_norm (or nGPT's justnorm) ends every loop"),
            (all(0 <= i < self.vocab_size for i in self.eos_token_ids), "eos_token_ids must be inside the vocabulary"),
            (self.logit_softcap >= 0, "logit_softcap must be >= 0"),
            (all(0 <= i < n_blocks for i in self.value_embeds), f"value_embeds must name blocks 0..{n_blocks - 1}"),
            (not self.value_embeds or 0 < self.ve_gate_channels <= self.dim,
             "ve_gate_channels must be in 1..dim"),
        ]
        D = self.head_dim
        checks += [
            (all(0 <= r <= D and r % 2 == 0 for r in (self.rotary_dim, self.rotary_dim_2)),
             f"rotary_dim and rotary_dim_2 must be even and in 0..head_dim ({D})"),
            (self.rope_theta_2 >= 0, "rope_theta_2 must be >= 0"),
            (not self.rope_profile or len(self.rope_profile) == n_blocks, f"rope_profile needs one entry per block ({n_blocks})"),
            (all(p in (1, 2) for p in self.rope_profile), "rope_profile entries must be 1 or 2"),
            (2 not in self.rope_profile or self.rope_theta_2 > 0, "rope_profile 2 needs rope_theta_2 > 0"),
            (self.kv_mode in KV_MODES, f"kv_mode must be one of {KV_MODES}"),
            (self.sliding_window >= 0, "sliding_window must be >= 0"),
            (not self.trained_loops or (len(self.trained_loops) == 2
                                        and 1 <= self.trained_loops[0] <= self.trained_loops[1] <= self.max_loops),
             f"trained_loops must be () or (shallowest, deepest) with 1 <= shallowest <= deepest <= max_loops "
             f"({self.max_loops}), got {self.trained_loops}"),
        ]
        if self.layer_pattern:
            p = self.layer_pattern
            checks += [
                (len(p) == n_blocks and not set(p) - set(LAYER_KINDS),
                 f"layer_pattern needs one of {LAYER_KINDS!r} per block ({n_blocks}), got {p!r}"),
                ("S" not in p or self.sliding_window > 0, "layer_pattern has S blocks: sliding_window must be > 0"),
                (self.mlp == "swiglu" and self.injection == "add" and self.loop_start == "embed",
                 "nGPT blocks run a swiglu MLP, the add injection and loop_start embed"),
                (not (self.loop_norm or self.head_norm or self.post_loop_norm or self.prelude_norm or self.state_proj
                      or self.exit_gate or self.qk_bias or self.qk_norm or self.qk_norm_full or self.value_embeds
                      or self.tie_embeddings or self.logit_softcap or self.embed_scale != 1.0),
                 "nGPT blocks have no RMSNorms, exit gate, q/k bias or norm, value embeddings, soft-cap, embedding "
                 "scale or tied head"),
            ]
        else:
            checks.append((self.kv_mode == "per_loop" and not self.sliding_window,
                           "kv_mode and sliding_window belong to nGPT layer patterns"))
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Every id that ends generation (unless a request ignores EOS)."""
        return frozenset((self.eos_token_id, *self.eos_token_ids))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["head_dim"] == self.dim // self.n_heads:
            del d["head_dim"]  # the default: headers of models with square attention stay as they were
        for name, default in _LEFT_OUT_WHEN_DEFAULT.items():
            if d[name] == default:
                del d[name]  # (fields added later: older headers stay as they were)
        for name in ("value_embeds", "rope_llama3", "rope_profile", "trained_loops"):
            if name in d:
                d[name] = list(getattr(self, name))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        moved = {k: d[k] for k in _NOW_FAMILY_PARAMS if k in d}
        if moved:   # (headers written before family_params: the same values, where the family reads them now)
            d = {**{k: v for k, v in d.items() if k not in moved},
                 "family_params": {**moved, **d.get("family_params", {})}}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown config fields: {unknown}")
        for name in ("value_embeds", "rope_llama3", "rope_profile", "trained_loops"):
            if name in d:
                d = {**d, name: tuple(d[name])}
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in d and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ConfigError(f"missing config fields: {missing}")
        return cls(**d)

    def replace(self, **kw: Any) -> "ModelConfig":
        if "head_dim" not in kw and self.head_dim == self.dim // self.n_heads:
            kw["head_dim"] = None  # the default head width follows a new dim / n_heads
        return dataclasses.replace(self, **kw)

    @property
    def ngpt(self) -> bool:
        """nGPT single-sublayer blocks: `layer_pattern` says each block's kind."""
        return bool(self.layer_pattern)

    def effort_loops(self, effort: str) -> int | None:
        """The depth `reasoning_effort` stands for on this model (`EFFORT_DEPTHS`): inside `trained_loops`,
        "low" (and "none", "minimal") its shallowest depth, "medium" the middle (the lower one of two), "high"
        (and "xhigh", Anthropic's "max") its deepest; None when the model declares no trained range."""
        if not self.trained_loops:
            return None
        lo, hi = self.trained_loops
        return {"shallowest": lo, "middle": (lo + hi) // 2, "deepest": hi}[EFFORT_DEPTHS[effort]]

    def block_profile(self, block: int) -> int:
        """The RoPE profile (1 or 2) of block `block` (numbered prelude, core, coda)."""
        return self.rope_profile[block] if self.rope_profile else 1


# Fields that headers leave out at their default value (so files written before them read the same)
_LEFT_OUT_WHEN_DEFAULT = {"prelude_norm": False, "state_proj": False, "qk_norm": False, "logit_softcap": 0.0,
                          "value_embeds": (), "ve_gate_channels": 32, "qk_norm_full": False, "rope_llama3": (),
                          "loop_start": "state", "rotary_dim": 0, "rope_theta_2": 0.0, "rotary_dim_2": 0,
                          "rope_profile": (), "layer_pattern": "", "sliding_window": 0, "kv_mode": "per_loop",
                          "trained_loops": (), "family_params": {}}
# Fields a family's module reads that headers once held at the top level (read into family_params)
_NOW_FAMILY_PARAMS = ("ngpt_std", "ngpt_alpha_init", "gate_logit_init")

# reasoning_effort (OpenAI's values, and Anthropic's "max") -> where in a model's trained depth range it runs
EFFORT_DEPTHS = {"none": "shallowest", "minimal": "shallowest", "low": "shallowest", "medium": "middle",
                 "high": "deepest", "xhigh": "deepest", "max": "deepest"}


PRESETS: dict[str, ModelConfig] = {
    # The seed's 407M shape: 6 gelu blocks in the core, no prelude/coda, tied embeddings.
    # 6 x 50.3M (blocks) + 102.9M (embedding) = 404.9M parameters.
    "tinyloop-407m": ModelConfig(dim=2048, n_heads=16, ffn_dim=8192, n_prelude=0, n_core=6, n_coda=0,
                                 mlp="gelu", injection="add", max_seq_len=2048),
    # The shape the architecture notes call "small": 384-dim, 4-layer core (benchmarks).
    "tinyloop-small": ModelConfig(dim=384, n_heads=6, ffn_dim=1536, n_prelude=0, n_core=4, n_coda=0,
                                  mlp="gelu", injection="add"),
    # The shipped model's shape (trained by `tinyloop train`, see docs/model-card.md).
    "tinyloop-16m": ModelConfig(dim=256, n_heads=4, ffn_dim=768, n_prelude=1, n_core=2, n_coda=1,
                                mlp="swiglu", injection="none", loop_norm=False, max_seq_len=512),
    # A tiny random model for tests: GQA, every block kind, GPT-2 vocabulary so text works.
    "tiny": ModelConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, n_prelude=1, n_core=2, n_coda=1,
                        default_loops=3, max_seq_len=256, mlp="swiglu", injection="add"),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
