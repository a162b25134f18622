"""Server test fixtures: live servers on loopback (in-process uvicorn threads, or `tinyloop serve`
subprocesses) and a "forced" model whose greedy continuation is known exactly."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from tinyloop.config import preset
from tinyloop.model import build_model
from tinyloop.modelfile import write_model

# A cycle of distinct tokens: an emoji split over two tokens, CJK characters split over three and two,
# and a stop string that spans a token boundary ("rld ST" = end of " world" + start of " STOP").
FORCED_TEXT = " Hi🙂 there said 日本 world STOP here"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_bin(name: str, env_var: str) -> str | None:
    """A real agent's command: `env_var`, else `name` on PATH, else the venv's pinned copy (`make agents`)."""
    local = Path(sys.prefix) / "agents" / "node_modules" / ".bin" / name
    return os.environ.get(env_var) or shutil.which(name) or (str(local) if local.exists() else None)


def write_forced_model(path: Path, chain: list[int], tokenizer, *, max_seq_len: int = 256) -> Path:
    """A tiny model that, from any token of `chain`, predicts the next one (cyclically) with logit 80.

    Every block's output projections are zero (blocks are identities), each chain token's embedding is
    a distinct basis vector, and the untied head maps basis vector i to token chain[i+1]. So greedy and
    sampled decoding both follow the chain, through the real engine, cache, sampler and detokenizer.
    """
    assert len(set(chain)) == len(chain), "chain tokens must be distinct"
    cfg = preset("tiny").replace(tie_embeddings=False, max_seq_len=max_seq_len)
    assert len(chain) <= cfg.dim
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        for blk in [*model.prelude, *model.core, *model.coda]:
            blk.attn.wo.weight.zero_()
            blk.mlp.w_down.weight.zero_()
        model.embed.weight.zero_()
        model.lm_head.weight.zero_()
        for i, tok in enumerate(chain):
            model.embed.weight[tok, i] = 1.0
            model.lm_head.weight[chain[(i + 1) % len(chain)], i] = 10.0
    return write_model(path, model, tokenizer=tokenizer, provenance={"tool": "tests/server", "forced": True})


@pytest.fixture(scope="session")
def forced_chain(tokenizer) -> list[int]:
    return tokenizer.encode(FORCED_TEXT)


@pytest.fixture(scope="session")
def forced_model_path(tmp_path_factory, forced_chain, tokenizer):
    return write_forced_model(tmp_path_factory.mktemp("forced") / "forced.tinyloop", forced_chain, tokenizer,
                              max_seq_len=9000)


class ServerThread:
    """`create_app` under uvicorn in a thread of this process, on a free loopback port."""

    def __init__(self, settings):
        import uvicorn

        from tinyloop.server.app import create_app

        self.app = create_app(settings)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        wait_loaded(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def wait_loaded(url: str, timeout: float = 60.0, headers: dict | None = None) -> httpx.Response:
    """Poll /health until the engine finished loading (200, or 503 with status 'failed')."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(url + "/health", timeout=2, headers=headers)
            if r.status_code == 200 or r.json().get("status") == "failed":
                return r
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"server at {url} never finished loading"
        time.sleep(0.1)


class ServeProcess:
    """`tinyloop serve` exactly as the README starts it, in a subprocess on a free loopback port."""

    def __init__(self, model: Path | None, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("tinyloop")
        cmd = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        full_env.pop("TINYLOOP_MODEL_PATH", None)  # None: the default model, as on a fresh install
        if model is not None:
            full_env["TINYLOOP_MODEL_PATH"] = str(model)
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def __enter__(self) -> "ServeProcess":
        deadline = time.monotonic() + 90
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"tinyloop serve exited: {self.proc.stdout.read().decode()[-3000:]}")
            try:
                httpx.get(self.url + "/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "tinyloop serve did not start"
                time.sleep(0.1)
        wait_loaded(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_path):
    """In-process server on the random tiny model."""
    from tinyloop.server.settings import Settings

    with ServerThread(Settings(model_path=tiny_model_path)) as srv:
        yield srv


@pytest.fixture(scope="session")
def tiny512_server(tmp_path_factory, tokenizer):
    """In-process server on a random tiny model with a 512-token context (the generic tool prompt of
    structured output and tool calls takes ~200 tokens)."""
    from conftest import varied_model
    from tinyloop.server.settings import Settings

    path = tmp_path_factory.mktemp("tiny512") / "tiny512.tinyloop"
    write_model(path, varied_model(preset("tiny").replace(max_seq_len=512), seed=0), tokenizer=tokenizer)
    with ServerThread(Settings(model_path=path)) as srv:
        yield srv


@pytest.fixture(scope="session")
def forced_server(forced_model_path):
    """In-process server on the forced model (known greedy continuation, long context)."""
    from tinyloop.server.settings import Settings

    with ServerThread(Settings(model_path=forced_model_path)) as srv:
        yield srv


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """One sample's value from /metrics (exact name including labels)."""
    text = httpx.get(url + "/metrics", timeout=5, headers=headers).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def sse_events(raw: bytes) -> list[bytes]:
    """Split a text/event-stream body into its frames, checking the framing on the way."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    return raw[:-2].split(b"\n\n")
