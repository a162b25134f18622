"""Start-up time and memory of `tinyloop serve` on a real model shape (random weights), as issue 26 measured it.

For each model file: start `tinyloop serve` (KV pool 256 MiB), time from the process start to `/health` 200,
read its peak RSS (VmHWM) and its private memory (USS: Private_Clean + Private_Dirty of smaps_rollup);
then start a second server on the same file while the first runs and read the second's private memory
(what one more process or Ray replica costs: shared mapped weights do not count). Warm page cache: the
file is read once before the first timing.

    python benchmarks/load_memory.py --workdir /tmp/ouro14 [--shape ouro-1.4b] [--int4] [--json out.json]

The bf16 file (and with --int4 its RTN int4 quantization) is built in --workdir if missing (several GiB;
delete the folder afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

KV_POOL_MB = 256


def build_files(workdir: Path, shape: str, int4: bool) -> list[Path]:
    sys.path.insert(0, str(Path(__file__).parent))
    import torch

    from real_shapes import SHAPES, small_tokenizer  # noqa: E402

    from tinyloop.model import build_model
    from tinyloop.modelfile.loader import write_model
    from tinyloop.model.families import huginn, ouro

    family, hf = SHAPES[shape]
    bf16 = workdir / f"{shape}-bf16.tinyloop"
    if not bf16.exists():
        cfg = (ouro.config if family == "ouro" else huginn.huginn_config)(hf, workdir, [0])
        model = build_model(cfg, seed=0, dtype=torch.bfloat16)
        write_model(bf16, model, tokenizer=small_tokenizer(), provenance={"tool": "benchmarks/load_memory.py"})
        del model
    files = [bf16]
    if int4:
        q = workdir / f"{shape}-int4.tinyloop"
        if not q.exists():
            from tinyloop.tools.gptq import QuantSpec
            from tinyloop.tools.quantize import quantize_file

            quantize_file(bf16, q, QuantSpec(bits=4, group_size=128, method="rtn", compare_loop1=False),
                          progress=False)
        files.insert(0, q)
    return files


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_memory(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 2**20
    priv = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                priv += int(line.split()[1])
    out["USS"] = priv / 2**20
    return out


def start(path: Path) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    env = {**os.environ, "TINYLOOP_KV_POOL_MB": str(KV_POOL_MB)}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop", "serve", "--model", str(path), "--port", str(port),
                             "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def measure(path: Path) -> dict:
    with open(path, "rb") as f:  # warm page cache
        while f.read(64 << 20):
            pass
    first, url, t_first = start(path)
    httpx.post(url + "/generate", json={"prompt": "hello", "max_tokens": 2, "temperature": 0}, timeout=300)
    m1 = proc_memory(first.pid)
    second, _, t_second = start(path)
    m2 = proc_memory(second.pid)
    for p in (second, first):
        p.terminate()
        p.wait(30)
    return {"file": path.name, "file_gib": round(path.stat().st_size / 2**30, 2),
            "start_to_health_s": round(t_first, 1), "peak_rss_gib": round(m1["VmHWM"], 2),
            "uss_gib": round(m1["USS"], 2), "second_start_s": round(t_second, 1),
            "second_uss_gib": round(m2["USS"], 2), "second_peak_rss_gib": round(m2["VmHWM"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--shape", default="ouro-1.4b")
    ap.add_argument("--int4", action="store_true", help="also the RTN int4 file")
    ap.add_argument("--only", choices=["bf16", "int4"], help="measure one file only (both are built)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    files = build_files(args.workdir, args.shape, args.int4)
    if args.only:
        files = [f for f in files if f.name.endswith(f"-{args.only}.tinyloop")]
    rows = [measure(f) for f in files]
    print(f"{'file':<24} {'GiB':>5} {'start->/health s':>16} {'peak RSS GiB':>12} {'USS GiB':>8} "
          f"{'2nd USS GiB':>11}")
    for r in rows:
        print(f"{r['file']:<24} {r['file_gib']:>5} {r['start_to_health_s']:>16} {r['peak_rss_gib']:>12} "
              f"{r['uss_gib']:>8} {r['second_uss_gib']:>11}")
    if args.json:
        args.json.write_text(json.dumps({"kv_pool_mb": KV_POOL_MB, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
