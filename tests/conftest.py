"""Shared fixtures: tiny random models (fast) and the shipped model (end-to-end tests)."""

from __future__ import annotations

import pytest
import torch

from tinyloop.config import preset
from tinyloop.model import KVCache, build_model
from tinyloop.modelfile.loader import FLOAT_MODEL_NAME, LoadedModel, packaged_model_path, write_model
from tinyloop.tokenizer import Tokenizer

# Tiny models are bound by per-op overhead: one thread is fastest and avoids fighting other processes.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _round_costs_start_empty(monkeypatch):
    """Each test's speculation policy starts from what it measures itself: no round costs kept by an earlier
    process on this host (engine/draft_policy.py `round_costs`; the test of keeping them turns it back on)."""
    from tinyloop.engine import draft_policy

    monkeypatch.setattr(draft_policy, "KEEP", False)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def varied_model(cfg, seed=0, dtype=torch.float32):
    """A random model whose greedy outputs vary from token to token.

    At GPT-2 init scale (std 0.02) a random model repeats one token forever, which would let tests of
    stops, loops and speculation pass vacuously; weights 8x larger give chaotic, varied outputs."""
    model = build_model(cfg, seed=seed, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    return model


@torch.inference_mode()
def reference_ids(model, prompt: list[int], params, kv_format: str = "fp16", kv_loops: int | None = None) -> list[int]:
    """Plain generation the simple way: the contiguous cache, the whole prompt in one forward, then one
    `model(...)` call per token. The engine core (pool, batching, chunking, speculation) is tested
    against this."""
    from tinyloop.engine.sampling import Sampler

    loops = params.loops or model.cfg.default_loops
    p = next(model.parameters())
    cache = KVCache(model.cfg, max_positions=len(prompt) + params.max_tokens, loops=loops,
                    window=params.cache_window, kv_format=kv_format, kv_loops=kv_loops,
                    dtype=p.dtype if p.dtype.is_floating_point else torch.float32)
    sampler = Sampler(params, prompt, model.cfg.vocab_size)
    logits = model(torch.tensor([prompt]), loops, cache=cache, start=0, last_only=True)[0, -1]
    cache.length = len(prompt)
    out = []
    for i in range(params.max_tokens):
        tok = sampler.sample(logits)
        sampler.accept(tok)
        out.append(tok)
        if i + 1 < params.max_tokens:
            logits = model(torch.tensor([[tok]]), loops, cache=cache, start=cache.length, last_only=True)[0, -1]
            cache.length += 1
    return out


def core_ids(model, prompt: list[int], params, stats: dict | None = None, kv_format: str = "fp16",
             **speculation) -> list[int]:
    """One request through the engine core (a batch of one) on a bare model: its token ids, with EOS not
    a stop (as in `reference_ids`); `stats` gets the final event's stats."""
    from tinyloop.engine import Engine
    from tinyloop.engine.serving import run_ids

    engine = Engine(LoadedModel(model, None, {}, None), kv_format=kv_format)
    return run_ids(engine, prompt, params.replace(ignore_eos=True), stats=stats, **speculation)


def drive(model, kv, gen):
    """Run a speculator's pass generator alone (each pass, or whole native round, as a step of its own, by the
    engine's batch runner: the draft head's logits and the head's picks included); its return value."""
    from tinyloop.engine.batch import BatchRunner
    from tinyloop.model.paged import Rows

    runner = BatchRunner(model, kv)
    try:
        item = next(gen)
        while True:
            if isinstance(item, Rows) or hasattr(item, "spec"):
                runner.execute([], extra=[item])
            item = next(gen)
    except StopIteration as stop:
        return stop.value


def standalone(model, prompt, params, page_size=4, **kw):
    """A Speculator on a pool of its own: (speculator, pool)."""
    from tinyloop.engine.batch import BatchRunner
    from tinyloop.engine.plan import plan_request
    from tinyloop.engine.sampling import Sampler
    from tinyloop.engine.speculative import Speculator, speculative_layout
    from tinyloop.model.paged import PagedKV

    plan = plan_request(prompt, params, model.cfg, max_seq_len=model.cfg.max_seq_len)
    slots = speculative_layout(model, plan, kw.get("draft_exit", True)).n_slots
    blocks = plan.blocks(page_size)
    kv = PagedKV(model.cfg, blocks * slots, page_size, dtype=model.embed.weight.dtype)
    table = torch.arange(blocks * slots).view(blocks, slots)
    sampler = Sampler(params, prompt, model.cfg.vocab_size, draw=BatchRunner.draw_row)   # (as the engine core's)
    return Speculator(model, plan, sampler, kv, table, **kw), kv


def pool_entries(kv, table, slot, n):
    """Keys and values of positions 0..n-1 of one slot of a pooled sequence: (n, Hkv, D) each."""
    pos = torch.arange(n)
    idx = (table[pos // kv.page_size, slot], pos % kv.page_size)
    return kv.k.read(idx), kv.v.read(idx)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.gpt2()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, tokenizer):
    """A random `tiny` preset model file (float32, GPT-2 vocabulary)."""
    path = tmp_path_factory.mktemp("models") / "tiny.tinyloop"
    write_model(path, varied_model(preset("tiny"), seed=0), tokenizer=tokenizer,
                provenance={"tool": "tests", "trained": False})
    return path


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_path):
    from tinyloop.engine import Engine

    return Engine.load(tiny_model_path)


@pytest.fixture
def tiny64():
    """A float64 tiny model with a small vocabulary: exactness tests (ties impossible)."""
    cfg = preset("tiny").replace(vocab_size=512, eos_token_id=511)
    return varied_model(cfg, seed=0, dtype=torch.float64)


@pytest.fixture(scope="session")
def shipped_model_path():
    path = packaged_model_path()
    if not path.exists():
        pytest.fail(f"the shipped model is missing at {path}")
    return path


@pytest.fixture(scope="session")
def shipped_float_model_path():
    """The trained fp16 model the default int4 one is quantized from."""
    path = packaged_model_path(FLOAT_MODEL_NAME)
    if not path.exists():
        pytest.fail(f"the shipped fp16 model is missing at {path}")
    return path


def edit_header(path, fn) -> None:
    """Rewrite a model file with `fn` applied to its TinyLoop header (the tensors' bytes unchanged)."""
    import json
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    index = json.loads(raw[8:8 + n])
    h = json.loads(index["__metadata__"]["tinyloop"])
    fn(h)
    index["__metadata__"]["tinyloop"] = json.dumps(h)
    new = json.dumps(index).encode()
    new += b" " * ((8 - len(new) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def write_legacy(path, tensors: dict, header: dict, tokenizer) -> None:
    """A model file as TinyLoop wrote it before format version 2: every projection under the PyTorch
    definition's names (`tensors` as a model's state dict or `quantize_model` gives them)."""
    import json

    from safetensors.torch import save_file

    from tinyloop.modelfile.loader import TOKENIZER_TENSOR, tokenizer_blob

    out = {k: v.detach().contiguous() for k, v in tensors.items()}
    out[TOKENIZER_TENSOR] = torch.frombuffer(bytearray(tokenizer_blob(tokenizer)), dtype=torch.uint8)
    save_file(out, str(path), metadata={"tinyloop": json.dumps({**header, "format_version": 1})})
