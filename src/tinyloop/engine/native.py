"""The engine's one door to the native executor (`kernels/`, attached to the model by
`model.fast.prepare_for_decode`): this module is the only one in engine/ that imports `kernels/` or names the
model's executor, and one engine object reaches it: the batch runner (`engine/batch.py` `BatchRunner`). Every other
module in engine/ and server/ asks the runner, or the `Engine`, which asks the runner
(tests/engine/test_native_door.py holds who imports this module). Where the PyTorch path serves (no compiler,
`TINYLOOP_EXECUTOR=torch`, or a model the executor refuses) `runs_natively(model)` is False, and the runner takes
its PyTorch path instead of calling the work functions (which expect an executor).

Through the runner:

- work (each a thin call of `kernels.executor.NativeExecutor`'s method of that name, arguments as given: no copies,
  nothing allocated here, they run on the decode path): `supports`, `generate` (a lone sequence's plain tokens in
  one call: `BatchRunner.lone_steps`), `spec_round`, `tree_round` (whole speculation rounds: `run_round`),
  `head_costs` (the head's cost by rows: `prepare`, `chunk`), `head_argmax` (the head's fused argmax and draws:
  `head_tokens`), `project` (a draft head's projection: `draft_logits`), `kept_round_costs`, `keep_round_costs`
  (what rounds cost on this host, kept for the next process: `prepare`, `finish`);
- how native code runs the model: `runs_natively`, `streamed` (`BatchRunner.natively`, `streamed`: the
  `Speculator` and its draft head, `BatchEngine.warm_up`), `python_between_calls`, `one_thread` (the torch threads
  the engine's Python keeps between native calls);
- the executor's life, static methods of the runner that the `Engine` calls (`Engine.load`, `release`,
  `executor_name`, `executor_bytes`, `weights_stay_in_cache`): `loading_for`, `attach`, `detach`, `name`,
  `copy_bytes`, `stays_in_cache`;
- the library's row draw (`draw`: no model, weights or pool; `BatchRunner.draw_row`, which the core hands its
  Samplers).

The model's own `run`, `logits` and `greedy_tokens` (whole serving steps' one-token rows, the head) reach the
executor inside `model/`, not through here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..torch_threads import torch_threads


def runs_natively(model: Any) -> bool:
    """Whether the native executor runs `model` (False: the PyTorch path serves it)."""
    return getattr(model, "executor", None) is not None


def streamed(model: Any) -> bool:
    """Whether the executor reads the model's weights from memory each pass (larger than the cache:
    `NativeExecutor.streamed`); only where `runs_natively`."""
    return model.executor.streamed


def name(model: Any) -> str:
    """Who runs the model's decode rows, as `/health`, `model_info` and the prompt cache's key say it: "native
    (<ISA, threads, mode>)" or "torch"."""
    return model.executor.name if runs_natively(model) else "torch"


def attach(model: Any, executor: str | None = None) -> None:
    """Prepare a loaded model for decoding (`model.fast.prepare_for_decode`: fused projections, and the native
    executor attached where `executor` ("native", "torch", None: the setting) and the library allow)."""
    from ..model.fast import prepare_for_decode

    prepare_for_decode(model, executor=executor)


def copy_bytes(model: Any) -> int:
    """Bytes of the weights' copies the executor holds beside the model's tensors (its packed int4 codes, those
    still being packed in the background included: `NativeExecutor._pack`); 0 on the PyTorch path."""
    return model.executor.copy_bytes if runs_natively(model) else 0


def stays_in_cache(weight_bytes: int) -> bool:
    """Whether a model whose decode reads `weight_bytes` of weights a token is served as staying in cache (not
    streamed: `kernels/executor.py` STREAMED_BYTES), as the executor decides it at load."""
    from ..kernels.executor import STREAMED_BYTES

    return weight_bytes <= STREAMED_BYTES


def supports(model: Any, rows) -> bool:
    """Whether the executor runs these rows (a `model.paged.Rows`): `NativeExecutor.supports`."""
    return model.executor.supports(rows)


