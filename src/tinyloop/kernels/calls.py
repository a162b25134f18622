"""Native calls that run a whole piece of one request (`NativeExecutor` inherits them): a greedy or sampled
chain-speculation round, several back to back, or a pipeline of depth-aligned passes (`spec_round`,
`tl_spec_round` / `tl_spec_pipeline`); a tree round (`tree_round`, `tl_tree_round`); a lone request's plain
steps (`generate`, `tl_generate`); and the LM head's cost by rows that a round's verification weighs its head
calls by (`head_costs`). engine/native_rounds.py drives them; docs/speculative.md and docs/decode.md say what
each runs."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import time

import torch
import torch.nn as nn

from . import lib as L
from .build import _cpu_flags, cache_dir
from .layers import _CALL, _forward, _vec, linear_desc, tensor_desc


_COSTS_FILE = "head_costs.json"
_ROUNDS_FILE = "round_costs.json"


@functools.cache
def cpu_id() -> str:
    """A short digest of this CPU's feature flags (what the library's own cache key hashes)."""
    return hashlib.sha256(_cpu_flags().encode()).hexdigest()[:12]


def _stored(name: str, key: str):
    """The entry `key` of the table `name` in the library's cache directory (what a process on this host kept),
    or None."""
    try:
        table = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return None
    return table.get(key) if isinstance(table, dict) else None


def _store(name: str, key: str, value) -> None:
    """Keep `value` as the entry `key` of the table `name` for later processes (the table written whole and
    renamed: a reader sees the old table or the new one; an unwritable cache keeps nothing)."""
    path = cache_dir() / name
    try:
        table = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    table[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def stored_head_costs(key: str) -> list[float] | None:
    """The head costs a process on this host measured for `key` (`RequestCalls.head_costs`), or None."""
    costs = _stored(_COSTS_FILE, key)
    if not isinstance(costs, list) or not costs or not all(isinstance(c, (int, float)) and c > 0 for c in costs):
        return None
    return [float(c) for c in costs]


def store_head_costs(key: str, costs: list[float]) -> None:
    """Keep `costs` for later processes."""
    _store(_COSTS_FILE, key, [round(c, 4) for c in costs])


class RequestCalls:
    """The calls above, as methods of the executor (they read its descriptors, scratch, rope and KV helpers)."""

    def head_costs(self, rows: int = 9) -> list[float]:
        """Milliseconds of the LM head (`tl_linear_forward` over the model's head) at 1..rows input rows on
        this host, measured once: what a chain round's lazy verification weighs its calls by
        (draft_policy.head_chunk). Measured at 1..5 rows (what rounds of up to 4 drafts choose among; the row
        tiles make those costs uneven) and at the most rows, the best of two passes after one warm-up call, the
        counts between interpolated linearly: 13 calls where every count at best of 3 took 36 (~18 ms of a first
        speculative request on the shipped model, more than its drafting saved over 64 tokens). Kept beside the
        library (`head_costs.json` in its cache directory, by build, threads, head and CPU), so a later process
        (each `tinyloop generate` is one) reads them instead of measuring again. A streamed model's head is read
        from memory whatever the rows (and timing it would cost its first request seconds): flat, so one call
        scores every row."""
        if self.streamed:
            return [1.0] * rows
        if len(self._head_costs) < rows:
            stored = stored_head_costs(self._head_key())
            if stored is not None and len(stored) >= rows:
                self._head_costs = stored
        if len(self._head_costs) < rows:
            most = max(rows, 9)   # (up to draft_ahead 8 at once: a longer draft re-measures)
            x = torch.randn(most, self.model.cfg.dim, generator=torch.Generator().manual_seed(0))
            _forward(self.head, x, self.threads)   # (warm-up: every row's buffers and the weights touched)
            counts = sorted({*range(1, min(5, most) + 1), most})
            measured = dict.fromkeys(counts, float("inf"))
            for _ in range(2):   # two passes over the counts: the host warms up over the first (~2x on a row)
                for m in counts:
                    t0 = time.perf_counter()
                    _forward(self.head, x[:m], self.threads)
                    measured[m] = min(measured[m], (time.perf_counter() - t0) * 1000)
            lo = max(m for m in counts if m < most)
            self._head_costs = [measured[m] if m in measured else
                                measured[lo] + (measured[most] - measured[lo]) * (m - lo) / (most - lo)
                                for m in range(1, most + 1)]
            store_head_costs(self._head_key(), self._head_costs)
        return self._head_costs[:rows]

    def kept_round_costs(self, setting: str) -> dict | None:
        """What an earlier process on this host kept of this model's round costs for one speculation setting
        (engine/draft_policy.py `RoundCosts.kept`), or None."""
        got = _stored(_ROUNDS_FILE, f"{self._model_key()}|{setting}")
        return got if isinstance(got, dict) else None

    def keep_round_costs(self, setting: str, value: dict) -> None:
        """Keep this model's round costs for one setting for later processes (`tinyloop generate` is one a request)."""
        _store(_ROUNDS_FILE, f"{self._model_key()}|{setting}", value)

    def _model_key(self) -> str:
        """What a round's cost depends on: the build, threads and CPU, and the model's shapes and formats (its
        config, and each weight's name, dtype and shape: int4, int8 and 16-bit files of one config apart)."""
        if self._model_digest is None:
            m = self.model
            parts = [repr(m.cfg)] + [f"{k}:{v.dtype}:{tuple(v.shape)}" for k, v in m.state_dict().items()]
            self._model_digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
        return f"{self.isa}|{self.threads}t|{cpu_id()}|{self._model_digest}"

    def _head_key(self) -> str:
        """What the head's cost by rows depends on: the build, threads, the head's format and shape, the CPU."""
        h = self.head
        return (f"{self.isa}|{self.threads}t|kind {h.kind} {h.n}x{h.k} g{h.group} q8 {h.act_q8} "
                f"packed {int(bool(h.packed))}{h.packed_f32} min {int(bool(h.mins))}|{cpu_id()}")

    def _head_fields(self, S) -> None:
        """A round's verifier (tl_round / tl_tree): the model's head, the norm before it, the vocabulary."""
        S.head = ctypes.pointer(self.head)
        S.head_norm, S.head_eps, S.vocab = self.head_norm, self.head_eps, self.model.cfg.vocab_size

    def spec_round(self, kv, table: torch.Tensor, window: int, pending: int, pos: int, k: int, d: int, V: int,
                   draft_readout, draft_weight: torch.Tensor | None, draft_ids: torch.Tensor | None,
                   draft_norm: nn.Module | None, backlog: torch.Tensor | None, want_state: bool = True,
                   pipeline: bool = False, noise: tuple | None = None, ahead: int = 0,
                   head_rows: int = 2, rounds: int = 1, stop: list[int] | tuple = ()) -> dict:
        """One greedy chain-speculation round in one call (`tl_spec_round`): k drafts from `pending` at `pos`
        (read out by `draft_readout`: "coda" or a draft exit's (exit, slots); scored by `draft_weight`'s
        rows after `draft_norm`, column j being token `draft_ids[j]`; `draft_weight` None: by the model's
        head as loaded, the whole vocabulary), the last draft's loops 0..d-1, the
        verification of the k + 1 positions (loops d..V-1, the coda) and the head's argmax after each.
        `backlog`: the loop-d state of position pos-1 whose draft-exit entry is still due (or None);
        `want_state`: whether the last position's loop-d state is needed (a draft exit's backlog).
        Returns the tokens (pending + drafts), the verifier's tokens, the last position's loop-d state and
        the two phases' milliseconds. `head_rows`: verification rows per head call (lazily, up to the first
        disagreement; draft_policy.head_chunk). `rounds` > 1 (a chain, k >= 1): that many rounds back to back,
        each from where the last ended, the call ending early after a round whose output holds a token of
        `stop`; "outs" then holds each round's output (and "last_h" the last round's state). `pipeline` (k >= 1):
        the same round as depth-aligned passes
        (`tl_spec_pipeline`): "emitted" holds the round's output tokens, every exit entry is written; `ahead`
        (> 0) bounds its drafts in flight at once (k bounds those of the call).
        `noise` (seed, n0, 1 / T, top_k, top_p): a sampled round, every token drawn under the noise of its output index
        (n0 for the token after `pending`; engine/sampling.py)."""
        with _CALL:
            keep, readouts = [], {}
            t = _int64(table)
            ro = self._readout(draft_readout, readouts, keep)
            self._set_readouts(readouts)
            multi = rounds > 1 and k > 0 and not pipeline
            max_pos = pos + (rounds * (k + 1) if multi else k)
            if max_pos >= self.desc.rope_len:
                self._rope(max_pos + 1)
            base = L.TlRow()
            base.token, base.pos, base.window, base.readout = pending, pos, window, 0
            base.table, base.stride, base.n_blocks = t.data_ptr(), t.shape[1], t.shape[0]
            R = L.TlRound()
            if multi:
                outs = torch.zeros(rounds * (k + 1), dtype=torch.int32)
                out_n = torch.zeros(rounds, dtype=torch.int32)
                stops = torch.tensor(list(stop) or [-1], dtype=torch.int32)
                keep += [outs, out_n, stops]
                R.rounds, R.out, R.out_n = rounds, outs.data_ptr(), out_n.data_ptr()
                R.stop, R.n_stop = stops.data_ptr(), len(stop)
            R.k, R.d, R.V, R.draft_readout, R.ahead, R.head_rows = k, d, V, ro, ahead, head_rows
            R.top_p = 1.0
            if noise is not None:
                R.seed, R.n0, R.inv_temp, R.top_k, R.top_p = noise
            if k > 0:
                _draft_fields(R, draft_weight, draft_ids, draft_norm, keep)
            if backlog is not None:
                b = backlog.reshape(-1).float().contiguous()
                keep.append(b)
                R.backlog_h = b.data_ptr()
            self._head_fields(R)
            toks = torch.zeros(k + 1, dtype=torch.int32)
            ver = torch.zeros(k + 1, dtype=torch.int32)
            last_h = torch.empty(self.model.cfg.dim, dtype=torch.float32)
            R.tokens, R.verify = toks.data_ptr(), ver.data_ptr()
            R.last_h = last_h.data_ptr() if want_state else None
            kvd = self._kv_desc(kv)
            pipeline = pipeline and k > 0
            scratch_floats = self.lib.tl_pipeline_scratch_floats if pipeline else self.lib.tl_round_scratch_floats
            self._grow_scratch(scratch_floats(self.desc, R, max_pos + 1))
            self.lib.tl_set_threads(self.threads)
            run = self.lib.tl_spec_pipeline if pipeline else self.lib.tl_spec_round
            rc = run(self.desc, kvd, base, R, self.scratch.data_ptr(), self.scratch.numel())
            if rc != 0:
                raise RuntimeError(f"native speculation round failed (code {rc})")
            if pipeline:
                self.model.core_loop_tokens += R.row_loops
                return {"emitted": ver[:R.n_emitted].tolist(), "draft_ms": R.draft_ms, "verify_ms": R.verify_ms}
            # loops run: k + 1 draft passes of d loops, k + 1 verification rows of V - d (as the stepwise path counts)
            self.model.core_loop_tokens += (k + 1) * V * (R.n_rounds if multi else 1)
            act = self.model.act_dtype or self.model.embed.weight.dtype
            if multi:
                lens, flat = out_n[:R.n_rounds].tolist(), outs.tolist()
                starts = [sum(lens[:i]) for i in range(len(lens))]
                return {"outs": [flat[s:s + n] for s, n in zip(starts, lens)],
                        "last_h": last_h if act == torch.float32 else last_h.to(act),
                        "draft_ms": R.draft_ms, "verify_ms": R.verify_ms}
            return {"tokens": toks.tolist(), "verify": ver.tolist(),
                    "last_h": last_h if act == torch.float32 else last_h.to(act),
                    "draft_ms": R.draft_ms, "verify_ms": R.verify_ms}

    def tree_round(self, kv, table: torch.Tensor, window: int, pending: int, pos: int, depth: int, K: int, d: int,
                   V: int, draft_readout, last_readout, draft_weight: torch.Tensor | None,
                   draft_ids: torch.Tensor | None, draft_norm: nn.Module | None, noise: tuple | None = None,
                   head_rows: int = 2) -> dict:
        """One tree-speculation round in one call (`tl_tree_round`, K > 1): a beam of K drafted `depth` levels
        deep from `pending` at `pos` (node i stored at pos + i), the tree-masked verification and the walk.
        `draft_readout` / `last_readout`: the read-out of the draft passes and of the last one (None, or a
        draft exit's (exit, slots)); the draft head, `noise` (sampled rounds) and `head_rows` as in `spec_round`.
        Returns
        the nodes' tokens and parents, the emitted tokens, the accepted path's nodes, how many nodes the
        verification ran (lazily: the chains the walk needed) and the two phases' ms."""
        with _CALL:
            keep, readouts = [], {}
            t = _int64(table)
            ro = self._readout(draft_readout, readouts, keep)
            ro_last = self._readout(last_readout, readouts, keep)
            self._set_readouts(readouts)
            n = 1 + K * depth
            if pos + n > self.desc.rope_len:
                self._rope(pos + n)
            base = L.TlRow()
            base.token, base.pos, base.window, base.readout = pending, pos, window, 0
            base.table, base.stride, base.n_blocks = t.data_ptr(), t.shape[1], t.shape[0]
            T = L.TlTree()
            T.depth, T.K, T.d, T.V, T.draft_readout, T.last_readout = depth, K, d, V, ro, ro_last
            T.head_rows = head_rows
            _draft_fields(T, draft_weight, draft_ids, draft_norm, keep)
            self._head_fields(T)
            if noise is not None:
                T.seed, T.n0, T.inv_temp, T.top_k, T.top_p = noise
            toks, parents = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
            emitted, path = torch.zeros(depth + 1, dtype=torch.int32), torch.zeros(depth + 1, dtype=torch.int32)
            T.tokens, T.parents, T.emitted, T.path = (x.data_ptr() for x in (toks, parents, emitted, path))
            kvd = self._kv_desc(kv)
            self._grow_scratch(self.lib.tl_tree_scratch_floats(self.desc, T, pos + 1))
            self.lib.tl_set_threads(self.threads)
            rc = self.lib.tl_tree_round(self.desc, kvd, base, T, self.scratch.data_ptr(), self.scratch.numel())
            if rc != 0:
                raise RuntimeError(f"native tree round failed (code {rc})")
            # every node's d draft loops; V - d verification loops of the nodes the walk needed
            self.model.core_loop_tokens += T.n_nodes * d + T.n_verified * (V - d)
            ne = T.n_emitted
            return {"tokens": toks.tolist(), "parents": parents.tolist(), "emitted": emitted[:ne].tolist(),
                    "path": path[:ne].tolist(), "verified": T.n_verified, "draft_ms": T.draft_ms,
                    "verify_ms": T.verify_ms}

    def generate(self, kv, table: torch.Tensor, window: int, token: int, pos: int, loops: int, exit_rule,
                 steps: int, noise: tuple | None, stop: list[int], grammar=None) -> tuple[list[int], list[int]]:
        """`steps` plain tokens of one sequence in one call (`tl_generate`): `token` at `pos` decoded (its
        `loops`, or its exit rule's), the head's argmax or draw the next token, and so on, ending after a token
        in `stop`. `noise` (seed, n0, 1 / T, top_k, top_p): the draw of output index n0 + s at step s (None:
        greedy). `grammar` (the address of a bitmask holding the first position's mask, callback): each pick is
        over the tokens the bitmask allows; callback(token, room) after each pick returns once the grammar has
        taken the token and the bitmask holds the next position's (`tl_gen`): the tokens the grammar forces
        after it (at most `room`, taken by the grammar too; outputs of the call, their rows run in one pass), or
        None to end the call. Returns the tokens and the core loops each step ran."""
        with _CALL:
            keep: list = []
            t = _int64(table)
            if pos + steps >= self.desc.rope_len:
                self._rope(pos + steps + 1)
            if exit_rule is not None and exit_rule.criterion == "gate":
                self._gate()
            self._set_readouts({})
            base = L.TlRow()
            base.token, base.pos, base.loops, base.window, base.readout = token, pos, loops, window, 0
            base.table, base.stride, base.n_blocks = t.data_ptr(), t.shape[1], t.shape[0]
            if exit_rule is not None:
                base.exit_kind, base.min_loops = L.TL_EXIT[exit_rule.criterion], exit_rule.min_loops
                base.threshold, base.survival = exit_rule.threshold, 1.0
            G = L.TlGen()
            G.steps, G.head = steps, ctypes.pointer(self.head)
            G.head_norm, G.head_eps, G.vocab = self.head_norm, self.head_eps, self.model.cfg.vocab_size
            G.top_p = 1.0
            if noise is not None:
                G.seed, G.n0, G.inv_temp, G.top_k, G.top_p = noise
            stops = torch.tensor(sorted(stop) or [0], dtype=torch.int32)
            G.stop, G.n_stop = stops.data_ptr(), len(stop)
            if grammar is not None:
                follow, forced = grammar[1], torch.zeros(steps, dtype=torch.int32)
                keep.append(forced)

                def taken(tok: int, room: int) -> int:
                    got = follow(tok, room)
                    if got is None or len(got) > room:
                        return -1
                    forced[:len(got)] = torch.tensor(got, dtype=torch.int32)
                    return len(got)

                G.mask, G.grammar, G.forced = grammar[0], L.GRAMMAR_CB(taken), forced.data_ptr()   # (G holds it)
            toks, used = torch.zeros(steps, dtype=torch.int32), torch.zeros(steps, dtype=torch.int32)
            G.tokens, G.loops = toks.data_ptr(), used.data_ptr()
            kvd = self._kv_desc(kv)
            self._grow_scratch(self.lib.tl_generate_scratch_floats(self.desc, G, pos + steps))
            self.lib.tl_set_threads(self.threads)
            rc = self.lib.tl_generate(self.desc, kvd, base, G, self.scratch.data_ptr(), self.scratch.numel())
            if rc != 0:
                raise RuntimeError(f"native generation failed (code {rc})")
            n = G.n_out
            self.model.core_loop_tokens += int(used[:n].sum())
            return toks[:n].tolist(), used[:n].tolist()


def _draft_fields(S, weight, ids, norm, keep: list) -> None:
    """A round's draft head (tl_round / tl_tree): its rows (None: the model's own head, whole vocabulary), the
    token of each column (None: column j is token j), the norm before it (None: none)."""
    if weight is not None:
        S.draft_head = ctypes.pointer(_draft_desc(weight, keep))
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        keep.append(ids)
        S.draft_ids = ids.data_ptr()
    if norm is not None:
        S.draft_norm, S.draft_eps = _vec(norm.weight, keep), float(norm.eps)


def _draft_desc(w, keep: list) -> L.TlLinear:
    """A draft head's rows as a layer: a float tensor, or a module-like holder of int8 rows."""
    return tensor_desc(w, keep) if isinstance(w, torch.Tensor) else linear_desc(w, keep)


def _int64(table: torch.Tensor) -> torch.Tensor:
    """A block table as the library reads it: contiguous int64."""
    return table if table.dtype == torch.int64 and table.is_contiguous() else table.to(torch.int64).contiguous()
