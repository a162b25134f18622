"""Prefix caching: full KV blocks shared across requests by the content that produced them.

A block (one page per cache slot, `page_size` positions) is named by a hash chain: its tokens, the
name of the block before it, and a *salt* that says how the keys were computed. Two sequences whose
first b blocks have the same names hold the same keys and values in those blocks, so a new request
whose prompt starts with a cached prefix takes those blocks (reference-counted, read-only) and
prefills only the rest.

What the salt must hold (`BatchEngine` builds it):
  * the loops the sequence runs. The core slots of loop r do not depend on the total depth, and the
    prelude slots depend on nothing but the tokens, but the coda's slots are computed from the state
    after the *last* loop, so they differ between depths. A deeper request could reuse the prelude
    and its first loops' slots only if it also had the residual state at that loop for every cached
    position, which the cache does not keep. So a block is shared only between sequences of the same
    depth (and an adaptive-depth request's prompt, which runs its ceiling, shares with fixed depth);
  * the attention window (a windowed query sees other keys, so deeper layers' keys differ).
Not shared at all: the loop-shared KV budget (`kv_loops` < loops: a ring slot's content depends on how
the prompt was chunked). Within an adaptive-depth sequence only prompt blocks are shared: its generated
tokens may exit early, and their deeper slots hold copies (`PagedStep.fill_skipped`). The speculative
modes share prompt blocks among themselves (their layout adds a draft exit's slots, so the salt names
the draft depth too): drafts are written, and rolled back, only past the prompt.
The KV format, the weights and the state seed are the engine's own, the same for the whole pool.

Memory: a cached block costs nothing extra. When its last user lets go, its pages go back to the free
list *with their contents and names*; the free list is in release order, so allocation takes the least
recently released pages first, and taking a page drops the name of the block it belonged to (LRU
eviction under memory pressure, and no cached page is ever counted as used). A hit on a block whose
pages are free takes them back off the free list.

On disk (`disk`, an `engine.disk_cache.DiskPrefixCache`, `--prompt-cache-dir`): every block named here is
also written to a file, and `extend` reads the blocks past an in-memory hit back from their files into free
pages, so a restart starts warm.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any, Sequence as Seq


def block_name(parent: bytes | None, tokens: Seq[int], salt: Any) -> bytes:
    """The name of a block: its tokens after its parent's name (the first block: after the salt)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else repr(salt).encode())
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PrefixCache:
    """Names -> pages of full, computed blocks. Works on the scheduler's `PagePool` (no torch)."""

    def __init__(self, pool):
        self.pool = pool
        pool.on_reuse = self.forget_page
        self._blocks: dict[bytes, list[int]] = {}
        self._page_name: dict[int, bytes] = {}
        self.hit_tokens = 0            # prompt tokens admitted sequences found in the cache, so far
        self.disk = None               # engine.disk_cache.DiskPrefixCache: blocks kept in files too

    def __len__(self) -> int:
        return len(self._blocks)

    def peek(self, names: list[bytes]) -> list[list[int]]:
        """The cached blocks of the longest prefix of `names` (nothing is taken)."""
        out = []
        for name in names:
            pages = self._blocks.get(name)
            if pages is None:
                break
            out.append(pages)
        return out

    def take(self, blocks: list[list[int]]) -> None:
        """Hold `blocks` (from `peek`) for one more sequence: shared if in use, taken back if free."""
        for pages in blocks:
            self.pool.take(pages)

    def insert(self, name: bytes, pages: list[int]) -> bool:
        """Name a block that has just been filled; the first block of a name wins (True: this one is new)."""
        if name in self._blocks or any(p in self._page_name for p in pages):
            return False
        self._blocks[name] = list(pages)
        for p in pages:
            self._page_name[p] = name
        return True

    def extend(self, names: list[bytes], hit: list[list[int]], tokens: Seq[int], salt: Any,
               n_slots: int) -> list[list[int]]:
        """`hit` (from `peek`) and the blocks after it that the disk holds: block b of `names` (whose tokens
        are tokens[b*page_size:(b+1)*page_size]) read from its file into free pages and named here, in chain
        order up to the first one missing or bad (or no free pages left). The blocks read sit on the free
        list, as cached blocks do; `hit` is held meanwhile so reading cannot evict it."""
        disk = self.disk
        if disk is None or len(hit) >= len(names):
            return hit
        for blk in hit:
            self.pool.take(blk)
        got: list[list[int]] = []
        try:
            found = disk.present(names, len(hit), self.pool.num_free // n_slots)
            if found:
                pages = [self.pool.allocate(n_slots) for _ in found]
                good = disk.load(found, pages, names, tokens, salt, n_slots)
                for (b, _), pg in zip(found[:good], pages):
                    self.insert(names[b], pg)
                    got.append(pg)
                for pg in reversed(pages[good:]):   # (their contents are nothing: unnamed)
                    self.pool.free(pg)
        finally:
            for blk in reversed(hit + got):   # tail first: the free list is reused oldest first
                self.pool.free(blk)
        return hit + got

    def forget_page(self, page: int) -> None:
        """`page` is being reused (the pool gives it out again, or a sliding-window ring takes it over for a
        later block): the block it belonged to is gone."""
        name = self._page_name.pop(page, None)
        if name is None:
            return
        for p in self._blocks.pop(name, ()):
            self._page_name.pop(p, None)
