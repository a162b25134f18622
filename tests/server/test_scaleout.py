"""Scale-out on Ray Serve (issue 18): `tinyloop serve --replicas 2` on a loopback Ray cluster against a
single-process server on the same float64 model (greedy choices cannot depend on the batch), so every
answer must be the single process's, byte for byte up to ids and timestamps. One cluster for the module
(about a minute to start on 2 cores); the SIGKILL test runs last and checks the replacement."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray.serve", reason="needs tinyloop[ray]")

from tinyloop.config import preset  # noqa: E402
from tinyloop.modelfile.loader import write_model  # noqa: E402
from tinyloop.server.settings import Settings  # noqa: E402

from .conftest import ServerThread, free_port, sse_events  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
KEY = "scale-out-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


@pytest.fixture(scope="module")
def model64(tmp_path_factory, tokenizer) -> Path:
    from conftest import varied_model

    model = varied_model(preset("tiny").replace(max_seq_len=512), seed=0, dtype=torch.float64)
    return write_model(tmp_path_factory.mktemp("scaleout") / "tiny64.tinyloop", model, tokenizer=tokenizer,
                       provenance={"tool": "tests/server/test_scaleout.py"})


@pytest.fixture(scope="module")
def reference(model64):
    """The single-process server the cluster must answer like."""
    with ServerThread(Settings(model_path=model64, api_key=KEY)) as srv:
        yield srv.url


class Cluster:
    """`tinyloop serve --replicas 2` (or `tinyloop serve ARGS`) in its own process group, Ray's files in a
    temporary directory."""

    def __init__(self, model: Path | None, args: tuple[str, ...] = ("--replicas", "2"), env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tempfile.mkdtemp(prefix="tlray-", dir="/tmp")  # Ray's socket paths must stay short
        self.log = open(Path(self.tmp) / "serve.log", "wb")
        env = {**os.environ, "TINYLOOP_API_KEY": KEY, "OMP_NUM_THREADS": "1", "RAY_TMPDIR": self.tmp,
               "RAY_AUTH_MODE": "disabled", **({"TINYLOOP_MODEL_PATH": str(model)} if model else {}), **(env or {})}
        exe = Path(sys.executable).with_name("tinyloop")
        self.proc = subprocess.Popen([str(exe), "serve", *args, "--port", str(self.port),
                                      "--log-level", "warning"], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.monotonic()

    def wait_ok(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.tail()
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200 and r.json()["status"] == "ok":
                    return r.json()
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"the cluster was not healthy within {timeout_s} s: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return (Path(self.tmp) / "serve.log").read_text(errors="replace")[-3000:]

    def stop(self) -> int | None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(90)
        except subprocess.TimeoutExpired:
            return None
        finally:
            try:  # whatever Ray left in the group (nothing, when shutdown worked)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def cluster(model64):
    c = Cluster(model64)
    try:
        c.wait_ok(240)
        yield c
    finally:
        code = c.stop()
        assert code == 0, f"tinyloop serve --replicas did not stop cleanly ({code}): {c.tail()}"


def normalised(raw: bytes) -> bytes:
    return _VOLATILE.sub(rb'"\1":"-"', raw)


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=120, **kw)


def without_request_id(body: dict) -> dict:
    return {**body, "error": {k: v for k, v in body["error"].items() if k != "request_id"}}


def test_health_auth_metrics(cluster, reference):
    health = httpx.get(cluster.url + "/health").json()
    assert health["replicas"]["ready"] == health["replicas"]["target"] == 2
    assert len({r["pid"] for r in health["replicas"]["each"]}) == 2
    assert all(r["threads"] == 1 and r["kv_pages_free"] > 0 for r in health["replicas"]["each"])
    print(f"\nhealthy {time.monotonic() - cluster.started:.1f} s after start")  # noqa: T201

    for path in ("/v1/models", "/metrics"):  # auth: the same 401 as a single process
        ours, theirs = httpx.get(cluster.url + path), httpx.get(reference + path)
        assert ours.status_code == theirs.status_code == 401
        assert without_request_id(ours.json()) == without_request_id(theirs.json())
    ours, theirs = httpx.get(cluster.url + "/v1/models", headers=AUTH), httpx.get(reference + "/v1/models", headers=AUTH)
    assert ours.json() == theirs.json()
    r = httpx.get(cluster.url + "/v1/models", headers={**AUTH, "X-Request-Id": "mine-1"})
    assert r.headers.get_list("x-request-id") == ["mine-1"]  # Serve's proxy and the app: one header

    text = httpx.get(cluster.url + "/metrics", headers=AUTH).text
    assert 'tinyloop_replicas{state="ready"} 2.0' in text
    assert len(set(re.findall(r'tinyloop_engine_loaded\{replica="([^"]+)"\} 1\.0', text))) == 2


@pytest.mark.parametrize("path,body,status", [
    ("/v1/completions", {"model": "tinyloop", "prompt": "Hi", "loops": 0}, 400),
    ("/v1/completions", {"model": "tinyloop", "prompt": "Hi", "max_tokens": 600}, 400),
    ("/v1/chat/completions", {"model": "tinyloop", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/generate", {"prompt": "Hi", "bogus": 1}, 422),
])
def test_errors_are_the_single_process_errors(cluster, reference, path, body, status):
    ours, theirs = post(cluster.url, path, body), post(reference, path, body)
    assert ours.status_code == theirs.status_code == status
    assert without_request_id(ours.json()) == without_request_id(theirs.json())


def without_stats(raw: bytes) -> list:
    frames = [f[len(b"data: "):] for f in sse_events(raw)]
    return [f if f == b"[DONE]" else {k: v for k, v in json.loads(f).items() if k != "stats"} for f in frames]


def stream_raw(url: str, path: str, body: dict, on_frame=None) -> bytes:
    out = b""
    body = {"temperature": 0, **body}  # greedy unless the body says otherwise (OpenAI's default is 1)
    with httpx.stream("POST", url + path, json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_raw():
            out += chunk
            if on_frame is not None:
                on_frame(out)
    return out


STREAMS = [
    ("/v1/completions", {"model": "tinyloop", "prompt": "The king said", "max_tokens": 40, "loops": 2, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": "tinyloop", "prompt": "Once upon", "max_tokens": 30, "loops": 8, "stream": True,
                         "n": 2, "stop": [" the"]}),
    ("/v1/completions", {"model": "tinyloop", "prompt": [464, 1049, 318], "max_tokens": 25, "loops": 4, "stream": True}),
    ("/v1/completions", {"model": "tinyloop", "prompt": "A B C", "max_tokens": 35, "loops": 3, "stream": True,
                         "presence_penalty": 0.5, "frequency_penalty": 0.3}),
    ("/v1/chat/completions", {"model": "tinyloop", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 30,
                              "loops": 6, "stream": True}),
    ("/v1/chat/completions", {"model": "tinyloop", "messages": [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Why?"}],
                              "max_tokens": 20, "stream": True, "temperature": 0.8, "seed": 7}),
    ("/api/v0/completions", {"model": "tinyloop", "prompt": "Spec", "max_tokens": 30, "mode": "speculative",
                             "draft_loops": 1, "loops": 4, "stream": True}),
    ("/v1/completions", {"model": "tinyloop", "prompt": "Deep", "max_tokens": 30, "loops": 16, "stream": True}),
]


def test_eight_concurrent_streams_equal_single_process(cluster, reference):
    expected = [normalised(stream_raw(reference, path, body)) for path, body in STREAMS]
    got: dict[int, bytes] = {}

    def run(i: int) -> None:
        got[i] = normalised(stream_raw(cluster.url, *STREAMS[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(STREAMS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, (path, _) in enumerate(STREAMS):
        if path.startswith("/api/v0"):  # stats carry timings: every frame equal but for them
            assert without_stats(got[i]) == without_stats(expected[i]), path
        else:
            assert got[i] == expected[i], (path, got[i][-300:], expected[i][-300:])
    # power of two choices on in-flight requests: both replicas generated some of them
    time.sleep(2.5)  # replicas report every second
    text = httpx.get(cluster.url + "/metrics", headers=AUTH).text
    per_replica = re.findall(r'tinyloop_generated_tokens_total\{replica="[^"]+"\} (\S+)', text)
    assert len(per_replica) == 2 and all(float(v) > 0 for v in per_replica), per_replica


def test_sigkill_one_replica_mid_stream(cluster, reference):
    """Only the killed replica's streams fail, each with an error event then [DONE]; non-streamed requests
    sent right after the kill are retried on the other; Ray replaces the replica and /health says
    `degraded` meanwhile; then requests succeed again."""
    body = {"model": "tinyloop", "max_tokens": 400, "loops": 24, "stream": True}
    prompts = [f"Story number {i}:" for i in range(8)]
    expected = [normalised(stream_raw(reference, "/v1/completions", {**body, "prompt": p})) for p in prompts[:2]]
    started = threading.Barrier(len(prompts) + 1)
    raw: dict[int, bytes] = {}

    def run(i: int) -> None:
        seen = {"n": 0}

        def on_frame(buf: bytes) -> None:
            seen["n"] += 1
            if seen["n"] == 3:
                started.wait(120)

        raw[i] = stream_raw(cluster.url, "/v1/completions", {**body, "prompt": prompts[i]}, on_frame)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait(120)  # every stream has tokens: they are spread over both replicas
    victim = httpx.get(cluster.url + "/health").json()["replicas"]["each"][0]["pid"]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    seen: list[tuple[float, str, set]] = []   # /health from the kill until the replacement serves

    def watch() -> None:
        while time.monotonic() - killed_at < 120:
            health = httpx.get(cluster.url + "/health", timeout=5).json()
            seen.append((time.monotonic() - killed_at, health["status"], {r["pid"] for r in health["replicas"]["each"]}))
            if health["status"] == "ok" and victim not in seen[-1][2]:
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    plain = {"model": "tinyloop", "prompt": "After the kill", "max_tokens": 12, "loops": 4, "temperature": 0}
    retried = [post(cluster.url, "/v1/completions", plain) for _ in range(2)]
    for t in threads:
        t.join(300)
    failed = 0
    for i, stream in enumerate(raw.values()):
        frames = sse_events(stream)
        assert frames[-1] == b"data: [DONE]"
        if b'"error"' in frames[-2]:
            failed += 1
            err = json.loads(frames[-2][len(b"data: "):])["error"]
            assert err["code"] == "replica_failed" and err["type"] == "server_error", err
            assert all(b'"error"' not in f for f in frames[:-2])
        else:
            assert b'"finish_reason":"length"' in frames[-2]
    assert 0 < failed < len(prompts), f"{failed} of {len(prompts)} streams failed"
    for i in range(2):  # the survivors' output is exactly the lone run's
        if b'"error"' not in raw[i]:
            assert normalised(raw[i]) == expected[i]
    reference_plain = post(reference, "/v1/completions", plain).json()["choices"]
    assert all(r.status_code == 200 and r.json()["choices"] == reference_plain for r in retried)

    watcher.join(130)
    assert seen and seen[-1][1] == "ok" and victim not in seen[-1][2], f"no replacement within 120 s: {seen[-3:]}"
    degraded = [t for t, status, _ in seen if status == "degraded"]
    assert degraded, "/health never reported the lost capacity"
    print(f"\ndegraded from {degraded[0]:.1f} s, replaced {seen[-1][0]:.1f} s after the SIGKILL")  # noqa: T201
    after = post(cluster.url, "/v1/completions", plain)
    assert after.status_code == 200 and after.json()["choices"] == reference_plain
    assert normalised(stream_raw(cluster.url, "/v1/completions", {**body, "prompt": prompts[0]})) == expected[0]
