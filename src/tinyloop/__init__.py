"""TinyLoop: inference engine and server for weight-shared looped transformer language models.

    from tinyloop import Engine, SamplingParams
    engine = Engine.load()                      # the shipped model, or a path / $TINYLOOP_MODEL_PATH
    result = engine.generate("The king said", SamplingParams(max_tokens=32, loops=8))
    for event in engine.stream("The king said", SamplingParams(max_tokens=32)):
        print(event.text, end="")

The names below are imported on first use (PEP 562), so `import tinyloop` and the `tinyloop` command
line answer without importing torch until something needs it.
"""

from __future__ import annotations

from importlib import import_module

from .version import __version__

_LAZY = {
    "ModelConfig": ".config", "preset": ".config",
    "Engine": ".engine", "GenerationResult": ".engine", "SamplingParams": ".engine", "StreamEvent": ".engine",
    "ModelFileError": ".errors", "ValidationError": ".errors",
    "load_model": ".modelfile.loader", "write_model": ".modelfile.loader",
}

__all__ = ["Engine", "GenerationResult", "ModelConfig", "ModelFileError", "SamplingParams", "StreamEvent",
           "ValidationError", "load_model", "preset", "write_model", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        if name in ("Engine", "load_model"):
            import_module(".store", __name__)  # hf: names wherever a model path goes (pulled on first use)
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tinyloop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
