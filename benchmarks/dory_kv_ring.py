"""KV memory of one Dory sequence at its release shape, with the sliding-window ring and without (issue 55: "KV
bytes at 32K context with the sliding-window ring vs without").

The 4B shape's config (benchmarks/dory_4b.py's `hf_config`, through the Dory family's config mapping) and the
serving core's own rules: the scheduler (engine/scheduler.py) admits one sequence of the given length, laid
out as `BatchEngine` lays it out (`sequence_ring`), and runs it to its last position with a fake runner (no
model: the pages it allocates are the figure), ring on and off. Bytes = the most pages the pool held x the
bytes of a page of that KV format (`PagedKV.page_bytes`). Every length x depth x KV mode x format.

    PYTHONPATH=src .venv/bin/python benchmarks/dory_kv_ring.py [--contexts 4096,32768,262144]
        [--json benchmarks/results/dory_kv_ring.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dory_4b import hf_config  # (benchmarks/)
from hostinfo import host
from tinyloop.engine.scheduler import Scheduler, Sequence
from tinyloop.engine.serving import sequence_ring
from tinyloop.model.cache import SlotLayout
from tinyloop.model.families import dory
from tinyloop.model.paged import PagedKV

PAGE, CHUNK = 16, 512   # BatchEngine's defaults: page size, max_batched_tokens


def pages_held(layout: SlotLayout, n: int, ring: bool) -> int:
    """The most pages one sequence of n positions holds in the serving core's pool (prompt n - 1, 1 token)."""
    ringed = sequence_ring(layout, 0, n, page_size=PAGE, max_batched_tokens=CHUNK) if ring else {}
    sched = Scheduler(n_pages=layout.n_slots * (n // PAGE + 2), page_size=PAGE, max_batched_tokens=CHUNK)
    seq = Sequence(sched.new_seq_id(), [1] * (n - 1), 1, layout.n_slots, **ringed)
    sched.add(seq)
    most = 0
    while seq.n_generated < 1:
        out = sched.schedule()
        for c in out.chunks:
            for q in sched.complete(c):
                sched.append_token(q, 1)
        most = max(most, sched.pool.n_pages - sched.pool.num_free)
    return most


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,32768,262144")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for mode in ("per_loop", "last_loop"):
        hf = hf_config() | {"recurrent_kv_cache_mode": mode, "max_position_embeddings": 262144}
        cfg = dory.config(hf, Path("."), [2])
        for loops in (1, 2, 4):
            layout = SlotLayout(cfg, loops)
            for n in (int(c) for c in args.contexts.split(",")):
                full, ring = pages_held(layout, n, False), pages_held(layout, n, True)
                for fmt in ("fp16", "int8"):
                    page = PagedKV.page_bytes(cfg, PAGE, fmt, torch.float16)
                    rows.append({"kv_mode": mode, "loops": loops, "context": n, "kv_format": fmt,
                                 "bytes_without_ring": full * page, "bytes_with_ring": ring * page,
                                 "ratio": round(ring / full, 4)})
                    print(f"{mode:9s} loops {loops} {n:7d} tokens {fmt:5s}: {full * page / 2**30:7.2f} GiB -> "
                          f"{ring * page / 2**30:6.2f} GiB with the ring ({ring / full:.3f}x)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"host": host(), "page_size": PAGE, "max_batched_tokens": CHUNK,
                                               "window": hf_config()["swa_window_size"], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
