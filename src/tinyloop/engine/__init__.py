from .engine import Engine, GenerationResult, StreamEvent
from .params import SamplingParams

__all__ = ["Engine", "GenerationResult", "SamplingParams", "StreamEvent"]
