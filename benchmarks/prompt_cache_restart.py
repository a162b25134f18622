"""The prompt cache on disk across restarts (issue 56, item 3): time to first token of a long prompt cold, warm
(in memory), and after a restart (read back from `--prompt-cache-dir`), with the bad-file and SIGKILL checks.

Every server is a real `tinyloop serve` process on one model and one cache directory; a "restart" is a SIGTERM
(a graceful stop: the writer finishes) and a new process. TTFT is client side: a streamed /v1/completions
request of token ids (greedy, one token) sent -> its first data event; beside it the server process's CPU time
over the request (every thread, /proc/<pid>/task/*/schedstat), which other jobs' load on a shared host does not
change as it changes wall time. Medians over `--repeats` prompts, each prompt its own (distinct first token, so
no prompt finds another's blocks); each timed request is followed by an untimed 8-token one whose text must be
the cold answer's.

  1. cold: server A, each prompt once (computed; its blocks written as they fill);
  2. warm: server A, each prompt again (its blocks in memory);
  3. restart, read at admission: server B with TINYLOOP_PROMPT_CACHE_PRELOAD=0, each prompt once (its blocks
     read from disk when it is admitted, verified, copied into the pool): the worst case;
  4. restart, first request: per prompt, a new server (the defaults) and that prompt, the last one the
     previous server answered (an agent's conversation), sent as soon as /health answers 200; paired with
     its warm time measured in the previous server just before it stopped;
  5. restart, preloaded: a new server (the defaults), every prompt after the idle preload finished;
  6. bad files: one block of three prompts flipped, truncated, and replaced by a well-formed file of another
     model; a new server answers each: the same text as cold, the blocks before the bad one read, one log
     line per bad file, each removed (tinyloop_prompt_cache_files_ignored_total 3) and written again;
  7. SIGKILL: `--kills` times, a server computing a new prompt (writing its blocks as they fill) is SIGKILLed
     as soon as a temporary file is seen (mid-write), or at a random moment of the prefill; the next server
     starts healthy, has removed the temporary files, ignores no file, and answers with the same text as a
     server without the prompt cache.

    .venv/bin/python benchmarks/prompt_cache_restart.py [--model M.tinyloop] [--prompt-tokens 2000]
        [--repeats 5] [--kills 5] [--json benchmarks/results/prompt_cache_restart.json]

Without --model it writes a random tinyloop-16m (the shipped model's architecture, float16) with a 2,048-token
context (`tinyloop init --preset tinyloop-16m --overrides '{"max_seq_len": 2048}' --dtype float16`): the shipped
model's own context is 512 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: local_server
import local_server  # noqa: E402
from hostinfo import cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 8


def make_model(out: Path) -> Path:
    exe = Path(sys.executable).with_name("tinyloop")
    subprocess.run([str(exe), "init", str(out), "--preset", "tinyloop-16m", "--overrides", '{"max_seq_len": 2048}',
                    "--dtype", "float16"], check=True, capture_output=True)
    return out


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1000 + i] + [rng.randrange(300, 50000) for _ in range(length - 1)] for i in range(n)]


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of a process so far, in ns (/proc/<pid>/task/*/schedstat)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


class Timed:
    """One streamed request: `ttft` (s, client side), `text`, `cached` (prompt tokens), and `cpu_ms`: the server
    process's CPU time over the request, every thread (the disk cache's readers and writer included), which the
    load other jobs put on a shared host does not change as it changes wall time."""

    def __init__(self, client: httpx.Client, url: str, ids: list[int], pid: int | None = None,
                 max_tokens: int = 1):
        body = {"model": "tinyloop", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        c0 = cpu_ns(pid) if pid else 0
        t0 = time.perf_counter()
        self.ttft, text, self.cached = None, [], 0
        with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if self.ttft is None and ev.get("choices"):
                    self.ttft = time.perf_counter() - t0
                text += [ch.get("text", "") for ch in ev.get("choices") or []]
                if ev.get("usage"):
                    self.cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
        self.text = "".join(text)
        self.cpu_ms = (cpu_ns(pid) - c0) / 1e6 if pid else None


def answer(client, url, ids) -> str:
    """The greedy answer, MAX_TOKENS of it: what must not change across restarts."""
    return Timed(client, url, ids, max_tokens=MAX_TOKENS).text


def metric(client, url: str, name: str) -> float:
    text = client.get(url + "/metrics").text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def start(model: Path, cache: Path, log: Path, **env) -> tuple[subprocess.Popen, str]:
    return local_server.start_server(model, log=log, args=["--prompt-cache-dir", str(cache)],
                                     env={k: str(v) for k, v in env.items()})


def wait_preloaded(client, url: str, timeout_s: float = 60.0) -> float:
    return wait_stable(client, url, "tinyloop_prompt_cache_blocks_preloaded_total", timeout_s)


def wait_stable(client, url: str, name: str, timeout_s: float = 60.0) -> float:
    """Until the metric has not changed for a second; its value."""
    last, since = -1.0, time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = metric(client, url, name)
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since > 1.0:
            break
        time.sleep(0.1)
    return last


def block_files(cache: Path, ids: list[int], page_size: int = 16, loops: int = 8) -> list[Path]:
    """The prompt's block files in chain order (engine/prefix_cache.py block_name), in its one namespace."""
    from tinyloop.engine.prefix_cache import block_name

    (ns,) = [d for d in cache.iterdir() if d.is_dir() and d.name != "saved"]
    out, parent = [], None
    for b in range(len(ids) // page_size):
        parent = block_name(parent, ids[b * page_size:(b + 1) * page_size], ("loops", loops, "window", 0))
        out.append(ns / (parent.hex() + ".kvb"))
    return out


def well_formed(path: Path) -> bool:
    """A complete block file: its magic, its length as its header says, its CRC-32."""
    try:
        raw = path.read_bytes()
        (hlen,) = struct.unpack_from("<I", raw, 8)
        meta = json.loads(raw[12:12 + hlen])
        return raw[:8] == b"TLKVBLK1" and zlib.crc32(raw[:-4]) == struct.unpack("<I", raw[-4:])[0] \
            and meta["identity"]["model"] != "0" * 64
    except (OSError, ValueError, KeyError, struct.error):
        return False


def foreign(path: Path) -> bytes:
    """The same block as another model's engine would write it: a well-formed file (its CRC right) whose
    identity names another model file."""
    raw = path.read_bytes()
    (hlen,) = struct.unpack_from("<I", raw, 8)
    meta = json.loads(raw[12:12 + hlen])
    meta["identity"]["model"] = "0" * 64
    head = json.dumps(meta).encode()
    body = b"TLKVBLK1" + struct.pack("<I", len(head)) + head + raw[12 + hlen:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def _quietly(fn, *a):
    try:
        fn(*a)
    except (httpx.HTTPError, ValueError):   # (the server was killed under it)
        pass


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="default: a random tinyloop-16m with a 2,048-token context")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the servers (default: unset)")
    ap.add_argument("--loops", type=int, default=8, help="the model's default loops (the salt of its blocks)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--seed", type=int, default=56)
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats must be at least 3 (the bad-file checks damage three prompts' blocks)")

    work = Path(tempfile.mkdtemp(prefix="tl-pcache-"))
    model = args.model or make_model(work / "tinyloop-16m-ctx2048.tinyloop")
    cache = work / "cache"
    env = {"OMP_NUM_THREADS": args.threads} if args.threads else {}
    ps = prompts(args.repeats, args.prompt_tokens, args.seed)
    client = httpx.Client()
    out: dict = {"model": str(model), "prompt_tokens": args.prompt_tokens, "repeats": args.repeats,
                 "host": cpu_name(), "date": time.strftime("%Y-%m-%d"), "loadavg_start": os.getloadavg()}
    try:
        # 1-2: cold and warm, one server
        proc, url = start(model, cache, work / "a.log", **env)
        cold, warm, ref = [], [], []
        for ids in ps:
            t = Timed(client, url, ids, proc.pid, max_tokens=MAX_TOKENS)   # (the reference answer: cold)
            assert t.cached == 0, t.cached
            cold.append(t)
            ref.append(t.text)
        wait_stable(client, url, "tinyloop_prompt_cache_files_written_total")   # the writer done: its fsyncs
        for ids, want in zip(ps, ref):                                         # are not the warm figure's
            t = Timed(client, url, ids, proc.pid)
            warm.append(t)
            assert answer(client, url, ids) == want and t.cached > 0
        out["warm_cached_tokens"] = t.cached
        out["files_written_a"] = metric(client, url, "tinyloop_prompt_cache_files_written_total")
        local_server.stop_server(proc)
        out["disk_bytes_after_a"] = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())

        # 3: a restart, blocks read at admission (no read-back at start); the prompts in reverse, ps[0] last
        proc, url = start(model, cache, work / "b.log", TINYLOOP_PROMPT_CACHE_PRELOAD=0, **env)
        lazy, same = [], []
        for ids, want in reversed(list(zip(ps, ref))):
            lazy.append(Timed(client, url, ids, proc.pid))
            same.append(answer(client, url, ids) == want)
        out["lazy_disk_hits"] = metric(client, url, "tinyloop_prompt_cache_disk_hits_total")
        out["lazy_disk_misses"] = metric(client, url, "tinyloop_prompt_cache_disk_misses_total")
        before = [Timed(client, url, ps[0], proc.pid)]   # its warm time, just before the restart that follows
        local_server.stop_server(proc)

        # 4: a restart (the defaults), the last conversation's prompt sent as soon as /health answers 200
        first, healthy, first_read = [], [], []
        for k, (ids, want) in enumerate(zip(ps, ref)):
            t0 = time.perf_counter()
            proc, url = start(model, cache, work / f"c{k}.log", **env)
            healthy.append(time.perf_counter() - t0)
            first.append(Timed(client, url, ids, proc.pid))
            first_read.append(metric(client, url, "tinyloop_prompt_cache_disk_hits_total"))   # 0: read back at start
            same.append(answer(client, url, ids) == want)
            nxt = ps[(k + 1) % len(ps)]
            answer(client, url, nxt)   # the next restart's "last conversation", and its warm time just before it
            if k + 1 < len(ps):
                before.append(Timed(client, url, nxt, proc.pid))
            local_server.stop_server(proc)
        out["restart_to_healthy_s"] = round(med(healthy), 2)
        out["restart_first_blocks_read_at_admission"] = first_read
        out["restart_first_paired_ttft_ratios"] = [round(f.ttft / b.ttft, 2) for f, b in zip(first, before)]
        out["restart_first_paired_cpu_ratios"] = [round(f.cpu_ms / b.cpu_ms, 2) for f, b in zip(first, before)]

        # 5: a restart, every prompt after the read-back finished
        proc, url = start(model, cache, work / "p.log", **env)
        t0 = time.perf_counter()
        out["preloaded_blocks"] = wait_preloaded(client, url)
        out["preload_wall_s"] = round(time.perf_counter() - t0 - 1.0, 2)
        # what any new process's first request pays, cache or not (the HTTP path's first use): a short prompt twice
        out["fresh_process_short"] = [(round(t.ttft * 1000, 1), round(t.cpu_ms, 1)) for t in
                                      (Timed(client, url, [464, 5822, 531, 284, 465], proc.pid) for _ in range(2))]
        pre = []
        for ids, want in zip(ps, ref):
            pre.append(Timed(client, url, ids, proc.pid))
            same.append(answer(client, url, ids) == want)
        out["disk_bytes"] = metric(client, url, "tinyloop_prompt_cache_disk_bytes")
        local_server.stop_server(proc)
        out["same_text_after_restart"] = all(same)

        # 6: bad files
        damaged = []
        for k, (how, b) in enumerate([("flipped", 3), ("truncated", 5), ("foreign", 7)]):
            f = block_files(cache, ps[k], loops=args.loops)[b]
            raw = f.read_bytes()
            if how == "flipped":
                f.write_bytes(raw[:len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 0xFF]) + raw[len(raw) // 2 + 1:])
            elif how == "truncated":
                f.write_bytes(raw[:len(raw) // 3])
            else:
                f.write_bytes(foreign(f))
            damaged.append((how, b, f))
        log_d = work / "d.log"
        proc, url = start(model, cache, log_d, TINYLOOP_PROMPT_CACHE_PRELOAD=0, **env)
        bad = []
        for k, (how, b, f) in enumerate(damaged):
            t = Timed(client, url, ps[k], max_tokens=MAX_TOKENS)
            bad.append({"damage": how, "block": b, "same_text": t.text == ref[k], "cached_tokens": t.cached})
        out["ignored_metric"] = metric(client, url, "tinyloop_prompt_cache_files_ignored_total")
        local_server.stop_server(proc)
        for entry, (_, _, f) in zip(bad, damaged):   # removed, then written again from the recomputed block
            entry["rewritten_good"] = well_formed(f)
        out["bad_files"] = bad
        lines = [ln for ln in log_d.read_text(errors="replace").splitlines() if "ignored and removed" in ln]
        out["ignored_log_lines"] = lines

        # 7: SIGKILL while a prompt is computed and its blocks written; references from a server without the cache
        kp = [[2000 + k] + ids[1:] for k, ids in enumerate(prompts(args.kills, args.prompt_tokens, args.seed + 1))]
        proc, url = local_server.start_server(model, log=work / "ref.log", env={k: str(v) for k, v in env.items()})
        kref = [answer(client, url, ids) for ids in kp]
        local_server.stop_server(proc)
        kills = []
        rng = random.Random(args.seed)
        for k, ids in enumerate(kp):
            proc, url = start(model, cache, work / f"k{k}.log", TINYLOOP_PROMPT_CACHE_PRELOAD=0, **env)
            thread = threading.Thread(target=lambda: _quietly(answer, client, url, ids), daemon=True)
            thread.start()
            t0 = time.perf_counter()
            if k % 2:   # at a random moment of the prefill
                time.sleep(rng.uniform(0.2, med([t.ttft for t in cold]) + 0.2))
            else:       # as soon as a temporary file is seen: in the middle of a block's write
                while not any(e.name.startswith(".tmp.") for d in cache.iterdir() if d.is_dir()
                              for e in os.scandir(d)) and time.perf_counter() - t0 < 60:
                    pass
            when = time.perf_counter() - t0
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            thread.join(30)
            tmp_left = len(list(cache.rglob(".tmp.*")))
            files_left = sum(1 for f in block_files(cache, ids, loops=args.loops) if f.exists())
            t0 = time.perf_counter()
            proc, url = start(model, cache, work / f"k{k}b.log", TINYLOOP_PROMPT_CACHE_PRELOAD=0, **env)
            healthy = time.perf_counter() - t0
            t = Timed(client, url, ids, max_tokens=MAX_TOKENS)
            time.sleep(0.3)
            kills.append({"killed_after_s": round(when, 2), "tmp_files_after_kill": tmp_left,
                          "blocks_on_disk_after_kill": files_left, "healthy_s": round(healthy, 2),
                          "same_text": t.text == kref[k], "cached_tokens": t.cached,
                          "ignored": metric(client, url, "tinyloop_prompt_cache_files_ignored_total"),
                          "tmp_files_after_restart": len(list(cache.rglob(".tmp.*")))})
            local_server.stop_server(proc)
        out["kills"] = kills
        out["disk_bytes_end"] = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
        out["loadavg_end"] = os.getloadavg()
    finally:
        client.close()

    runs = {"cold": cold, "warm": warm, "restart_read": lazy, "restart_first": first, "restart_preloaded": pre}
    out["ttft_ms"] = {k: [round(t.ttft * 1000, 1) for t in v] for k, v in runs.items()}
    out["cpu_ms"] = {k: [round(t.cpu_ms, 1) for t in v] for k, v in runs.items()}
    out["restart_read_cached_tokens"] = [t.cached for t in lazy]
    tm = {k: med([t.ttft for t in v]) * 1000 for k, v in runs.items()}
    cm = {k: med([t.cpu_ms for t in v]) for k, v in runs.items()}
    out["medians"] = {k: {"ttft_ms": round(tm[k], 1), "cpu_ms": round(cm[k], 1)} for k in runs}
    out["bars"] = {f"{k}_over_warm": {"ttft": round(tm[k] / tm["warm"], 2), "cpu": round(cm[k] / cm["warm"], 2)}
                   for k in ("restart_first", "restart_read", "restart_preloaded")}
    out["bars"].update({f"cold_over_{k}": {"ttft": round(tm["cold"] / tm[k], 1), "cpu": round(cm["cold"] / cm[k], 1)}
                        for k in ("restart_first", "restart_read", "restart_preloaded")})
    out["bars"]["restart_first_paired_median"] = {"ttft": med(out["restart_first_paired_ttft_ratios"]),
                                                  "cpu": med(out["restart_first_paired_cpu_ratios"])}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
