"""`tinyloop serve` as a user starts it (issue 57, item 4): a model that cannot be loaded stops the command at once,
non-zero, with one line naming the file (as Ollama, llama-server and vLLM do), never a server answering 503; a port
that cannot be bound stops it before the model loads; a good load prints one line saying what is served where."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENV.pop("TINYLOOP_MODEL_PATH", None)
ENV.pop("TINYLOOP_DRAFT_EXIT", None)


def serve(*args: str, env: dict | None = None, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tinyloop", "serve", "--port", "0", *args], capture_output=True,
                       text=True, timeout=timeout, env={**ENV, **(env or {})}, stdin=subprocess.DEVNULL)
    return r, time.monotonic() - t0


def one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    return lines[0]


def test_a_missing_model_exits_at_once_with_one_line():
    r, took = serve("--model", "/nonexistent")
    assert r.returncode != 0 and took < 5, (r.returncode, took)
    line = one_error_line(r)
    assert line.startswith("tinyloop: error: cannot load the model: /nonexistent: no such file"), line
    # the same through the environment variable
    r, took = serve(env={"TINYLOOP_MODEL_PATH": "/nonexistent/model.tinyloop"})
    assert r.returncode != 0 and took < 5
    assert "/nonexistent/model.tinyloop: no such file" in one_error_line(r)


def test_a_refused_start_imports_no_torch():
    # what the refusal path reads (settings from the environment, the header) stays torch-free, so a missing
    # model is refused in well under a second even on a loaded host (torch's import alone is ~1-2 s of CPU)
    code = ("import sys; from tinyloop.server.settings import Settings; from tinyloop.modelfile.header import "
            "header_config; Settings.from_env(); assert 'torch' not in sys.modules, sorted(m for m in sys.modules "
            "if m.startswith('tinyloop'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TINYLOOP_PROMPT_CACHE_DIR": "/tmp/unused-prompt-cache"})
    assert r.returncode == 0, r.stderr


def test_a_truncated_or_corrupt_model_exits_at_once_with_one_line(tmp_path, tiny_model_path):
    data = Path(tiny_model_path).read_bytes()
    cut = tmp_path / "cut.tinyloop"
    cut.write_bytes(data[: len(data) * 2 // 3])        # a download that stopped part-way
    r, took = serve("--model", str(cut))
    assert r.returncode != 0 and took < 5, (r.returncode, took)
    line = one_error_line(r)
    assert str(cut) in line and "truncated" in line, line
    junk = tmp_path / "junk.tinyloop"
    junk.write_bytes(b"\x00" * 8 + os.urandom(4096))    # not a model at all
    r, took = serve("--model", str(junk))
    assert r.returncode != 0 and took < 5
    assert str(junk) in one_error_line(r)


def test_a_failure_in_the_engine_load_also_stops_it(tiny_model_path):
    """What only the full load finds (here: a draft-exit file that is not there) ends the command the same way,
    after the load instead of before it."""
    r, _ = serve("--model", str(tiny_model_path), env={"TINYLOOP_DRAFT_EXIT": "/nonexistent.draft.safetensors"})
    assert r.returncode == 1
    line = one_error_line(r)
    assert line.startswith("tinyloop: error: cannot load the model: ") and "/nonexistent.draft.safetensors" in line


def test_a_port_in_use_stops_it_before_the_model_loads(tiny_model_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "tinyloop", "serve", "--model", str(tiny_model_path), "--port",
                            str(port)], capture_output=True, text=True, timeout=120, env=ENV)
        took = time.monotonic() - t0
    assert r.returncode == 1 and took < 20, (r.returncode, took)
    assert one_error_line(r).startswith(f"tinyloop: error: cannot listen on 127.0.0.1:{port}: ")


def test_a_good_load_prints_one_line_then_serves(tiny_model_path):
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop", "serve", "--model", str(tiny_model_path),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    try:
        seen = []
        deadline = time.monotonic() + 120
        while not any("serving" in x for x in seen):
            assert time.monotonic() < deadline and proc.poll() is None, seen
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        assert len(seen) == 1, seen                  # nothing before it: uvicorn's start-up lines are folded in
        line = seen[0]
        m = re.search(r"serving tiny \(([\d.]+)M parameters; loops (\d+) default, (\d+) max; context (\d+) tokens; "
                      r"weights float32; executor (native \(.+\)|torch)\) on (http://127\.0\.0\.1:(\d+)) from (\S+)$",
                      line.strip())
        assert m, line
        from tinyloop.model import param_count
        from tinyloop.modelfile.header import header_config

        cfg = header_config(tiny_model_path)
        assert float(m.group(1)) == round(param_count(cfg) / 1e6, 1)
        assert (int(m.group(2)), int(m.group(3)), int(m.group(4))) == (cfg.default_loops, cfg.max_loops,
                                                                      cfg.max_seq_len)
        assert m.group(8) == str(tiny_model_path) and int(m.group(7)) > 0
        health = httpx.get(m.group(6) + "/health", timeout=30)      # the address it printed is the one bound
        assert health.status_code == 200 and health.json()["status"] == "ok"
        r = httpx.post(m.group(6) + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode in (0, -signal.SIGTERM)    # (uvicorn ends by raising the signal it caught again)
