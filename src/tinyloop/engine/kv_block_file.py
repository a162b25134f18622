"""One prompt-cache block on disk (engine/disk_cache.py keeps the directory of them): the file format, written
and checked here.

A file: `MAGIC`, a 4-byte header length, a JSON header (the engine's identity, the block's name, depth, parent
name, tokens, salt, slot count and storage parts), the payload (keys then values, each `KVTensor` part as the
pool stores it, `n_slots` pages each) and a CRC-32 of everything before it. A file is this engine's block only
if all of it holds (`check`, `meta_problem`); the caller ignores and removes any other.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Any

log = logging.getLogger("tinyloop.engine")

MAGIC = b"TLKVBLK1"
HEAD = struct.Struct("<I")   # the JSON header's length
CRC = struct.Struct("<I")    # the CRC-32 at the end


def encode(header: dict[str, Any], parts: list) -> list:
    """A block file's buffers, in order: the magic, the header, the payload's `parts` (bytes-like), the CRC."""
    text = json.dumps(header).encode()
    bufs = [MAGIC + HEAD.pack(len(text)) + text, *parts]
    crc = 0
    for buf in bufs:
        crc = zlib.crc32(buf, crc)
    return [*bufs, CRC.pack(crc)]


def read(path: Path) -> memoryview | None:
    """A whole file's bytes; None (logged) where it cannot be read. FileNotFoundError passes through (a miss)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise
    except OSError as exc:
        log.warning("prompt cache: cannot open %s: %s", path, exc)
        return None
    try:
        size = os.fstat(fd).st_size
        view = memoryview(bytearray(size))
        got = 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n <= 0:
                break
            got += n
    except OSError as exc:
        log.warning("prompt cache: cannot read %s: %s", path, exc)
        return None
    finally:
        os.close(fd)
    return view[:got]


def meta_problem(meta: Any, identity: dict[str, Any], part_layout: Any, expect: dict[str, Any]) -> str | None:
    """Why a block file's header is not the block `expect` describes, written by an engine of `identity` with the
    storage `part_layout` (None: it is)."""
    if not isinstance(meta, dict):
        return "its header is not an object"
    ident = meta.get("identity")
    if ident != identity:
        if not isinstance(ident, dict):
            return "no identity in its header"
        diff = [k for k in sorted(set(ident) | set(identity)) if ident.get(k) != identity.get(k)]
        return "written for another " + ", ".join(f"{k} ({ident.get(k)!r}, this engine's {identity.get(k)!r})"
                                                    for k in diff[:3])
    if meta.get("parts") != part_layout:
        return f"another storage layout ({meta.get('parts')})"
    wrong = [k for k, v in expect.items() if meta.get(k) != v]
    if wrong:
        return f"another block ({', '.join(wrong)} differ)"
    return None


def check(data: memoryview, identity: dict[str, Any], part_layout: Any, page_bytes: int,
          expect: dict[str, Any]) -> tuple[str | None, int, dict]:
    """(None, payload offset, header) for a whole file (`read`) that is the block `expect` describes, of
    `page_bytes` a slot; else (why, 0, header or {})."""
    head = len(MAGIC) + HEAD.size
    if len(data) < head + CRC.size:
        return f"truncated ({len(data)} bytes)", 0, {}
    if bytes(data[:len(MAGIC)]) != MAGIC:
        return "not a TinyLoop KV block file (bad magic)", 0, {}
    (hlen,) = HEAD.unpack_from(data, len(MAGIC))
    if head + hlen + CRC.size > len(data):
        return f"truncated ({len(data)} bytes, its header alone says {head + hlen})", 0, {}
    try:
        meta = json.loads(bytes(data[head:head + hlen]))
    except (ValueError, UnicodeDecodeError):
        return "its header is not JSON", 0, {}
    if not isinstance(meta, dict):
        return "its header is not an object", 0, {}
    why = meta_problem(meta, identity, part_layout, {})
    if why is not None:
        return why, 0, meta
    n_slots = meta.get("n_slots")
    if not isinstance(n_slots, int) or n_slots < 1:
        return f"another storage layout ({n_slots} slots, {meta.get('parts')})", 0, meta
    expected = head + hlen + n_slots * page_bytes + CRC.size
    if len(data) != expected:
        return f"truncated or padded: {len(data)} bytes, {expected} expected", 0, meta
    (crc,) = CRC.unpack_from(data, len(data) - CRC.size)
    if zlib.crc32(data[:len(data) - CRC.size]) != crc:
        return "checksum mismatch", 0, meta
    why = meta_problem(meta, identity, part_layout, expect)
    if why is not None:
        return why, 0, meta
    return None, head + hlen, meta
