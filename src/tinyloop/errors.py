"""Error types shared across layers (defined here, below every package, so none imports another for them).

`ValidationError` is the one error every request-validation path raises; the server maps it to an
OpenAI-shaped JSON error. `ModelFileError` is raised for a model file (or a file beside it, such as a
draft-exit file) that cannot be used.
"""

from __future__ import annotations

from pathlib import Path


class ValidationError(ValueError):
    """A request the engine cannot run as asked. `param` names the field to fix."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class CommandError(Exception):
    """A command line's failure, said in one line (`tinyloop: error: ...`); `status` is the exit status."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


class RequestTimeout(RuntimeError):
    """A request ran out of its time (`timeout_s`) before producing anything."""


class ModelFileError(RuntimeError):
    """A file the model cannot be loaded from: names the file and the exact problem."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem
