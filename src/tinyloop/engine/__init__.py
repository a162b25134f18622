"""The engine: per-request settings (`SamplingParams`, torch-free) and the model runner (`Engine`).

Names are imported on first use (PEP 562): `from tinyloop.engine.knobs import ...` (the command line's
flag checks) does not import torch.
"""

from importlib import import_module

_LAZY = {"Engine": ".engine", "GenerationResult": ".engine", "StreamEvent": ".engine",
         "SamplingParams": ".knobs", "param_default": ".knobs",
         "RequestPlan": ".plan", "plan_request": ".plan"}

__all__ = ["Engine", "GenerationResult", "RequestPlan", "SamplingParams", "StreamEvent", "param_default",
           "plan_request"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tinyloop.engine' has no attribute {name!r}")
