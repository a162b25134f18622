"""The engine's one door to the native executor (`kernels/`, attached to the model by
`model.fast.prepare_for_decode`): every engine module that runs native code, and the server, reach it
through `native(model)` here, never through the model's attribute. None means the PyTorch path serves
(no compiler, `TINYLOOP_EXECUTOR=torch`, or a model the executor refuses).

Nothing else in engine/ imports `kernels/`: the library's row draw (`draw`, for `sampling.draw_row`) and the
choice of executor a model is loaded for (`loading_for`, `Engine.load`) come through here too.

What passes through the door (`kernels.executor.NativeExecutor`): whole serving steps' one-token rows
(the model's own `run`, inside `model/`), the LM head's fused argmax and draws (`sampling.head_tokens`,
`Speculator`), whole speculation rounds and lone decode calls (`native_rounds`, `fast_steps`), the draft
head's projection (`draft_head`), and the head's cost table (`draft_policy` via `native_rounds`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..torch_threads import torch_threads


def native(model: Any):
    """The model's native executor, or None where PyTorch runs it."""
    return getattr(model, "executor", None)


def draw(x, ids, key: int, inv_temp: float, top_k: int, top_p: float) -> int | None:
    """Row x's draw by the native library (`tl_draw`: the PyTorch definition's noise bit for bit, ~20x faster), or
    None where the library is not loaded. `ids`: the row's token ids, or None (0..n-1)."""
    from ..kernels.lib import TlSampling, loaded

    lib = loaded()
    if lib is None:
        return None
    row = x.to("cpu", torch.float32).contiguous().clone()   # (the library reads host memory: a GPU row comes over)
    ids64 = None if ids is None else ids.to("cpu", torch.int64).contiguous()
    return int(lib.tl_draw(row.data_ptr(), row.shape[-1], None if ids64 is None else ids64.data_ptr(),
                           TlSampling(key, inv_temp, top_k, top_p)))


def loading_for(executor: str | None):
    """The context a model is loaded in for `executor` ("native", "torch", None: the setting): its quantized
    layers are built for the executor that runs them."""
    from ..kernels.lib import choose

    return choose(executor)


def detach(model: Any) -> None:
    """Let go of the model's native executor (the executor and its model refer to each other: without this an
    unloaded model waits for a full garbage collection to free its memory)."""
    if native(model) is not None:
        model.executor = None


def python_between_calls(model: Any):
    """Where the native executor runs the passes, the engine's Python between them touches small tensors
    only: one torch thread, no OpenMP wake-ups beside the native pool's spinning workers (a draft head's
    per-request rows took 0.13 ms at the median, up to 7 ms with a wake-up). On the PyTorch path the same
    Python also runs the heads: the thread count stays."""
    return one_thread() if native(model) is not None else contextlib.nullcontext()


def one_thread():
    """Run the step's per-row sampling on one torch thread. Its ops over one vocabulary row (50,257 entries
    for GPT-2) are just above torch's parallel grain, so each would wake a second OpenMP thread; next to
    the native executor's spinning workers (and on a shared machine) that wake-up cost milliseconds a
    token in `masked_fill` and `.double()` (profiled: docs/structured.md, "Cost per token")."""
    return torch_threads(1)
