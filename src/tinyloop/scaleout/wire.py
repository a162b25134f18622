"""What crosses from an engine replica to the ingress: StreamEvents, None (the end), and errors as plain
tuples (exceptions with keyword-only state do not survive pickling; the ingress rebuilds the same
`APIError` the single-process server would have raised)."""

from __future__ import annotations

from typing import Any

from ..server.errors import APIError, from_engine_failure

ERROR = "tinyloop-error"


def encode(item: Any) -> Any:
    """(replica) An engine worker item -> its wire form."""
    if isinstance(item, BaseException):
        err = from_engine_failure(item)
        return (ERROR, err.status, err.message, err.param, err.code, err.type, err.headers)
    return item


def decode(item: Any) -> Any:
    """(ingress) The wire form -> what an `EngineWorker` handle would have given: StreamEvent, APIError, None."""
    if isinstance(item, tuple) and item and item[0] == ERROR:
        _, status, message, param, code, type_, headers = item
        return APIError(status, message, param=param, code=code, type=type_, headers=headers)
    return item
