"""Server test fixtures: live servers on loopback (in-process uvicorn threads, or `tinyloop serve`
subprocesses) and a "forced" model whose greedy continuation is known exactly."""

from __future__ import annotations

import json
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
from tinyloop.modelfile.loader import write_model

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


def write_tool_turn_model(path: Path, tokenizer, call: list[int], answer: list[int], markers: list[int], *,
                          max_seq_len: int = 32768) -> Path:
    """A tiny model that decides by the conversation: it writes `call` until one of `markers` (tokens that only
    a tool's result brings, e.g. a file's content) is anywhere in its context, then `answer`. An agent's tool
    round trip through the real engine, cache and tool constraint: the first turn calls the tool, the turn
    that carries its result answers. `call` and `answer` are token lists that start at the prompt's last token
    (the ":" the chat template ends with) and end with end-of-text.

    Every chain token's embedding is a basis vector; the markers' are others. The prelude block's attention is
    the detector: the query of every chain token and the key of every marker meet on RoPE's slowest pair (a
    theta of 1e12 keeps it still over 32k positions) with a score of ~50, so a chain token's attention is all on
    the markers when there are any, and its output (the markers' value) sets a flag dimension; without a marker
    it averages values that are all zero. The other blocks are identities. The untied head maps each chain
    token to its successors, ranked (later in `call` first, then `answer`'s): where a token has more than one,
    the tool constraint masks the ones that do not fit (the generic format's JSON is held to its schema, free
    text only inside strings), so a token may repeat across structure but not inside a string with two
    continuations. The flag adds to every token of `answer`, more than the ranks differ, so with a marker in
    context `answer` wins wherever it and `call` part."""
    cfg = preset("tiny").replace(tie_embeddings=False, max_seq_len=max_seq_len, rope_theta=1e12)
    chain = list(dict.fromkeys([*call, *answer]))
    dims = {tok: i for i, tok in enumerate([*chain, *markers])}
    flag = len(dims)
    assert flag < cfg.dim, f"{flag + 1} dimensions needed, the model has {cfg.dim}"
    assert not set(markers) & set(chain), "a marker token is in the scripts"
    model = build_model(cfg, seed=0)
    unit, boost, slow = 4.0, 6.0, cfg.head_dim - 1   # slow: the last RoPE pair (half-split: D/2-1 and D-1)
    with torch.no_grad():
        for blk in [*model.prelude, *model.core, *model.coda]:
            for w in (blk.attn.wq, blk.attn.wk, blk.attn.wv, blk.attn.wo, blk.mlp.w_down):
                w.weight.zero_()
        model.embed.weight.zero_()
        model.lm_head.weight.zero_()
        for tok, i in dims.items():
            model.embed.weight[tok, i] = 1.0
        attn = model.prelude[0].attn   # pre-norm: a basis vector reaches it as sqrt(dim) times itself
        for tok in chain:
            attn.wq.weight[slow, dims[tok]] = 1.5            # head 0
        for tok in markers:
            attn.wk.weight[slow, dims[tok]] = 1.5            # kv head 0 (heads 0 and 1 read it)
            attn.wv.weight[0, dims[tok]] = cfg.dim ** -0.5   # value: 1.0 in kv head 0's first channel
        attn.wo.weight[flag, 0] = 1.0                        # head 0's first channel -> the flag
        successors: dict[int, list[int]] = {}
        for script in (call[::-1], answer[::-1]):             # reversed: the later occurrence ranks first
            for nxt, tok in zip(script, script[1:]):
                if nxt not in successors.setdefault(tok, []):
                    successors[tok].append(nxt)
        for tok, nexts in successors.items():
            assert len(nexts) <= 5, f"token {tok} has too many successors: {nexts}"
            for rank, nxt in enumerate(nexts):
                model.lm_head.weight[nxt, dims[tok]] = unit * (10 - rank)
        for tok in set(answer):
            model.lm_head.weight[tok, flag] = unit * boost
    return write_model(path, model, tokenizer=tokenizer, provenance={"tool": "tests/server", "forced": True})


# What the agent tests' file holds: GPT-2 writes it as "Solid" + "GoldMagikarp", and after a space as one token,
# both tokens that no agent's prompt carries (the marker's tokens for write_tool_turn_model).
MARKER = "SolidGoldMagikarp"
ANSWER = "Done."


def write_agent_tool_model(path: Path, tokenizer, name: str, arguments: dict) -> Path:
    """write_tool_turn_model for an agent's turn: it calls `name` with `arguments` in the generic tool format until
    MARKER comes back in a tool's result, then answers ANSWER."""
    def script(reply: dict) -> list[int]:
        return tokenizer.encode(":") + tokenizer.encode(json.dumps(reply)) + [tokenizer.eos_id]

    markers = [tokenizer.encode(" " + MARKER)[0], tokenizer.encode(MARKER)[-1]]
    assert len(tokenizer.encode(" " + MARKER)) == 1 and len(set(markers)) == 2
    return write_tool_turn_model(path, tokenizer, script({"tool_calls": [{"name": name, "arguments": arguments}]}),
                                 script({"response": ANSWER}), markers)


@pytest.fixture(scope="session")
def forced_chain(tokenizer) -> list[int]:
    return tokenizer.encode(FORCED_TEXT)


@pytest.fixture(scope="session")
def forced_model_path(tmp_path_factory, forced_chain, tokenizer):
    return write_forced_model(tmp_path_factory.mktemp("forced") / "forced.tinyloop", forced_chain, tokenizer,
                              max_seq_len=9000)


class ServerThread:
    """`create_app` under uvicorn in a thread of this process, on a free loopback port."""

    def __init__(self, settings, *, record: bool = False):
        """`record`: keep every POST's path and JSON body, in order, in `requests` (what a client sent)."""
        import uvicorn

        from tinyloop.server.app import create_app

        self.app = create_app(settings)
        self.requests: list[tuple[str, dict]] = []
        if record:
            @self.app.middleware("http")
            async def keep(request, call_next):
                if request.method == "POST":
                    self.requests.append((request.url.path, json.loads(await request.body() or b"null")))
                return await call_next(request)

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
