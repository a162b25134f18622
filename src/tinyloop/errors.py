"""The one error type every validation path raises; the server maps it to an OpenAI-shaped JSON error."""

from __future__ import annotations


class ValidationError(ValueError):
    """A request the engine cannot run as asked. `param` names the field to fix."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class RequestTimeout(RuntimeError):
    """A request ran out of its time (`timeout_s`) before producing anything."""
