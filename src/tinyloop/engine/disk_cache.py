"""The prompt cache on disk: the prefix cache's full blocks kept in files, so that a restart (or the model's
next load) starts warm (`--prompt-cache-dir`, `--prompt-cache-bytes`; docs/server.md "Prompt cache on disk").

A block (`engine.prefix_cache`: one page per cache slot, `page_size` positions, named by the hash chain of
its tokens and the salt) becomes one file, `DIR/<namespace>/<block name>.kvb`. The namespace is a hash of
everything else the keys and values depend on, which a block's name does not say: the model file's content
hash (`model_hash`, sha256, memoized by path, size and mtime so a large file is hashed once, not at every
start), its draft-exit file's (the speculative layouts' extra slots), the state seed, the KV format, the
pool's float dtype, the page size, the pool's head shape, the device kind and the native executor (its ISA),
this file format's version and TinyLoop's. The loop/slot layout is the block name's salt (loops, window, the
draft depth) and its slot count; loop-shared KV (`kv_loops`) is never cached (a ring slot's keys depend on how
the prompt was chunked), so it never reaches the disk either.

A file (engine/kv_block_file.py): a magic, a JSON header (that identity, the block's name, depth, parent name,
tokens, salt, slot count and storage parts), the payload (keys then values, each `KVTensor` part as the
pool stores it: floats, or int8/int4 codes with their scales and offsets, `n_slots` pages each) and a
CRC-32 of everything before it. Reading checks all of it: a file that does not match (another model, format
or version), is truncated or fails its checksum is ignored with one log line and removed, and the block is
computed as if it had never been cached.

Writes: the engine thread copies a block's pages out of the pool when the block is named (one index_select
per storage part for the blocks a step fills; on a GPU an asynchronous device copy) and a writer thread
does the rest: a temporary name (`.tmp.<host>.<pid>.<random>`), fsync, then an atomic rename, so a write
cut short (SIGKILL, power) leaves only a temporary file, which is never read and is removed at the next
start. The writer holds at most `queue_bytes` of copies; past that a block is not copied then, and is
written at shutdown if it is still in memory (`close`). Reads: lazily, at admission (`PrefixCache.extend`):
the blocks past the in-memory hit are read in chain order until the first one missing, each verified and
copied into free pool pages, then named in the in-memory prefix cache as if computed there.

The directory's files (names, atomic writes, the size bound, saved conversations' manifests) are
engine/cache_dir.py's: bounded in bytes, least recently used first; a file's mtime is its last use (written,
read, or its block hit in memory), less its depth in microseconds, so that a chain's tail goes before its head.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..version import __version__
from .cache_dir import SAVED_DIR, SUFFIX, atomic_write, check_name, file_hash, fsync_dir, scan
from .kv_block_file import CRC, HEAD, MAGIC, check, encode, meta_problem, read
from .prefix_cache import block_name

log = logging.getLogger("tinyloop.engine")

DISK_VERSION = 1
DEFAULT_MAX_BYTES = 4 << 30
_STAMPS_KEPT = 65536            # chain stamps remembered (a new block inherits its parent's)
READERS = 2                     # threads reading a chain's files at admission (reads and CRCs release the GIL)


# -- the model's identity -------------------------------------------------------------------------
def engine_identity(engine, kv, memo_dir: str | Path | None = None) -> dict[str, Any]:
    """What a block's keys and values depend on besides its name (tokens, salt): the model's bytes and
    everything the engine adds. Two engines with the same identity compute the same KV for a block."""

    loaded = engine.loaded
    draft = getattr(loaded, "draft_exit_path", None)
    exits = getattr(engine.model, "draft_exits", None)
    return {
        "format": "tinyloop-kv-block", "version": DISK_VERSION, "tinyloop": __version__,
        "model": file_hash(loaded.path, memo_dir),
        "draft_exit": file_hash(draft, memo_dir) if exits and draft is not None and Path(draft).exists() else None,
        "state_seed": getattr(engine.model, "state_seed", None),
        "kv_format": kv.kv_format, "dtype": str(kv.dtype).removeprefix("torch."), "page_size": kv.page_size,
        "kv_heads": kv.cfg.n_kv_heads, "head_dim": kv.cfg.head_dim,
        "device": kv.k.parts[0].device.type, "executor": engine.executor_name,
    }


def namespace(identity: dict[str, Any]) -> str:
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).hexdigest()


@dataclass
class _Block:
    name: bytes
    depth: int
    parent: bytes | None
    tokens: list[int]
    salt: str
    n_slots: int


class DiskPrefixCache:
    """One engine core's view of a prompt-cache directory (see the module's doc). `kv` is the core's
    `PagedKV`; `identity` from `engine_identity`. The engine thread calls `named`, `touch` and `save_manifest`
    (the writer thread writes), `present`/`load` (admission reads, on `READERS` threads), `warm_start` and
    `preload` (the read-back at start) and `close`."""

    def __init__(self, root: str | Path, kv, identity: dict[str, Any], *, max_bytes: int = DEFAULT_MAX_BYTES,
                 queue_bytes: int | None = None):
        self.root = Path(root)
        self.kv = kv
        self.identity = dict(identity)
        self.ns = namespace(self.identity)
        self.dir = self.root / self.ns
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.root / SAVED_DIR).mkdir(exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.queue_bytes = int(queue_bytes if queue_bytes is not None else min(256 << 20, max(self.max_bytes, 1 << 20)))
        self.page_size = kv.page_size
        self._parts = list(kv.k.parts) + list(kv.v.parts)
        self._part_layout = [[str(t.dtype).removeprefix("torch."), list(t.shape[1:])] for t in self._parts]
        self._page_bytes = [t[0].numel() * t.element_size() for t in self._parts]
        # on the CPU, the parts' bytes as numpy arrays (the same memory): numpy's gather and scatter of whole
        # pages is single-threaded and takes microseconds, where torch's index ops wake every intra-op thread
        self._np = [t.view(torch.uint8).numpy() for t in self._parts] \
            if self._parts[0].device.type == "cpu" else None
        # counters (read by /metrics from another thread: plain ints)
        self.hits = self.misses = self.hit_tokens = 0
        self.written = self.ignored = self.evicted = self.dropped = 0
        self.bytes_on_disk = 0
        self._stamps: OrderedDict[bytes, int] = OrderedDict()
        self._unwritten: OrderedDict[bytes, _Block] = OrderedDict()   # named, not copied (queue full)
        self._pending = 0               # bytes of copies waiting for the writer
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._preload: deque[Path] | None = None   # this namespace's files, most recently used first (the scan)
        self.preloaded = 0
        self._readers = None            # the admission readers' thread pool (made on first use)
        self._preload_pages = 0
        self._thread = threading.Thread(target=self._writer, name="tinyloop-prompt-cache", daemon=True)
        self._thread.start()
        self._q.put(("scan",))

    # -- naming ---------------------------------------------------------------------------------
    def path(self, name: bytes) -> Path:
        return self.dir / (name.hex() + SUFFIX)

    def stats(self) -> dict[str, int]:
        return {"bytes": self.bytes_on_disk, "hits": self.hits, "misses": self.misses, "hit_tokens": self.hit_tokens,
                "written": self.written, "ignored": self.ignored, "evicted": self.evicted, "dropped": self.dropped,
                "preloaded": self.preloaded}

    def _stamp(self, name: bytes, parent: bytes | None, now_ns: int) -> int:
        stamp = self._stamps.get(parent, now_ns) if parent is not None else now_ns
        self._stamps[name] = stamp
        self._stamps.move_to_end(name)
        while len(self._stamps) > _STAMPS_KEPT:
            self._stamps.popitem(last=False)
        return stamp

    # -- the engine thread: writes ----------------------------------------------------------------
    def named(self, blocks: list[tuple[bytes, int, bytes | None, list[int], Any, list[int]]], *,
              force: bool = False) -> None:
        """Blocks just computed and named in the in-memory cache: (name, depth, parent, tokens, salt, pages)
        each, all of one sequence (one slot count). Their pages are copied now; the writer writes them."""
        if not blocks or self._closed:
            return
        n_slots = len(blocks[0][5])
        size = len(blocks) * n_slots * sum(self._page_bytes)
        now = time.time_ns()
        metas = [_Block(name, depth, parent, list(tokens), repr(salt), n_slots)
                 for name, depth, parent, tokens, salt, _ in blocks]
        stamps = [self._stamp(b.name, b.parent, now) for b in metas]
        if not force and self._pending + size > self.queue_bytes:
            self.dropped += len(blocks)
            for b in metas:   # written at shutdown if still in memory (close)
                self._unwritten[b.name] = b
            while len(self._unwritten) > _STAMPS_KEPT:
                self._unwritten.popitem(last=False)
            return
        pages = [p for blk in blocks for p in blk[5]]
        if self._np is not None:
            snaps = [torch.from_numpy(a[pages]) for a in self._np]   # (copies)
        else:   # an asynchronous device copy; the writer waits for it
            idx = torch.tensor(pages, device=self._parts[0].device)
            snaps = [t.index_select(0, idx).view(torch.uint8) for t in self._parts]
        with self._lock:
            self._pending += size
        self._idle.clear()
        self._q.put(("blocks", metas, stamps, snaps, size))

    def touch(self, names: list[bytes]) -> None:
        """Blocks 0..len(names)-1 of a chain were used (a hit, in memory or from disk): their files are now
        the most recently used, the head the most."""
        if not names or self._closed:
            return
        now = time.time_ns()
        for name in names:
            self._stamps[name] = now
            self._stamps.move_to_end(name)
        self._idle.clear()
        self._q.put(("touch", [(self.path(n), d) for d, n in enumerate(names)], now))

    def save_manifest(self, label: str, blocks, *, tokens: list[int], info: dict[str, Any]) -> None:
        """A saved conversation (`POST /v1/cache/save`): its blocks (as `named`, every one copied now, the
        writer skipping those on disk already), then `saved/<label>.json`, written after them."""
        check_name(label)
        self.named(blocks, force=True)
        manifest = {"format": "tinyloop-prompt-cache-save", "version": DISK_VERSION, "name": label,
                    "namespace": self.ns, "identity": self.identity, "tokens": list(tokens),
                    "blocks": [b[0].hex() for b in blocks], "cached_tokens": len(blocks) * self.page_size,
                    "bytes": len(blocks) * (len(blocks[0][5]) if blocks else 0) * self.block_page_bytes(),
                    "created": time.time(), **info}
        self._idle.clear()
        self._q.put(("manifest", label, manifest))

    def block_page_bytes(self) -> int:
        return sum(self._page_bytes)

    # -- the engine thread: reads -----------------------------------------------------------------
    def expect(self, names: list[bytes], b: int, tokens, salt: Any, n_slots: int) -> dict[str, Any]:
        """What block b of a chain's file must say about itself."""
        ps = self.page_size
        return {"name": names[b].hex(), "depth": b, "parent": names[b - 1].hex() if b else None,
                "tokens": list(tokens[b * ps:(b + 1) * ps]), "salt": repr(salt), "n_slots": n_slots}

    def present(self, names: list[bytes], start: int, most: int) -> list[tuple[int, int]]:
        """(b, open file descriptor) of blocks start, start+1, ... whose files exist, up to the first missing
        and at most `most` (the caller's free pages); `load` reads and closes them."""
        out = []
        for b in range(start, min(len(names), start + most)):
            try:
                fd = os.open(self.path(names[b]), os.O_RDONLY)
            except FileNotFoundError:
                self.misses += 1
                break
            except OSError as exc:
                log.warning("prompt cache: cannot open %s: %s", self.path(names[b]), exc)
                break
            out.append((b, fd))
        return out

    def load(self, found: list[tuple[int, int]], pages: list[list[int]], names: list[bytes], tokens, salt: Any,
             n_slots: int) -> int:
        """Read the files `present` opened straight into their blocks' pool pages (`pages`, one list per block),
        verifying each (its size, checksum and header); returns how many leading blocks are good. A bad file is
        ignored and removed with one log line; the pages of a bad block and of every block after it hold
        nothing usable (the caller frees them unnamed). The reads and checksums run on `READERS` threads (both
        release the GIL): a 2,000-token prompt's blocks in a fraction of its warm time to first token."""
        jobs = [(fd, pg, self.expect(names, b, tokens, salt, n_slots), self.path(names[b]))
                for (b, fd), pg in zip(found, pages)]
        if self._np is not None and len(jobs) > 2:
            if self._readers is None:
                from concurrent.futures import ThreadPoolExecutor

                self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="tinyloop-prompt-cache-read")
            results = list(self._readers.map(self._load_one, jobs))
        else:
            results = [self._load_one(job) for job in jobs]
        for (_, _, _, path), why in zip(jobs, results):
            if why is not None:
                self._reject(path, why)
        good = next((i for i, why in enumerate(results) if why is not None), len(results))
        self.hits += good
        self.hit_tokens += good * self.page_size
        return good

    def _load_one(self, job) -> str | None:
        """One block's file into its pages (None: good; else why not). Closes the descriptor."""
        fd, pages, expect, _ = job
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, len(MAGIC) + HEAD.size, 0)
            if len(head) < len(MAGIC) + HEAD.size:
                return f"truncated ({size} bytes)"
            if head[:len(MAGIC)] != MAGIC:
                return "not a TinyLoop KV block file (bad magic)"
            (hlen,) = HEAD.unpack_from(head, len(MAGIC))
            expected = len(head) + hlen + len(pages) * sum(self._page_bytes) + CRC.size
            if size != expected or hlen > size:
                return f"truncated or padded: {size} bytes, {expected} expected for {len(pages)} slots"
            header = bytearray(hlen)
            crc_buf = bytearray(CRC.size)
            if self._np is not None:
                dests = [a[p].reshape(-1) for a in self._np for p in pages]
                bufs = [header, *dests, crc_buf]
                got = os.preadv(fd, bufs, len(head))
                if got != size - len(head):
                    return f"truncated while read ({len(head) + got} of {size} bytes)"
                crc = zlib.crc32(header, zlib.crc32(head))
                for d in dests:
                    crc = zlib.crc32(d, crc)
            else:
                payload = bytearray(size - len(head) - hlen - CRC.size)
                got = os.preadv(fd, [header, payload, crc_buf], len(head))
                if got != size - len(head):
                    return f"truncated while read ({len(head) + got} of {size} bytes)"
                crc = zlib.crc32(payload, zlib.crc32(header, zlib.crc32(head)))
            if crc != CRC.unpack(crc_buf)[0]:
                return "checksum mismatch"
            try:
                meta = json.loads(header)
            except (ValueError, UnicodeDecodeError):
                return "its header is not JSON"
            why = meta_problem(meta, self.identity, self._part_layout, expect)
            if why is None and self._np is None:
                self.fill(memoryview(payload), pages)
            return why
        except OSError as exc:
            return f"unreadable ({exc})"
        finally:
            os.close(fd)

    # -- the engine thread, idle: reading the most recently used blocks back at start -----------------
    @property
    def preloading(self) -> bool:
        return self._preload is None or bool(self._preload)

    def preload(self, prefix, budget_s: float = 0.004, share: float = 0.5) -> bool:
        """While the engine is idle after a start: read this model's most recently used blocks (chain heads
        first) into free pool pages and name them in `prefix`, for at most `budget_s` per call and at most
        `share` of the pool in all, so that the first requests after a restart find them in memory as a warm
        cache does. True while there is more to read."""
        if self._preload is None:
            return True   # (the writer's first scan has not listed the files yet)
        end = time.perf_counter() + budget_s
        while self._preload and time.perf_counter() < end:
            self._preload_next(prefix, share)
        return bool(self._preload)

    def _preload_next(self, prefix, share: float) -> dict | None:
        """Read the next listed block into memory: its header (None: skipped, or no room left, which ends the
        preload)."""
        todo, pool, ps = self._preload, prefix.pool, self.page_size
        path = todo.popleft()
        try:
            name = bytes.fromhex(path.name[:-len(SUFFIX)])
        except ValueError:
            return None
        if name in prefix._blocks:
            return None
        try:
            data = read(path)
        except FileNotFoundError:   # (evicted since the scan: not a lookup's miss)
            return None
        if data is None:
            return None
        why, start, meta = check(data, self.identity, self._part_layout, sum(self._page_bytes), {"name": name.hex()})
        if why is None:
            parent = bytes.fromhex(meta["parent"]) if meta.get("parent") else None
            tokens = meta.get("tokens")
            if not isinstance(tokens, list) or len(tokens) != ps or \
                    block_name(parent, tokens, _Salt(str(meta.get("salt")))) != name:
                why = "its name is not its tokens' (a damaged or forged header)"
            elif parent is not None and parent not in prefix._blocks:
                return None   # its chain's head is not in memory: unreachable
        if why is not None:
            self._reject(path, why)
            return None
        n_slots = meta["n_slots"]
        if self._preload_pages + n_slots > pool.n_pages * share or pool.num_free < n_slots:
            todo.clear()
            return None
        pages = pool.allocate(n_slots)
        self.fill(data[start:len(data) - CRC.size], pages)
        prefix.insert(name, pages)
        pool.free(pages)
        self._preload_pages += n_slots
        self.preloaded += 1
        return meta

    def warm_start(self, batch, budget_s: float = 2.0, share: float = 0.5) -> int:
        """At load, before the engine serves: the most recently used chain (an agent's conversation, most
        likely the next request's prefix) read back into memory, then replayed once through the core (one
        token; every full block found in memory), so that what a process pays on its first request at that
        context length (RoPE tables, the native executor's scratch, the allocator's first large blocks) is not
        the first user's. The other blocks follow in idle time (`preload`). Returns the tokens replayed."""
        if not self.flush(30) or not self._preload:
            return 0
        prefix = batch.sched.prefix
        tokens: list[int] = []
        salt, last = None, None
        end = time.perf_counter() + budget_s
        while self._preload and time.perf_counter() < end:
            meta = self._preload_next(prefix, share)
            if meta is None:
                if not tokens:
                    continue
                break
            if meta.get("parent") != last or (salt is not None and meta.get("salt") != salt):
                break   # the next chain
            tokens += meta["tokens"]
            salt, last = meta.get("salt"), meta["name"]
        return self._replay(batch, tokens, salt)

    def _replay(self, batch, tokens: list[int], salt: str | None) -> int:
        import ast

        from .knobs import SamplingParams
        from .serving import run_to_completion

        try:
            kind = ast.literal_eval(salt or "")
        except (ValueError, SyntaxError):
            return 0
        if not tokens or not isinstance(kind, tuple) or len(kind) != 4 or kind[0] != "loops":
            return 0   # (a speculative layout's chain is not replayed)
        prefix = batch.sched.prefix
        kept = batch.steps, batch.preemptions, batch.peak_running, prefix.hit_tokens
        try:
            params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, loops=kind[1],
                                    cache_window=kind[3])
            run_to_completion(batch, [(tokens, params)])
        except Exception as exc:  # noqa: BLE001 - a warm-up: the server serves without it
            log.warning("prompt cache: replaying the last conversation failed (%s: %s)", type(exc).__name__, exc)
            return 0
        finally:
            batch.steps, batch.preemptions, batch.peak_running, prefix.hit_tokens = kept
        return len(tokens)

    def fill(self, payload: memoryview, pages: list[int]) -> None:
        """Copy a verified payload (`read`) into pool pages, one per slot."""
        n_slots = len(pages)
        off = 0
        if self._np is not None:
            for a, per in zip(self._np, self._page_bytes):
                n = per * n_slots
                a[pages] = np.frombuffer(payload, dtype=np.uint8, count=n, offset=off).reshape(n_slots, *a.shape[1:])
                off += n
            return
        dev = self._parts[0].device
        idx = torch.tensor(pages, device=dev)
        for t, per in zip(self._parts, self._page_bytes):
            n = per * n_slots
            src = torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=off).view(n_slots, -1)
            t.view(torch.uint8).view(t.shape[0], -1).index_copy_(0, idx, src.to(dev))
            off += n

    def _reject(self, path: Path, why: str) -> None:
        log.warning("prompt cache: ignored and removed %s: %s", path, why)
        self.ignored += 1
        try:
            size = path.stat().st_size
            path.unlink()
            self.bytes_on_disk = max(0, self.bytes_on_disk - size)
        except OSError:
            pass

    # -- shutdown ---------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writer has written everything queued so far; False on timeout."""
        done = threading.Event()
        self._q.put(("idle", done))
        return done.wait(timeout)

    def close(self, prefix=None, timeout: float = 30.0) -> None:
        """At shutdown, on the engine thread: write what the writer had no room for and is still in memory
        (`prefix`: the in-memory `PrefixCache`), wait for the writer (at most `timeout`), stop it."""
        if self._closed:
            return
        if prefix is not None and self._unwritten:
            left = [(b, prefix._blocks.get(b.name)) for b in self._unwritten.values()]
            self._unwritten.clear()
            groups: dict[int, list] = {}
            for b, pages in left:
                if pages is not None and len(pages) == b.n_slots:
                    groups.setdefault(b.n_slots, []).append((b.name, b.depth, b.parent, b.tokens, _Salt(b.salt), pages))
            for blocks in groups.values():
                for i in range(0, len(blocks), 64):
                    self.named(blocks[i:i + 64], force=True)
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout)

    # -- the writer thread ------------------------------------------------------------------------
    def _writer(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                self._idle.set()
                return
            try:
                kind = job[0]
                if kind == "blocks":
                    self._write_blocks(*job[1:])
                elif kind == "touch":
                    for path, depth in job[1]:
                        t = job[2] - depth * 1000
                        try:
                            os.utime(path, ns=(t, t))
                        except OSError:
                            pass
                elif kind == "manifest":
                    self._write_manifest(job[1], job[2])
                elif kind == "scan":
                    try:
                        self._scan(start=True)
                    finally:
                        if self._preload is None:
                            self._preload = deque()
                elif kind == "idle":
                    job[1].set()
            except Exception:  # noqa: BLE001 - the disk cache never takes the engine down
                log.exception("prompt cache: the writer failed on a %s job", job[0])
            if self._q.empty():
                self._idle.set()

    def _write_blocks(self, metas: list[_Block], stamps: list[int], snaps: list[torch.Tensor], size: int) -> None:
        try:
            cpu = [s.to("cpu") for s in snaps]
            wrote = 0
            for i, (b, stamp) in enumerate(zip(metas, stamps)):
                path = self.path(b.name)
                t = stamp - b.depth * 1000
                if path.exists():   # (another request, or process, wrote it): now the most recently used
                    try:
                        os.utime(path, ns=(t, t))
                    except OSError:
                        pass
                    continue
                header = {"identity": self.identity, "name": b.name.hex(), "depth": b.depth,
                          "parent": b.parent.hex() if b.parent is not None else None,
                          "tokens": b.tokens, "salt": b.salt, "n_slots": b.n_slots, "parts": self._part_layout}
                bufs = encode(header, [memoryview(part[i * b.n_slots:(i + 1) * b.n_slots].contiguous().numpy())
                                       .cast("B") for part in cpu])
                try:
                    n = atomic_write(path, bufs, mtime_ns=t)
                except OSError as exc:
                    log.warning("prompt cache: cannot write %s: %s", path, exc)
                    return
                self.written += 1
                wrote += n
            if wrote:
                fsync_dir(self.dir)
                self.bytes_on_disk += wrote
                if self.bytes_on_disk > self.max_bytes:
                    self._scan()
        finally:
            with self._lock:
                self._pending -= size

    def _write_manifest(self, label: str, manifest: dict[str, Any]) -> None:
        path = self.root / SAVED_DIR / f"{label}.json"
        n = atomic_write(path, json.dumps(manifest).encode())
        self.bytes_on_disk += n
        if self.bytes_on_disk > self.max_bytes:
            self._scan()

    def _scan(self, start: bool = False) -> None:
        """Sum the directory's bytes and evict past the bound (`cache_dir.scan`); at start also list this
        model's files for the read-back and remove temporary files of writes that were cut short."""
        found = scan(self.root, self.max_bytes, mine=self.ns if start else None)
        if start:
            self._preload = deque(found.mine)
        self.evicted += found.evicted
        self.bytes_on_disk = found.total


class _Salt:
    """A salt already in its repr (blocks written at shutdown from their recorded names)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def open_prompt_cache(batch, engine, directory: str | Path,
                      max_bytes: int = DEFAULT_MAX_BYTES) -> DiskPrefixCache | None:
    """Attach a disk cache under `directory` to a `BatchEngine`'s prefix cache (None when it has none)."""
    prefix = batch.sched.prefix
    if prefix is None:
        return None
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    disk = DiskPrefixCache(root, batch.kv, engine_identity(engine, batch.kv, root), max_bytes=max_bytes)
    prefix.disk = disk
    return disk
