"""Continuous-batching scheduler: which sequences run in the next step, and with which KV pages.

No torch here: the scheduler decides, a runner (engine.batch) computes, and the serving loop
(engine.serving) samples and reports back. Tests drive it with fake runner outputs.

KV memory is a pool of fixed-size pages. A page holds `page_size` consecutive positions of one cache
slot (one prelude/coda layer, or one core layer at one loop), so a sequence served with `loops` loops
needs `n_slots(loops)` pages per `page_size` positions: a request at loops=2 takes less memory than one
at loops=16, and every free page fits every need, so churn cannot fragment the pool. A sequence's
pages are grouped per logical block: `block_table[b]` lists one page per slot for positions
b*page_size .. (b+1)*page_size - 1. Pages are reference-counted so that `n` > 1 siblings share their
prompt's full blocks; the partly filled last block is copied for each sibling (copy-on-fork).

Sliding-window slots keep their window, not the context (`ring_cols`, `ring_blocks` R): the columns of layers
that see only the last W keys take block b - R's pages over for block b (the same page ids again, one
reference each), so such a column holds at most R pages however long the sequence grows. R pages cover the
window, the longest chunk a step writes at once and a speculative round's rollback (`ring_blocks_for`): every
key a query can still see is intact, and the older entries a read may touch lie outside every window (the
masks drop them). A page is taken over only when this sequence alone holds it (a forked sibling's or another
sequence's shared page is not: a fresh one then); a block the prefix cache named loses its name when its
pages are taken over (the prompt cache on disk still holds it).

Each `schedule()` call:
  1. decode: every running sequence whose prompt is in the cache gets its one next token, oldest first;
     if its next position needs a new block and the pool is empty, the newest running sequence is
     preempted (its pages freed; it goes back to the front of the queue and is recomputed, prompt and
     generated tokens, when memory frees up);
  2. chunked prefill: prompts not yet fully in the cache get chunks, oldest first, within the step's
     token budget (`max_batched_tokens`);
  3. admission: waiting sequences join, in arrival order (FIFO: a request never overtakes an older
     one), while `max_num_seqs`, the token budget and free pages allow.

Prefix caching (`prefix_caching=True`): at admission a sequence takes the cached blocks its prompt
starts with and prefills only the rest; each block it fills is named for later requests
(`engine.prefix_cache` says what is shared and when).

"External" sequences (speculative modes, whose passes the serving loop builds itself: drafts,
verifications, rollbacks) are admitted under the same FIFO, `max_num_seqs` and memory rules. They get
every block they can reach (`reserve_positions`) at admission, hold it until they finish, and are never
preempted; their rows still run inside the batched step.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .prefix_cache import PrefixCache, block_name

FORCED_TAIL = 16   # tokens a grammar may force after a pick that go in with the next decode chunk (`forced_tail`)
RING_SLACK = 72    # positions past the window a speculative round may write, then roll back (64 drafted, + 8)


def ring_blocks_for(window: int, page_size: int, longest_write: int) -> int:
    """Blocks a sliding-window column keeps: its window, the most positions one step writes at once
    (`longest_write`) and a speculative round's rollback, rounded up, and the block being written."""
    return -(-(window + longest_write + RING_SLACK) // page_size) + 1


class SchedulerError(RuntimeError):
    pass


class PagePool:
    """Fixed-size pages with reference counts. Allocation is O(n) in pages taken; there is no layout.

    The free list is kept in release order and allocation takes its oldest pages first: a freed page
    keeps its contents until it is taken again, which the prefix cache (`engine.prefix_cache`) relies
    on (`on_reuse` tells it a page is being reused; `take` gets a still-intact free page back)."""

    def __init__(self, n_pages: int):
        if n_pages < 1:
            raise SchedulerError("the KV pool needs at least one page")
        self.n_pages = n_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n_pages))
        self._refs = [0] * n_pages
        self.on_reuse: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise SchedulerError(f"asked for {n} pages, {len(self._free)} free")
        out = [self._free.popitem(last=False)[0] for _ in range(n)]
        for p in out:
            self._refs[p] = 1
            if self.on_reuse is not None:
                self.on_reuse(p)
        return out

    def take(self, pages: list[int]) -> None:
        """One more reference to each page: shared if in use, taken back off the free list if not."""
        for p in pages:
            if self._refs[p] == 0:
                del self._free[p]
            self._refs[p] += 1

    def share(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise SchedulerError(f"page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise SchedulerError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free[p] = None

    def refcount(self, page: int) -> int:
        return self._refs[page]


WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Sequence:
    """One output sequence. `tokens` = prompt + generated; `n_cached` of them have KV in the pool."""

    seq_id: int
    prompt: list[int]
    max_tokens: int
    n_slots: int                       # cache slots at this sequence's loop count
    loops: int = 1                     # the runner batches rows by loops (deepest first)
    window: int = 0                    # attention window (0: the whole context)
    reserve_positions: int = 0         # > 0: external (speculative): all blocks for these positions at admission
    n: int = 1                         # siblings to fork from this one once its prompt is cached
    tokens: list[int] = field(default_factory=list)
    n_cached: int = 0
    status: str = WAITING
    block_table: list[list[int]] = field(default_factory=list)
    arrival: int = 0
    finish_reason: str | None = None
    preemptions: int = 0
    parent: "Sequence | None" = None   # set on forked siblings
    exit_rule: Any = None              # adaptive depth: generated tokens may exit before `loops`
    slot_cols: list[int] | None = None  # loop-shared KV: the table column of each per-loop slot
    ring_cols: tuple[int, ...] = ()     # sliding-window columns: block b takes block b - ring_blocks's pages
    ring_blocks: int = 0
    # prefix caching (engine.prefix_cache): None -> this sequence neither reads nor names cached blocks
    prefix_salt: Any = None
    prefix_reads: bool = True           # False: name its blocks, never read them (prompt scoring)
    prefix_upto: int | None = None      # name blocks only below this position (None: every full block)
    prefix_names: list[bytes] = field(default_factory=list)   # names of its full blocks so far
    n_named: int = 0                    # blocks of block_table offered to the cache
    prompt_cached: int = 0              # prompt tokens read from the cache (the admission that prefilled it)
    cache_save: str | None = None       # a saved conversation's name: its prompt's blocks kept on disk (`_save`)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def external(self) -> bool:
        return self.reserve_positions > 0

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def prefilling(self) -> bool:
        """True while tokens other than the last sampled one still lack KV (prompt, or recompute), short of a
        forced tail."""
        return self.n_cached < len(self.tokens) - (1 if self.n_generated else 0) and not self.forced_tail

    @property
    def forced_tail(self) -> bool:
        """Output tokens past the last computed one, at most FORCED_TAIL, after a computed prompt: the tokens a
        grammar forced after a pick (engine/fast_steps.py `_take_forced`). They go in with the last token as its
        decode chunk, one row each, the logits of the last."""
        return self.n_generated > 0 and len(self.prompt) <= self.n_cached and \
            0 < len(self.tokens) - 1 - self.n_cached <= FORCED_TAIL


@dataclass
class ScheduledChunk:
    """Tokens `seq.tokens[start:start+n]` go through the model at positions start.. this step."""

    seq: Sequence
    start: int
    n: int
    needs_logits: bool             # the chunk ends at the sequence's last token: sample from its logits

    @property
    def token_ids(self) -> list[int]:
        return self.seq.tokens[self.start:self.start + self.n]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)   # (src page, dst page), before the step
    forks: list[tuple[Sequence, list[Sequence]]] = field(default_factory=list)  # parent, new siblings
    admitted_external: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.n for c in self.chunks)


