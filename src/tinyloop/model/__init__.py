"""The model: the looped transformer, its KV caches and the files beside it.

Names are imported on first use (PEP 562), so torch-free helpers of this package (`model.companion`) can
be used without importing torch.
"""

from importlib import import_module

_LAZY = {"CacheError": ".cache", "KVCache": ".cache", "LoopedTransformer": ".looped", "build_model": ".looped",
         "param_count": ".fused"}

__all__ = ["CacheError", "KVCache", "LoopedTransformer", "build_model", "param_count"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tinyloop.model' has no attribute {name!r}")
