"""TinyLoop: inference engine and server for weight-shared looped transformer language models.

    from tinyloop import Engine, SamplingParams
    engine = Engine.load()                      # the shipped model, or a path / $TINYLOOP_MODEL_PATH
    result = engine.generate("The king said", SamplingParams(max_tokens=32, loops=8))
    for event in engine.stream("The king said", SamplingParams(max_tokens=32)):
        print(event.text, end="")
"""

from .config import ModelConfig, preset
from .engine import Engine, GenerationResult, SamplingParams, StreamEvent
from .errors import ModelFileError, ValidationError
from .modelfile import load_model, write_model
from .version import __version__

__all__ = ["Engine", "GenerationResult", "ModelConfig", "ModelFileError", "SamplingParams", "StreamEvent",
           "ValidationError", "load_model", "preset", "write_model", "__version__"]