class Scheduler:
    def __init__(self, *, n_pages: int, page_size: int = 16, max_num_seqs: int = 32,
                 max_batched_tokens: int = 512, prefix_caching: bool = False):
        if page_size < 1 or max_num_seqs < 1 or max_batched_tokens < 1:
            raise SchedulerError("page_size, max_num_seqs and max_batched_tokens must be >= 1")
        self.pool = PagePool(n_pages)
        self.prefix = PrefixCache(self.pool) if prefix_caching else None
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # in admission order (oldest first)
        self._arrivals = itertools.count()
        self._ids = itertools.count(1)

    # -- sizing -----------------------------------------------------------------------------
    def blocks_for(self, n_positions: int) -> int:
        return -(-n_positions // self.page_size)

    def max_pages(self, seq: Sequence) -> int:
        """Pages the sequence holds at its longest (prompt + max_tokens), siblings not counted."""
        n = seq.reserve_positions if seq.external else len(seq.prompt) + seq.max_tokens
        return self.block_pages(seq, 0, self.blocks_for(n))

    @staticmethod
    def block_pages(seq: Sequence, first: int, end: int) -> int:
        """Fresh pages blocks first .. end - 1 of `seq` take (a sliding-window column's none past its ring)."""
        n = max(0, end - first) * seq.n_slots
        if seq.ring_cols and seq.ring_blocks > 0:
            n -= max(0, end - max(first, seq.ring_blocks)) * len(seq.ring_cols)
        return n

    def fits_ever(self, seq: Sequence) -> bool:
        return self.max_pages(seq) * (1 if seq.external else max(1, seq.n)) <= self.pool.n_pages

    # -- requests in and out ----------------------------------------------------------------
    def new_seq_id(self) -> int:
        return next(self._ids)

    def add(self, seq: Sequence) -> None:
        if not self.fits_ever(seq):
            raise SchedulerError(f"the request needs {self.max_pages(seq) * max(1, seq.n)} KV pages at its "
                                 f"longest; the pool has {self.pool.n_pages}")
        seq.arrival = next(self._arrivals)
        seq.status = WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Done (length, stop, abort, error): free its pages now. Idempotent."""
        if seq.status == FINISHED:
            return
        if seq.cache_save and reason not in ("abort", "error"):
            self._save(seq)
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = FINISHED
        seq.finish_reason = reason

    def append_token(self, seq: Sequence, token: int) -> None:
        """The serving loop sampled `token` for `seq` (its last token's KV is now in the cache)."""
        seq.tokens.append(token)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batched_tokens
        # 1. decode, oldest first; make room by preempting the newest when the pool is dry
        for seq in list(self.running):
            if seq.status != RUNNING or seq.external or seq.prefilling:
                continue
            pos = len(seq.tokens) - 1              # the last sampled token goes in at its position
            start = seq.n_cached if seq.forced_tail else pos   # (after the tokens a grammar forced)
            if budget < pos + 1 - start:
                break
            if not self._ensure_blocks(seq, pos + 1, out):
                continue                           # seq itself was preempted
            out.chunks.append(ScheduledChunk(seq, start, pos + 1 - start, True))
            budget -= pos + 1 - start
        # 2. chunked prefill of running sequences, oldest first
        for seq in list(self.running):
            if budget < 1:
                break
            if seq.status != RUNNING or seq.external or not seq.prefilling:
                continue
            budget -= self._schedule_prefill(seq, budget, out)
        # 3. admission, FIFO
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.external:
                hit = self._cached_prefix(seq, len(seq.prompt))
                reclaimed = sum(len(b) for b in hit if self.pool.refcount(b[0]) == 0)
                end = self.blocks_for(seq.reserve_positions)
                if self.pool.num_free < self.block_pages(seq, len(hit), end) + reclaimed:
                    break
                self.waiting.popleft()
                self._take_prefix(seq, hit)
                if not self._grow(seq, end):   # a ring page it shares: fresh pages after all, and too few
                    self._release(seq)
                    seq.n_cached = seq.n_named = 0
                    self.waiting.appendleft(seq)
                    break
                seq.status = RUNNING
                self.running.append(seq)
                out.admitted_external.append(seq)
                continue
            if budget < 1:
                break
            target = len(seq.tokens) - (1 if seq.n_generated else 0)
            hit = self._cached_prefix(seq, target)
            hit_pos = len(hit) * self.page_size
            first = min(budget, target - hit_pos)
            # admit only when the first chunk's pages and one block of headroom for decode exist (never
            # more than the sequence can ever hold: a pool exactly that big must still admit it); cached
            # blocks that sit on the free list count as pages taken
            blocks = min(self.blocks_for(hit_pos + first) + 1, self.blocks_for(len(seq.prompt) + seq.max_tokens))
            reclaimed = sum(len(b) for b in hit if self.pool.refcount(b[0]) == 0)
            if self.pool.num_free < self.block_pages(seq, len(hit), blocks) + reclaimed:
                break
            self.waiting.popleft()
            seq.status = RUNNING
            self.running.append(seq)
            self._take_prefix(seq, hit)
            budget -= self._schedule_prefill(seq, budget, out)
        return out

    def complete(self, chunk: ScheduledChunk) -> list[Sequence]:
        """After the runner ran `chunk`: record its KV; fork siblings when a parent's prompt is cached.

        Returns the sequences that sample from this chunk's logits (the sequence and any new siblings)."""
        seq = chunk.seq
        seq.n_cached = max(seq.n_cached, chunk.start + chunk.n)
        if self.prefix is not None and seq.prefix_salt is not None:
            self._name_blocks(seq)
        if not chunk.needs_logits:
            return []
        group = [seq]
        if seq.n > 1 and seq.n_generated == 0:
            group += self._fork(seq)
        return group

    # -- internals --------------------------------------------------------------------------
    def _names(self, seq: Sequence, n_blocks: int) -> list[bytes]:
        """The names of `seq`'s first n_blocks full blocks (computed once each, as tokens arrive)."""
        names, ps = seq.prefix_names, self.page_size
        while len(names) < n_blocks:
            b = len(names)
            names.append(block_name(names[-1] if names else None, seq.tokens[b * ps:(b + 1) * ps], seq.prefix_salt))
        return names[:n_blocks]

    def _cached_prefix(self, seq: Sequence, target: int) -> list[list[int]]:
        """The cached blocks a sequence about to be admitted can start from: full blocks only, and at least
        one of its `target` tokens left to compute (the one whose logits it samples from)."""
        if self.prefix is None or seq.prefix_salt is None or not seq.prefix_reads or seq.block_table:
            return []
        n = (target - 1) // self.page_size
        if seq.prefix_upto is not None:
            n = min(n, seq.prefix_upto // self.page_size)
        if n <= 0:
            return []
        names = self._names(seq, n)
        hit = self.prefix.peek(names)
        if len(hit) < n and self.prefix.disk is not None:   # the rest from the prompt cache on disk
            hit = self.prefix.extend(names, hit, seq.tokens, seq.prefix_salt, seq.n_slots)
        return hit

    def _take_prefix(self, seq: Sequence, hit: list[list[int]]) -> None:
        """Admission: `seq` starts from the cached blocks `hit` (from `_cached_prefix`)."""
        cached = len(hit) * self.page_size
        if seq.n_generated == 0:
            seq.prompt_cached = cached
        if hit:
            self.prefix.take(hit)
            self.prefix.hit_tokens += cached
            if self.prefix.disk is not None:   # their files are now the most recently used
                self.prefix.disk.touch(seq.prefix_names[:len(hit)])
            seq.block_table = [list(b) for b in hit]
            seq.n_cached, seq.n_named = cached, len(hit)

    def _save(self, seq: Sequence) -> None:
        """A saved conversation's sequence ends: its prompt's full, named blocks go to the prompt cache on disk
        with a manifest naming them (`engine.disk_cache`; POST /v1/cache/save)."""
        disk = self.prefix.disk if self.prefix is not None else None
        if disk is None or seq.prefix_salt is None:
            return
        ps = self.page_size
        full = min(len(seq.prompt) // ps, seq.n_named, len(seq.block_table), seq.n_cached // ps)
        names = self._names(seq, full)
        blocks = [(names[b], b, names[b - 1] if b else None, seq.tokens[b * ps:(b + 1) * ps], seq.prefix_salt,
                   seq.block_table[b]) for b in range(full)]
        disk.save_manifest(seq.cache_save, blocks, tokens=list(seq.prompt),
                           info={"loops": seq.loops, "window": seq.window, "salt": repr(seq.prefix_salt)})

    def prompt_computed(self, seq: Sequence) -> None:
        """An external sequence's prompt is in the cache (its runner says so): name its full blocks."""
        seq.n_cached = max(seq.n_cached, len(seq.prompt))
        if self.prefix is not None and seq.prefix_salt is not None:
            self._name_blocks(seq)

    def _name_blocks(self, seq: Sequence) -> None:
        """Offer the cache each block of `seq` that is now full and computed."""
        full = seq.n_cached // self.page_size
        if seq.prefix_upto is not None:
            full = min(full, seq.prefix_upto // self.page_size)
        full = min(full, len(seq.block_table))
        if full <= seq.n_named:
            return
        names = self._names(seq, full)
        disk, ps, new = self.prefix.disk, self.page_size, []
        for b in range(seq.n_named, full):
            if self.prefix.insert(names[b], seq.block_table[b]) and disk is not None:
                new.append((names[b], b, names[b - 1] if b else None, seq.tokens[b * ps:(b + 1) * ps],
                            seq.prefix_salt, seq.block_table[b]))
        seq.n_named = full
        if new:   # the prompt cache on disk writes them (off this thread)
            disk.named(new)

    def _schedule_prefill(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule the next prefill chunk of `seq`; returns the tokens it takes from the budget.

        A new sequence prefills its prompt and samples from the last chunk's logits. A recomputed one
        (after preemption) prefills everything but its last sampled token, which then goes in as a
        normal decode step."""
        target = len(seq.tokens) - (1 if seq.n_generated else 0)
        start = seq.n_cached
        n = min(budget, target - start)
        if n <= 0:
            return 0
        if not self._ensure_blocks(seq, start + n, out):
            return 0
        needs_logits = seq.n_generated == 0 and start + n == target
        out.chunks.append(ScheduledChunk(seq, start, n, needs_logits))
        return n

    def reserve(self, seq: Sequence, n_positions: int) -> bool:
        """Blocks for n_positions of a running sequence from free pages only (no preemption, no copy): False,
        and nothing taken, where they are not all free."""
        end, had = self.blocks_for(n_positions), len(seq.block_table)
        if end <= had:
            return True
        if self.pool.num_free < self.block_pages(seq, had, end) or not self._grow(seq, end):
            self._shrink(seq, had)
            return False
        return True

    def _ensure_blocks(self, seq: Sequence, n_positions: int, out: SchedulerOutput) -> bool:
        """Give `seq` blocks for n_positions, preempting newer sequences if needed. False if `seq` itself
        had to go (it was the newest running sequence)."""
        end = self.blocks_for(n_positions)
        while len(seq.block_table) < end:
            if not self._grow(seq, len(seq.block_table) + 1) and not self._preempt_newest(seq, out):
                return False
        return self._unshare_last(seq, out)

    def _grow(self, seq: Sequence, end: int) -> bool:
        """Blocks up to `end` for `seq` from free pages, a block at a time; False where the pool runs dry
        (the blocks taken so far stay)."""
        while len(seq.block_table) < end:
            b = len(seq.block_table)
            kept = self._ring_pages(seq, b)
            if self.pool.num_free < seq.n_slots - len(kept):
                return False
            fresh = iter(self.pool.allocate(seq.n_slots - len(kept)))
            if kept:
                self.pool.share(list(kept.values()))
                if self.prefix is not None:   # the block they held is gone from the cache
                    for page in kept.values():
                        self.prefix.forget_page(page)
            seq.block_table.append([kept[s] if s in kept else next(fresh) for s in range(seq.n_slots)])
        return True

    def _shrink(self, seq: Sequence, n_blocks: int) -> None:
        while len(seq.block_table) > n_blocks:
            self.pool.free(seq.block_table.pop())

    def _ring_pages(self, seq: Sequence, b: int) -> dict[int, int]:
        """Block b's sliding-window columns' pages taken over from block b - R: those this sequence alone holds."""
        R = seq.ring_blocks
        if not seq.ring_cols or R <= 0 or b < R:
            return {}
        return {s: seq.block_table[b - R][s] for s in seq.ring_cols if self._alone(seq, b - R, s)}

    def _alone(self, seq: Sequence, b: int, s: int) -> bool:
        """Whether the page of block b, column s is held by `seq` alone: once for each of its blocks that
        hold it (in a sliding-window column, blocks b - R, b - 2R, ... may hold it too)."""
        page, n = seq.block_table[b][s], 1
        if seq.ring_blocks > 0 and s in seq.ring_cols:
            x = b - seq.ring_blocks
            while x >= 0 and seq.block_table[x][s] == page:
                n, x = n + 1, x - seq.ring_blocks
        return self.pool.refcount(page) == n

    def _unshare_last(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Copy-on-write: a block still shared with a sibling is copied before this sequence writes into it."""
        if not seq.block_table:
            return True
        last, b = seq.block_table[-1], len(seq.block_table) - 1
        if all(self._alone(seq, b, s) for s in range(len(last))):
            return True
        while self.pool.num_free < len(last):
            if not self._preempt_newest(seq, out):
                return False
        fresh = self.pool.allocate(len(last))
        out.copies += list(zip(last, fresh))
        self.pool.free(last)
        seq.block_table[-1] = fresh
        return True

    def _preempt_newest(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Free memory for `seq` by preempting the newest running sequence; False if that is `seq` itself
        (then `seq` is the one preempted)."""
        victim = next((q for q in reversed(self.running) if not q.external), None)
        if victim is None or victim is seq:
            self._preempt(seq, out)
            return False
        self._preempt(victim, out)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free `seq`'s pages and put it back at the head of the queue; it will be recomputed."""
        self.running.remove(seq)
        self._release(seq)
        seq.n_cached = seq.n_named = 0
        seq.status = WAITING
        seq.preemptions += 1
        out.chunks = [c for c in out.chunks if c.seq is not seq]
        out.preempted.append(seq)
        # back in front of every sequence that arrived after it
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival < seq.arrival:
            i += 1
        self.waiting.insert(i, seq)

    def _release(self, seq: Sequence) -> None:
        # last block first: the free list is reused oldest first, so a prefix's tail is evicted before its head
        for blk in reversed(seq.block_table):
            self.pool.free(blk)
        seq.block_table = []

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n - 1 siblings sharing the parent's cached prompt (full blocks shared, the last one copied on write)."""
        kids = []
        for _ in range(parent.n - 1):
            kid = Sequence(self.new_seq_id(), parent.prompt, parent.max_tokens, parent.n_slots,
                           loops=parent.loops, window=parent.window, tokens=list(parent.tokens), n_cached=parent.n_cached,
                           exit_rule=parent.exit_rule, slot_cols=parent.slot_cols, ring_cols=parent.ring_cols,
                           ring_blocks=parent.ring_blocks,
                           prefix_salt=parent.prefix_salt, prefix_reads=parent.prefix_reads,
                           prefix_upto=parent.prefix_upto, prefix_names=list(parent.prefix_names),
                           n_named=parent.n_named, prompt_cached=parent.prompt_cached,
                           status=RUNNING, arrival=parent.arrival, parent=parent)
            for blk in parent.block_table:
                self.pool.share(blk)
            kid.block_table = [list(b) for b in parent.block_table]
            kids.append(kid)
        parent.n = 1
        idx = self.running.index(parent)
        self.running[idx + 1:idx + 1] = kids
        return kids
