from .cache import CacheError, KVCache
from .looped import LoopedTransformer, build_model

__all__ = ["CacheError", "KVCache", "LoopedTransformer", "build_model"]
