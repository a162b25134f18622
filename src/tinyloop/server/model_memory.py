"""A served model's memory: estimated before its first load, measured once loaded, and given back when it is
unloaded (server/models.py)."""

from __future__ import annotations

import ctypes
import gc
import os
import weakref
from pathlib import Path


def estimate_bytes(path: Path, settings) -> int:
    """A model's memory before it was ever loaded: its file, the native executor's packed copy of its int4
    layers (`packed_copy_bytes`), and its KV pool (the setting, else what BatchEngine sizes: max_num_seqs full
    contexts at the default depth, at most 1 GiB)."""
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    size += packed_copy_bytes(path)
    if settings.kv_pool_mb is not None:
        return size + (settings.kv_pool_mb << 20)
    try:
        from ..modelfile.header import header_config

        cfg = header_config(path)
        context = min(cfg.max_seq_len, settings.max_seq_len or cfg.max_seq_len)
        per_token = 2 * cfg.n_kv_heads * (cfg.dim // cfg.n_heads) * 2 * \
            (cfg.n_prelude + cfg.n_core * cfg.default_loops + cfg.n_coda)
        return size + min(settings.max_num_seqs * context * per_token, 1 << 30)
    except Exception:  # noqa: BLE001 - an estimate
        return size


def packed_copy_bytes(path: Path) -> int:
    """The bytes the native executor's copy of an int4 file's block layers may take (their codes, scales and zero
    points or minimums, repacked: kernels/executor.py `_pack`), counted wherever it may run (not with
    TINYLOOP_EXECUTOR=torch or TINYLOOP_NATIVE_PACK=0): an estimate errs high rather than let a load overrun
    `--max-memory`; once loaded, the model's memory is measured (`measure_bytes`)."""
    if os.environ.get("TINYLOOP_EXECUTOR", "").strip().lower() == "torch" or \
            os.environ.get("TINYLOOP_NATIVE_PACK", "1").strip() == "0":
        return 0
    try:
        from ..modelfile.header import read_header

        header, index = read_header(path)
    except Exception:  # noqa: BLE001 - an estimate
        return 0
    quant = (header.get("weights") or {}).get("quant") or {}
    if quant.get("bits") != 4:
        return 0
    from ..engine.engine import Engine

    parts: dict[str, int] = {}
    for name, t in index.items():
        base, _, part = name.rpartition(".")
        if part in ("qweight", "scales", "zeros", "mins") and f"{base}.qweight" in index:
            start, end = t["data_offsets"]
            parts[part] = parts.get(part, 0) + (int(end) - int(start)) * (base != "head")
            if part == "qweight":   # (codes only: at most what the executor counts a token reading, so that
                parts["read"] = parts.get("read", 0) + int(end) - int(start)   # the estimate errs high)
    if Engine.weights_stay_in_cache(parts.get("read", 0)):   # stays in cache: fp32 scales and s z', 8 bytes a float16 scale's 2
        return parts.get("qweight", 0) + 4 * parts.get("scales", 0)
    return parts.get("qweight", 0) + parts.get("scales", 0) + parts.get("zeros", 0) + parts.get("mins", 0)


def measure_bytes(worker) -> int:
    """Bytes a loaded model holds: its tensors (weights, buffers, packed forms; each storage once), the native
    executor's copies of the weights, and its KV pool."""
    import torch

    seen: set[int] = set()
    total = 0

    def add(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            try:
                storage = t.untyped_storage()
            except Exception:  # noqa: BLE001
                return
            key = storage.data_ptr()
            if key and key not in seen:
                seen.add(key)
                total += storage.nbytes()

    engine = worker.engine
    if engine is None:
        return 0
    model = engine.model
    for t in list(model.parameters()) + list(model.buffers()):
        add(t)
    for module in model.modules():   # packed forms kept as plain attributes (native executor, quantized layers)
        for value in vars(module).values():
            add(value)
    total += engine.executor_bytes()   # the native executor's packed int4 codes (held apart from the modules)
    batch = worker.batch
    if batch is not None:
        try:
            kv = batch.kv.nbytes()
        except Exception:  # noqa: BLE001
            kv = 0
        total += kv
    return total


def free(worker, metrics) -> None:
    """(a thread) Stop a model's engine thread and let go of everything it held, back to the system."""
    worker.stop()
    if worker.prompt_cache is not None:
        metrics.untrack_prompt_cache(worker.prompt_cache.stats)
    engine = worker.engine
    model = weakref.ref(engine.model) if engine is not None else None
    if engine is not None:
        engine.release()   # (the native executor and its model refer to each other)
    worker.engine = worker.batch = worker.prompt_cache = None
    worker.load_exception = None
    del engine
    if model is not None and model() is not None:
        # another cycle holds it: a full collection (Engine.load froze the models' objects out of the collector's
        # reach), which holds the GIL for a while (~0.6 s beside a loaded model, measured), so only then
        gc.unfreeze()
        gc.collect()
        gc.freeze()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)   # freed heap pages back to the system (glibc)
    except (OSError, AttributeError):
        pass
