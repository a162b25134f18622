"""`tinyloop serve` in a subprocess on a free loopback port, for the benchmarks that drive it over HTTP
(serving, http_overhead, soak, fuzz)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path | None, *, env: dict[str, str] | None = None, log_level: str = "warning",
                 log: Path | IO[bytes] | None = None, timeout_s: float = 180,
                 args: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start it (TINYLOOP_MODEL_PATH only when `model` is given; `env` on top of this process's; `args` more
    `serve` options, e.g. `--replicas 2`) and wait for /health. `log`: a path or binary file for its output
    (default: inherited). It runs in a process group of its own (see `stop_server`). Returns (process, url)."""
    port = free_port()
    full = {**os.environ, **({"TINYLOOP_MODEL_PATH": str(model)} if model is not None else {}), **(env or {})}
    out = open(log, "wb") if isinstance(log, Path) else log
    exe = Path(sys.executable).with_name("tinyloop")
    proc = subprocess.Popen([str(exe), "serve", "--port", str(port), "--log-level", log_level, *(args or [])],
                            env=full, stdout=out, stderr=subprocess.STDOUT if out is not None else None,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout_s, log)
    return proc, url


def _tail(log: Path | IO[bytes] | None) -> str:
    if isinstance(log, Path):
        return log.read_text(errors="replace")[-2000:]
    if log is not None:
        log.seek(0)
        return log.read().decode(errors="replace")[-2000:]
    return ""


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 180,
                 log: Path | IO[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200 and r.json().get("status") == "ok":  # scaled out: every replica serving
                return
        except httpx.TransportError:
            pass
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"tinyloop serve exited during start-up. {_tail(log)}")
        time.sleep(0.2)
    if proc is not None:
        stop_server(proc)
    raise SystemExit(f"{url}/health did not answer 200 within {timeout_s:.0f} s. {_tail(log)}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 10) -> None:
    """SIGTERM (a graceful stop; a scaled-out server also stops its Ray cluster), then SIGKILL to whatever
    is left of its process group."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
