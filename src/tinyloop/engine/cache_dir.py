"""The prompt cache's directory (`--prompt-cache-dir`; engine/disk_cache.py reads and writes its blocks): the
files themselves and their lifetimes. Names that cannot leave the directory (`check_name`), the model file's
memoized hash, writes that are atomic (a temporary name, fsync, rename) and the temporary files of writes cut
short (`dead_tmp`), the size bound (`scan`: least recently used first, saved conversations' blocks last) and
saved conversations' manifests (`saved/<name>.json`: the routes' side, files only, no engine).

Layout: `DIR/<namespace>/<block name>.kvb` (one KV block a file), `DIR/saved/<name>.json`, `DIR/model-hashes.json`.
Several processes may share one directory (Ray Serve replicas): files are immutable once renamed, names are
content addresses, and each writer re-scans the directory before it evicts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("tinyloop.engine")

SUFFIX = ".kvb"
TMP_PREFIX = ".tmp."
SAVED_DIR = "saved"
HASHES_FILE = "model-hashes.json"
EVICT_TO = 0.9                  # eviction goes down to this fraction of the bound (not one file per write)
STALE_TMP_S = 3600.0            # a temporary file this old is a dead write whoever made it
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CacheNameError(ValueError):
    pass


def check_name(name: str) -> str:
    """A saved conversation's name: letters, digits, '.', '_', '-', at most 128, not starting with a dot and
    without '..': it cannot leave the cache directory (no separator, no absolute path, no parent)."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise CacheNameError(f"name {name!r} must be 1 to 128 letters, digits, '.', '_' or '-', not start with "
                             "'.' or '-' and hold no '..' (it names a file inside the cache directory)")
    return name


def file_hash(path: str | Path, memo_dir: str | Path | None = None) -> str:
    """sha256 of a file's bytes, memoized in `memo_dir/model-hashes.json` by (real path, size, mtime_ns,
    inode): a model file is hashed once, not at every start (a 4 GB file takes seconds)."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo_path = Path(memo_dir) / HASHES_FILE if memo_dir is not None else None
    memo: dict[str, str] = {}
    if memo_path is not None:
        try:
            memo = json.loads(memo_path.read_text())
            if not isinstance(memo, dict):
                memo = {}
        except (OSError, ValueError):
            memo = {}
        if isinstance(memo.get(key), str):
            return memo[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    if memo_path is not None:
        live = {k: v for k, v in memo.items() if isinstance(v, str) and Path(k.split("|")[0]).exists()}
        live[key] = digest
        try:
            atomic_write(memo_path, json.dumps(live, indent=0).encode())
        except OSError as exc:
            log.warning("prompt cache: cannot memoize the model's hash in %s: %s", memo_path, exc)
    return digest


def tmp_name(directory: Path, suffix: str = "") -> Path:
    return directory / f"{TMP_PREFIX}{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(6)}{suffix}"


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | list, mtime_ns: int | None = None) -> int:
    """Write `data` (bytes, or a list of buffers) to `path` through a temporary name, fsync, rename."""
    tmp = tmp_name(path.parent)
    size = 0
    try:
        with open(tmp, "wb") as f:
            for buf in data if isinstance(data, list) else [data]:
                size += f.write(buf)
            f.flush()
            os.fsync(f.fileno())
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return size


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # (EPERM: someone else's, alive)
        return True
    return True


_STARTED = time.time()


def dead_tmp(entry: os.DirEntry, now: float) -> bool:
    """A temporary file no live writer owns: a write cut short (SIGKILL, a crash, power)."""
    try:
        mtime = entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return False
    if now - mtime > STALE_TMP_S:
        return True
    parts = entry.name[len(TMP_PREFIX):].split(".")
    if len(parts) < 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False   # another host's: only its age says it is dead
    pid = int(parts[1])
    if pid == os.getpid():   # (a container's server is often pid 1 at every start)
        return mtime < _STARTED
    return not _pid_alive(pid)


@dataclass
class Scan:
    total: int = 0                                   # bytes in the directory (every namespace, saved conversations)
    mine: list[Path] = field(default_factory=list)   # one namespace's block files, the most recently used first
    evicted: int = 0


def scan(root: Path, max_bytes: int, mine: str | None = None) -> Scan:
    """Sum the directory's bytes and evict past `max_bytes` (down to EVICT_TO of it): least recently used
    files first, those a saved conversation names last; remove temporary files no live writer owns. With
    `mine` (a namespace: at start), also list its block files, the most recently used first (a chain's head
    before its tail), and remove the top level's dead temporary files too."""
    now = time.time()
    files: list[tuple[int, str, int]] = []   # (mtime_ns, relative path, size)
    out = Scan()
    try:
        tops = list(os.scandir(root))
    except OSError as exc:
        log.warning("prompt cache: cannot list %s: %s", root, exc)
        return out
    for top in tops:
        if not top.is_dir(follow_symlinks=False):
            if top.name.startswith(TMP_PREFIX) and mine is not None and dead_tmp(top, now):
                unlink(top.path)
            elif top.is_file(follow_symlinks=False):
                out.total += size_of(top)
            continue
        try:
            entries = list(os.scandir(top.path))
        except OSError:
            continue
        for e in entries:
            if e.name.startswith(TMP_PREFIX):
                if dead_tmp(e, now):
                    unlink(e.path)
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            out.total += st.st_size
            if e.name.endswith(SUFFIX):
                files.append((st.st_mtime_ns, f"{top.name}/{e.name}", st.st_size))
    if mine is not None:
        own = sorted((f for f in files if f[1].startswith(mine + "/")), key=lambda f: -f[0])
        out.mine = [root / rel for _, rel, _ in own]
    if out.total > max_bytes:
        kept = pinned(root)
        files.sort(key=lambda f: (f[1] in kept, f[0]))
        goal = int(max_bytes * EVICT_TO)
        for _, rel, size in files:
            if out.total <= goal:
                break
            if unlink(os.path.join(root, rel)):
                out.evicted += 1
            out.total -= size
    return out


def pinned(root: Path) -> set[str]:
    """The block files (namespace/name) that saved conversations name: evicted last."""
    out = set()
    try:
        entries = list(os.scandir(root / SAVED_DIR))
    except OSError:
        return out
    for e in entries:
        if not e.name.endswith(".json"):
            continue
        try:
            m = json.loads(Path(e.path).read_text())
            out.update(f"{m['namespace']}/{h}{SUFFIX}" for h in m["blocks"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def size_of(entry: os.DirEntry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0


def unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


# -- saved conversations (the routes' side: files only, no engine) -------------------------------------
def saved_path(root: str | Path, label: str) -> Path:
    check_name(label)
    base = (Path(root) / SAVED_DIR).resolve()
    path = (base / f"{label}.json").resolve()
    if path.parent != base:   # (check_name already refuses anything that could)
        raise CacheNameError(f"name {label!r} leaves the cache directory")
    return path


def read_manifest(root: str | Path, label: str) -> dict[str, Any] | None:
    path = saved_path(root, label)
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("prompt cache: ignored and removed %s: %s", path, exc)
        unlink(str(path))
        return None
    return m if isinstance(m, dict) else None


def list_manifests(root: str | Path) -> list[dict[str, Any]]:
    out = []
    try:
        entries = sorted(os.scandir(Path(root) / SAVED_DIR), key=lambda e: e.name)
    except OSError:
        return out
    for e in entries:
        if e.name.endswith(".json") and not e.name.startswith("."):
            m = read_manifest(root, e.name[:-5]) if NAME_RE.fullmatch(e.name[:-5]) else None
            if m is not None:
                out.append(m)
    return out
