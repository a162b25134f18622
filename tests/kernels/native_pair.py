"""The pair of models the native kernel tests compare: one model built twice with the same effective weights,
the reference in PyTorch with fp32 weights (quantized codes dequantized, 16-bit weights rounded), the other
holding the weights in the format under test and running through the library (test_native.py,
test_native_speculation.py). Import after checking that the library loads."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from conftest import varied_model
from tinyloop.config import preset
from tinyloop.kernels.executor import NativeExecutor
from tinyloop.model.paged import PagedKV, PagedStep, Rows
from tinyloop.quant.linear import QuantLinear
from tinyloop.quant.packing import pack, quantize_min, quantize_rtn

BASE = preset("tiny").replace(vocab_size=512, eos_token_id=511, max_seq_len=128)
CONFIGS = {
    "tiny": BASE,                                                       # GQA, swiglu, add, prelude/coda
    "gelu-none": BASE.replace(mlp="gelu", injection="none", loop_norm=False, n_kv_heads=4),
    "ouro-like": BASE.replace(n_prelude=0, n_coda=0, injection="none", norm_placement="sandwich",
                              loop_norm=True, head_norm=False, tie_embeddings=False, exit_gate=True),
    "huginn-like": BASE.replace(norm_placement="sandwich-residual", qk_bias=True, embed_scale=math.sqrt(BASE.dim),
                                injection="concat-adapter", loop_norm=False, post_loop_norm=True),
    # GQA 6:1 with heads wider than dim / n_heads (q and the attention output 192 wide on a 64 hidden)
    # retrofitted OLMo-2: post-norm blocks, q/k norms over all heads with weights, loop 0 on e itself (and a
    # variant starting the state from e)
    "olmo-like": BASE.replace(norm_placement="post", qk_norm_full=True, injection="concat-adapter", loop_norm=False,
                              tie_embeddings=False, loop_start="skip", n_heads=4, n_kv_heads=2, head_dim=24),
    "olmo-embed": BASE.replace(norm_placement="post", qk_norm_full=True, injection="concat-adapter",
                               loop_norm=False, tie_embeddings=False, loop_start="embed"),
    "nanbeige-like": BASE.replace(n_heads=12, n_kv_heads=2, head_dim=16, n_prelude=0, n_coda=0, injection="none",
                                  loop_norm=True, head_norm=False, tie_embeddings=False),
    # every Parcae piece: ReLU^2, the diagonal injection (decay and dt varied per channel by make_pair), a
    # prelude norm, C after the loops, q/k norms, value embeddings in a prelude, a core and the coda block
    # (GQA: a gate per kv head), a soft-cap
    "parcae-like": BASE.replace(norm_placement="pre", mlp="relu2", injection="diagonal", loop_norm=False,
                                prelude_norm=True, state_proj=True, qk_norm=True, value_embeds=(0, 2, 3),
                                logit_softcap=30.0, state_init_std=0.2),
}
PAGE = 4


def _linears(model):
    for mod in model.modules():
        for name, child in list(mod.named_children()):
            if type(child) is nn.Linear and name != "lm_head":
                yield mod, name, child


def make_pair(cfg, weights: str):
    """(reference fp32 model, native model) with the same effective weights."""
    ref = varied_model(cfg, seed=1)
    if cfg.qk_norm_full:   # norm weights away from 1, so that q's and k's are told apart
        with torch.no_grad():
            g = torch.Generator().manual_seed(6)
            for blk in [*ref.prelude, *ref.core, *ref.coda]:
                for w in (blk.attn.q_norm.weight, blk.attn.k_norm.weight):
                    w.copy_(1 + 0.5 * torch.randn(w.shape, generator=g))
    if cfg.qk_bias:
        with torch.no_grad():
            for blk in [*ref.prelude, *ref.core, *ref.coda]:
                blk.attn.qk_bias.normal_(0, 1, generator=torch.Generator().manual_seed(5))
    if ref.injection is not None:   # the diagonal injection: a decay and dt of its own per channel
        with torch.no_grad():
            g = torch.Generator().manual_seed(6)
            ref.injection.A_log.normal_(0, 1, generator=g)
            ref.injection.dt_bias.normal_(0, 1, generator=g)
    return native_twin(ref, weights)


def native_twin(ref, weights: str):
    """(ref, its native twin): a copy of `ref` with its block projections (every nn.Linear but the LM head) in
    `weights` ("fp32", "fp16", "bf16", "int8", "int4", "int4-min", "int2") on the native executor, `ref`'s own holding the
    same values in fp32 (dequantized, or rounded to the 16-bit type and back), so both compute with one set of
    effective weights."""
    nat = copy.deepcopy(ref)
    if weights in ("fp16", "bf16"):
        dt = torch.float16 if weights == "fp16" else torch.bfloat16
        for (_, _, r), (_, _, n) in zip(_linears(ref), _linears(nat)):
            w = r.weight.detach().to(dt)
            r.weight.data = w.float()
            n.weight = nn.Parameter(w, requires_grad=False)
    elif weights == "int4-min":   # int4's min form (GGUF Q4_1): w = q * scale + min
        for (rm, rn, r), (nm, nn_, n) in zip(_linears(ref), _linears(nat)):
            q, s, m = quantize_min(r.weight.detach(), 32)
            qw = pack(q, 4)
            setattr(rm, rn, QuantLinear.from_portable(qw, s, None, 4, kernel="dense", mins=m))
            setattr(nm, nn_, QuantLinear.from_portable(qw, s, None, 4, kernel="native", mins=m))
    elif weights.startswith("int"):
        bits = int(weights[3:])
        for (rm, rn, r), (nm, nn_, n) in zip(_linears(ref), _linears(nat)):
            q, s, z = quantize_rtn(r.weight.detach(), bits, None if bits == 8 else 32)
            qw = pack(q, bits)
            setattr(rm, rn, QuantLinear.from_portable(qw, s, z, bits, kernel="dense"))
            setattr(nm, nn_, QuantLinear.from_portable(qw, s, z, bits, kernel="native"))
    nat.executor = NativeExecutor(nat, threads=2)
    return ref.eval(), nat.eval()


def attach_varied_exits(model, seeds: dict[int, int]) -> None:
    """A draft exit for each draft depth d in `seeds`: the model's coda copied (model/draft_exit.py) and moved
    off it by noise of 0.3 x each tensor's mean magnitude (seeded), so that drafts disagree with the verifier
    now and then."""
    from tinyloop.model.draft_exit import DraftExit, attach_draft_exits

    exits = {}
    for d, seed in seeds.items():
        ex = DraftExit.from_model(model)
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            for p in ex.parameters():
                p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g))
        exits[d] = ex.eval()
    attach_draft_exits(model, exits)


def clone_kv(kv: PagedKV) -> PagedKV:
    """A copy of the pool with its own storage (any KV format)."""
    out = copy.copy(kv)
    out.k, out.v = copy.copy(kv.k), copy.copy(kv.v)
    for t in (out.k, out.v):
        t.parts = tuple(p.clone() for p in t.parts)
        if t.bits is None:
            t.data = t.parts[0]
        else:
            t.codes, t.scale, t.offset = t.parts
    return out


@torch.inference_mode()
def prefilled_pool(ref, seqs, page: int, slots: int, kv_format: str = "fp16", kv_dtype=torch.float32):
    """The prompts of `seqs` (each (prompt length, loops, window, ...): random tokens, seed 7) prefilled by `ref`
    (the PyTorch path) into one paged pool of `slots` cache slots, each sequence's pages in a shuffled order:
    (the pool, the block tables, each sequence's next token)."""
    cfg = ref.cfg
    blocks = -(-max(s[0] + 1 for s in seqs) // page)
    kv = PagedKV(cfg, len(seqs) * blocks * slots, page, kv_format, kv_dtype)
    g = torch.Generator().manual_seed(7)
    tables, toks = [], []
    for i, (n, loops, window, *_) in enumerate(seqs):
        table = torch.randperm(blocks * slots, generator=g).view(blocks, slots) + i * blocks * slots
        prompt = torch.randint(0, cfg.vocab_size, (n + 1,), generator=g).tolist()
        ref.run(PagedStep(kv, [Rows(table=table, start=0, n=n, last_loop=loops, tokens=prompt[:n], window=window)],
                          ref.rotary, torch.float32, "cpu"))
        tables.append(table)
        toks.append(prompt[n])
    return kv, tables, toks
