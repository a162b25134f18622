"""`torch_threads(n)`: run a block on `n` torch threads, restoring the count after (~0.5 us a switch).

Small tensor work next to the native executor wants one thread: each op just above torch's parallel grain wakes
a second OpenMP thread, and beside the native pool's spinning workers (or on a shared machine) that wake-up costs
milliseconds where the work itself costs microseconds (engine/native.py `one_thread`, quant/linear.py's load-time
kernel checks)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    prev = torch.get_num_threads()
    if prev == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
