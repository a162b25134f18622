"""The KV-cache formats by name (torch-free: the command line's choices); the quantizers are in `kv.py`."""

from __future__ import annotations

KV_FORMATS = ("fp16", "int8", "int4", "int4-h")
_BITS = {"fp16": None, "int8": 8, "int4": 4, "int4-h": 4}


def kv_format_bits(kv_format: str) -> int | None:
    """Bits per stored value (None for the unquantized format); ValueError for an unknown format."""
    if kv_format not in _BITS:
        raise ValueError(f"unknown KV cache format {kv_format!r}; choose one of {list(KV_FORMATS)}")
    return _BITS[kv_format]


def kv_format_rotates(kv_format: str) -> bool:
    kv_format_bits(kv_format)
    return kv_format.endswith("-h")
