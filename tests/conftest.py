"""Shared fixtures: tiny random models (fast) and the shipped model (end-to-end tests)."""

from __future__ import annotations

import pytest
import torch

from tinyloop.config import preset
from tinyloop.model import build_model
from tinyloop.modelfile import FLOAT_MODEL_NAME, packaged_model_path, write_model
from tinyloop.tokenizer import Tokenizer

# Tiny models are bound by per-op overhead: one thread is fastest and avoids fighting other processes.
torch.set_num_threads(1)


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