def generate(model: Any, kv, table: torch.Tensor, window: int, token: int, pos: int, loops: int, exit_rule,
             steps: int, noise: tuple | None, stop: list[int], grammar=None) -> tuple[list[int], list[int]]:
    """`steps` plain tokens of one sequence in one call (`tl_generate`): `NativeExecutor.generate`, which
    documents the arguments. Returns the tokens and the core loops each step ran."""
    return model.executor.generate(kv, table, window, token, pos, loops, exit_rule, steps, noise, stop, grammar)


def spec_round(model: Any, kv, table: torch.Tensor, window: int, pending: int, pos: int, k: int, d: int, V: int,
               draft_readout, draft_weight, draft_ids: torch.Tensor | None, draft_norm, backlog: torch.Tensor | None,
               want_state: bool = True, pipeline: bool = False, noise: tuple | None = None, ahead: int = 0,
               head_rows: int = 2, rounds: int = 1, stop: list[int] | tuple = ()) -> dict:
    """A whole chain (or pipeline) speculation round in one call (`tl_spec_round`): `NativeExecutor.spec_round`,
    which documents the arguments and the result."""
    return model.executor.spec_round(kv, table, window, pending, pos, k, d, V, draft_readout, draft_weight, draft_ids,
                                     draft_norm, backlog, want_state=want_state, pipeline=pipeline, noise=noise,
                                     ahead=ahead, head_rows=head_rows, rounds=rounds, stop=stop)


def tree_round(model: Any, kv, table: torch.Tensor, window: int, pending: int, pos: int, depth: int, K: int, d: int,
               V: int, draft_readout, last_readout, draft_weight, draft_ids: torch.Tensor | None, draft_norm,
               noise: tuple | None = None, head_rows: int = 2) -> dict:
    """A whole tree speculation round in one call (`tl_tree_round`, K > 1): `NativeExecutor.tree_round`, which
    documents the arguments and the result."""
    return model.executor.tree_round(kv, table, window, pending, pos, depth, K, d, V, draft_readout, last_readout,
                                     draft_weight, draft_ids, draft_norm, noise=noise, head_rows=head_rows)


def head_costs(model: Any, rows: int = 9) -> list[float]:
    """Milliseconds of the LM head at 1..rows input rows on this host, measured once per model:
    `NativeExecutor.head_costs`."""
    return model.executor.head_costs(rows)


def kept_round_costs(model: Any, setting: str) -> dict | None:
    """What an earlier process on this host kept of the model's round costs for one speculation setting
    (`NativeExecutor.kept_round_costs`); None on the PyTorch path (whose rounds are not the native ones)."""
    return model.executor.kept_round_costs(setting) if runs_natively(model) else None


def keep_round_costs(model: Any, setting: str, value: dict) -> None:
    """Keep the model's round costs for one setting beside the library, for later processes."""
    if runs_natively(model):
        model.executor.keep_round_costs(setting, value)


def head_argmax(model: Any, x: torch.Tensor, noise: list | None = None) -> list[int]:
    """Each row of x (T, dim) through the LM head: its argmax, or where noise[i] is (key, 1 / T, top_k, top_p[,
    matcher]) its draw, fused into the head call (the logits stay inside): `NativeExecutor.argmax`."""
    return model.executor.argmax(x, noise)


def project(model: Any, x: torch.Tensor, w) -> torch.Tensor:
    """A draft head's logits: x (..., k) @ w (n, k)^T, w float rows read as stored or the int8 rows of the head
    (`draft_head._QuantRows`): `NativeExecutor.project`; fp32 (..., n)."""
    return model.executor.project(x, w)


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
    if runs_natively(model):
        model.executor = None


def python_between_calls(model: Any):
    """Where the native executor runs the passes, the engine's Python between them touches small tensors
    only: one torch thread, no OpenMP wake-ups beside the native pool's spinning workers (a draft head's
    per-request rows took 0.13 ms at the median, up to 7 ms with a wake-up). On the PyTorch path the same
    Python also runs the heads: the thread count stays."""
    return one_thread() if runs_natively(model) else contextlib.nullcontext()


def one_thread():
    """Run the step's per-row sampling on one torch thread. Its ops over one vocabulary row (50,257 entries
    for GPT-2) are just above torch's parallel grain, so each would wake a second OpenMP thread; next to
    the native executor's spinning workers (and on a shared machine) that wake-up cost milliseconds a
    token in `masked_fill` and `.double()` (profiled: docs/structured.md, "Cost per token")."""
    return torch_threads(1)
