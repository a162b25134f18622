"""The engine's public face: load a model file, then `generate` (blocking) or `stream` (text deltas).

Layers, lowest first: the model's forward (`model/`) -> the engine core (`serving.BatchEngine`: token
ids, one batched step for every request in flight, one KV pool) -> output streams (`text`: detokenizer,
stop strings, events) -> `Engine.stream` / `Engine.generate`, the CLI and the HTTP server. A request is
checked and resolved once into a `RequestPlan` (`Engine.plan`) before it is queued; everything after
reads the plan. `Engine.generate` and `stream` run their request as a batch of one on the same core the
server uses.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..chat import Chat, ChatTemplateError, render_plain, render_template
from ..errors import ValidationError
from ..modelfile.loader import LoadedModel, load_model, model_info
from ..tokenizer import HFTokenizer
from .batch import BatchRunner
from .knobs import SamplingParams
from .plan import RequestPlan, plan_request
from .text import GenerationResult, StreamEvent, TextStream, TokenStream

atexit.register(gc.unfreeze)

__all__ = ["EmbeddingResult", "Engine", "GenerationResult", "StreamEvent", "attach_draft_exit_file"]


@dataclass
class EmbeddingResult:
    """`Engine.embed`'s answer: one L2-normalized row per input, and what produced them."""
    embeddings: torch.Tensor          # (inputs, dimensions) float32
    prompt_tokens: list[int]          # tokens of each input
    loops: int
    pooling: str


def attach_draft_exit_file(loaded: LoadedModel, draft_exit: str | Path | bool = True) -> Path | None:
    """Attach draft exits to a loaded (and, if wanted, decode-prepared) model: True - the model's own
    `<model>.draft.safetensors` if there is one; a path - that file; False - none. Returns the file used;
    a file that does not fit raises ModelFileError (DraftExitError)."""
    from ..model.draft_exit import attach_draft_exits, draft_exit_path, read_draft_exits

    exit_path = None
    if draft_exit is True:
        exit_path = draft_exit_path(loaded.path, loaded.header)
    elif draft_exit:
        exit_path = Path(draft_exit)
    loaded.draft_exit_path = exit_path
    if exit_path is not None:
        exits, _ = read_draft_exits(exit_path, loaded.model.cfg)
        attach_draft_exits(loaded.model, exits)
    return exit_path


def attach_gate_file(loaded: LoadedModel, gate: str | Path | bool = True) -> Path | None:
    """Attach a trained exit gate (`train/gate.py`) unless the model file carries its own."""
    from ..model.gate import gate_path, read_gate

    model = loaded.model
    if model.exit_gate is not None or gate is False:
        return None
    path = gate_path(loaded.path, loaded.header) if gate is True else Path(gate)
    if path is not None:
        model.exit_gate = read_gate(path, model.cfg.dim).to(next(model.parameters()).device)
    return path


class Engine:
    def __init__(self, loaded: LoadedModel, *, max_seq_len: int | None = None, kv_format: str = "fp16"):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self.header = loaded.header
        self.path = loaded.path
        from ..model.cache import CacheError, check_kv_format
        try:
            check_kv_format(self.config, kv_format)
        except CacheError as exc:
            raise ValidationError(f"kv_format: {exc}", param="kv_format") from None
        self.kv_format = kv_format
        limit = self.config.max_seq_len
        if max_seq_len is not None and max_seq_len > 0:
            limit = min(limit, max_seq_len)
        self.max_seq_len = limit
        self._threads = threading.local()  # `core()`: one engine core per calling thread
        self._grammars = None               # `grammars`: made on the first constrained request
        self._grammars_lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path | None = None, *, device: str = "cpu", dtype: torch.dtype | None = None,
             max_seq_len: int | None = None, kv_format: str = "fp16", fast: bool = True,
             draft_exit: str | Path | bool = True, state_seed: int | None = None,
             gate: str | Path | bool = True, executor: str | None = None) -> "Engine":
        """`fast=True` (the default) applies model.fast.prepare_for_decode (fused projections, fp16 FBGEMM
        weights for 16-bit models on CPU, thread policy): see docs/decode.md. `fast=False` keeps the
        plain eager modules (the reference the tests compare against).

        draft_exit: True - attach the model's draft-exit file if it has one (`<model>.draft.safetensors`,
        see model/draft_exit.py; self-speculation then drafts through it); a path - that file (an error
        if it does not fit the model); False - none.

        gate: True - attach the model's trained exit gate `<model>.gate.safetensors` if it has one and no
        gate of its own (`tinyloop train-gate`; the adaptive `gate` criterion reads it); a path - that file;
        False - none.

        state_seed: for models whose family starts the recurrence from a random state (the header's
        `state_init_std`), draw it by that rule, per position, from this seed; None (the default) starts
        from zeros, the deterministic state the authors evaluate with (docs/models.md).

        executor: who runs decode rows with `fast=True`: "native" (the C++ executor, `kernels/`), "torch", or
        None (`TINYLOOP_EXECUTOR`, default: native where its library builds; see docs/decode.md)."""
        # (quantized layers are built for the executor that runs them)
        with BatchRunner.loading_for(executor if fast else "torch"):
            loaded = load_model(path, device=device, dtype=dtype)
        if state_seed is not None:
            if loaded.model.cfg.state_init_std == 0 or loaded.model.cfg.injection == "none":
                raise ValidationError("state_seed: this model has no random initial-state rule", param="state_seed")
            loaded.model.state_seed = int(state_seed)
        if fast:
            BatchRunner.attach(loaded.model, executor=executor)
        attach_draft_exit_file(loaded, draft_exit)
        attach_gate_file(loaded, gate)
        # The model's thousands of long-lived objects leave the garbage collector's generations: a full
        # collection would otherwise walk them all, mid-step (measured ~6% of a native decode step's time).
        gc.freeze()   # (unfrozen at exit, so that extension modules see their objects freed as usual)
        return cls(loaded, max_seq_len=max_seq_len, kv_format=kv_format)

    def release(self) -> None:
        """Let go of the native executor (it and the model refer to each other: without this, an engine let go
        of waits for a full garbage collection to free the model's memory)."""
        BatchRunner.detach(self.model)

    @property
    def executor_name(self) -> str:
        """Who runs the model's decode rows, "native (...)" or "torch" (`/health`, `model_info`, the prompt cache's
        key, the start line)."""
        return BatchRunner.executor_name(self.model)

    def executor_bytes(self) -> int:
        """Bytes of the weights' copies the native executor holds beside the model's tensors (the server's model
        memory: `server/model_memory.py`)."""
        return BatchRunner.executor_bytes(self.model)

    @staticmethod
    def weights_stay_in_cache(weight_bytes: int) -> bool:
        """Whether a model whose decode reads `weight_bytes` of weights a token is served as staying in cache
        (which layout the executor's copy of int4 weights takes: `server/model_memory.estimate_bytes`)."""
        return BatchRunner.weights_stay_in_cache(weight_bytes)

    def model_info(self) -> dict[str, Any]:
        exits = getattr(self.model, "draft_exits", None) or {}
        exit_path = self.loaded.draft_exit_path
        return {**model_info(self.header, self.loaded.index),
                "max_seq_len": self.max_seq_len,  # the context served (TINYLOOP_MAX_SEQ_LEN)
                "kv_cache_mode": self.kv_format,
                # [shallowest, deepest] depth the model was trained at (its family's declaration; null: none
                # declared); loops up to max_loops are allowed all the same, reasoning_effort picks inside it
                "trained_loops": list(self.config.trained_loops) or None,
                "executor": self.executor_name,  # who runs decode rows: "native (...)" or "torch"
                "kv_loops": "last (the model's: one cache per recurrent layer that every loop overwrites, "
                            "kv_mode last_loop)" if self.config.kv_mode == "last_loop" else
                            "all (the default; per request: kv_loops \"last\" or k, docs/adaptive.md)",
                "draft_exit": {"file": exit_path.name, "draft_loops": sorted(exits)} if exits and exit_path else None}

    # -- validation -------------------------------------------------------------------------
    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end an output (unless a request ignores EOS): the model's and its tokenizer's."""
        return self.config.stop_token_ids | frozenset(getattr(self.tokenizer, "eos_ids", ()))

    def chat_text(self, chat: Chat) -> str:
        """The conversation as the model's prompt text: its own chat template, else `chat.render_plain`."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            return render_plain(chat)
        try:
            return render_template(template, chat, bos_token=self.tokenizer.bos_token,
                                   eos_token=self.tokenizer.eos_token)
        except ChatTemplateError as exc:
            raise ValidationError(str(exc), param="messages") from None

    def encode_prompt(self, prompt: str | list[int] | Chat) -> list[int]:
        """Text, a conversation (`chat.Chat`) or token ids -> checked ids."""
        if self.tokenizer is None and not isinstance(prompt, list):
            raise ValidationError("prompt: this model has no tokenizer; give token ids", param="prompt")
        if isinstance(prompt, Chat):
            text = self.chat_text(prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False) if isinstance(self.tokenizer, HFTokenizer) \
                else self.tokenizer.encode(text)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValidationError(f"prompt: token ids {bad[:5]} are outside the vocabulary "
                                      f"0..{self.config.vocab_size - 1}", param="prompt")
        if not ids:
            raise ValidationError("prompt: is empty; give at least one token", param="prompt")
        return ids

    @torch.inference_mode()
    def logits(self, token_ids: list[int], *, loops: int | None = None) -> torch.Tensor:
        """Next-token logits after every position of `token_ids` at `loops` (default: the model's
        default_loops): fp32, (len(token_ids), vocab). One full forward, no cache (scoring and checks)."""
        ids = self.encode_prompt(list(token_ids))
        loops = self.config.default_loops if loops is None else loops
        if not 1 <= loops <= self.config.max_loops:
            raise ValidationError(f"loops: must be in 1..{self.config.max_loops}, got {loops}", param="loops")
        device = next(self.model.parameters()).device
        return self.model(torch.tensor([ids], device=device), loops)[0].float()

    def plan(self, prompt_ids: list[int], params: SamplingParams | None = None, *, n: int = 1) -> RequestPlan:
        """Every check, model-dependent ones included, before any work starts; the request's defaults
        resolved from the model (`plan.plan_request`). ValidationError names the field."""
        plan = plan_request(prompt_ids, params or SamplingParams(), self.config, max_seq_len=self.max_seq_len, n=n,
                            exit_gate=self.model.exit_gate is not None)
        if plan.params.constraint is not None:  # compiled now (cached by content): a bad one is a 400 here
            plan = dataclasses.replace(plan, warnings=self.grammars.check(plan.params.constraint))
        return self._with_thinking(plan)

    def _with_thinking(self, plan: RequestPlan) -> RequestPlan:
        """The plan's thinking block (engine/thinking.py): its tags, whether the prompt opened it, the budget."""
        import dataclasses

        from .thinking import ThinkTags, plan_thinking, resolve

        p = plan.params
        if p.thinking is None:   # the model's own tags, found once
            if not hasattr(self, "_think_tags"):
                self._think_tags = resolve(None, self.tokenizer)
            tags = self._think_tags
        else:
            tags = resolve(p.thinking, self.tokenizer) if self.tokenizer is not None else None
        if tags is None:
            if p.max_thinking_tokens is not None:
                raise ValidationError("max_thinking_tokens: this model does not think (its chat template and "
                                      "tokenizer have no <think> block)", param="max_thinking_tokens")
            return plan
        if p.thinking is not None and not isinstance(p.thinking, (bool, ThinkTags)):
            raise ValidationError("thinking: must be None, False or a ThinkTags", param="thinking")
        return dataclasses.replace(plan, thinking=plan_thinking(tags, self.tokenizer, list(plan.prompt_ids),
                                                                p.max_thinking_tokens))

    @property
    def grammars(self):
        """This engine's grammar compiler (`constraint.Grammars`: llguidance's tokenizer, made on first use,
        and compiled constraints cached by content)."""
        if self._grammars is None:
            from .constraint import Grammars

            with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = Grammars(self.tokenizer, self.config.vocab_size)
        return self._grammars

    def open_stream(self, plan: RequestPlan, t0: float, index: int = 0) -> TokenStream:
        """The output stream the core feeds one choice's tokens to: text (detokenizer and stop strings)
        when the engine has a tokenizer, else ids only."""
        if self.tokenizer is None:
            return TokenStream(plan, self.eos_ids, t0, index)
        check = None if plan.params.constraint is None else self.grammars.schema_check(plan.params.constraint)
        return TextStream(self.tokenizer, plan, self.eos_ids, t0, index, check=check)

    # -- generation -------------------------------------------------------------------------
    def core(self, plan: RequestPlan | None = None):
        """The engine core this object runs its own requests on (a `serving.BatchEngine`), with a pool
        big enough for `plan`; made on first use and grown when a request needs more pages. Each calling
        thread gets its own core, so `generate`/`stream` may be called from several threads at once (to
        batch many concurrent requests, drive one `BatchEngine` from one thread, as the server does)."""
        from .serving import BatchEngine, pool_bytes_for

        local = self._threads
        core = getattr(local, "core", None)
        if core is None or (plan is not None and core.pages_needed(plan) > core.sched.pool.n_pages):
            want = 2 * pool_bytes_for(self, plan) if plan is not None else 0
            if core is not None:
                want = max(want, core.sched.pool.n_pages * core.page_bytes)
            core = local.core = BatchEngine(self, max_num_seqs=8, kv_pool_bytes=want)
        return core

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, *,
               n: int = 1) -> Iterator[StreamEvent]:
        """Text deltas of one request (of each of its `n` choices, by `index`), then one final event per
        choice. Runs on this engine's core; closing the iterator early frees the request's pages."""
        t0 = time.perf_counter()
        plan = self.plan(self.encode_prompt(prompt), params, n=n)
        return self._stream(plan, t0)

    def _stream(self, plan: RequestPlan, t0: float) -> Iterator[StreamEvent]:
        core = self.core(plan)
        items: list[Any] = []
        req = core.add(plan, items.append, t0=t0)
        try:
            with torch.inference_mode():
                while True:
                    while not items:
                        if not core.has_work:  # cannot happen: every accepted request ends with None
                            raise RuntimeError("the engine core stopped without finishing the request")
                        core.step()
                    item = items.pop(0)
                    if item is None:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            if not req.done:
                core.abort(req)

    # -- embeddings -------------------------------------------------------------------------
    def plan_embedding(self, inputs: Any, *, loops: int | None = None, pooling: str | None = None):
        """An embedding request checked and tokenized (`embedding.EmbeddingPlan`): `inputs` a string, token
        ids, or a list of strings / token-id lists; `loops` the depth (default the model's default_loops);
        `pooling` "mean" (default) or "last". ValidationError names the field (`input` for the inputs)."""
        from .embedding import input_list, plan_embedding

        items = input_list(inputs)
        ids = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                if self.tokenizer is None:
                    raise ValidationError("input: this model has no tokenizer; give token ids", param="input")
                ids.append(self.tokenizer.encode(item))
            else:
                ids.append(item)
        return plan_embedding(ids, self.config, max_seq_len=self.max_seq_len, loops=loops, pooling=pooling)

    def embed(self, inputs: Any, *, loops: int | None = None, pooling: str | None = None,
              dimensions: int | None = None) -> "EmbeddingResult":
        """Embeddings of `inputs` (see `plan_embedding`), all batched together on this engine's core (the
        same continuous batch and KV pool as generation; engine/embedding.py): one L2-normalized float32 row
        per input, its first `dimensions` components re-normalized when given."""
        from .embedding import check_dimensions, truncate

        dimensions = check_dimensions(dimensions, self.config.dim)
        plan = self.plan_embedding(inputs, loops=loops, pooling=pooling)
        # a pool for the longest input (at least): the core runs the inputs side by side as pages allow
        core = self.core(dataclasses.replace(plan, inputs=(max(plan.inputs, key=len),)))
        vectors: dict[int, torch.Tensor] = {}
        failure: list[BaseException] = []

        def emit(item: Any) -> None:
            if isinstance(item, StreamEvent) and item.embedding is not None:
                vectors[item.index] = item.embedding
            elif isinstance(item, BaseException):
                failure.append(item)

        req = core.add(plan, emit)
        try:
            with torch.inference_mode():
                while not req.done and not failure:
                    core.step()
        finally:
            if not req.done:
                core.abort(req)
        if failure:
            raise failure[0]
        rows = torch.stack([vectors[i] for i in range(plan.n)])
        return EmbeddingResult(truncate(rows, dimensions), [len(x) for x in plan.inputs], plan.loops, plan.pooling)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> GenerationResult:
        toks: list[int] = []
        parts: list[str] = []
        lps: list = []
        scores = None
        for ev in self.stream(prompt, params):
            toks += ev.token_ids
            parts.append(ev.text)
            lps += ev.logprobs or []
            scores = ev.prompt_logprobs if ev.prompt_logprobs is not None else scores
            if ev.finish_reason is not None:
                return GenerationResult(toks, "".join(parts), ev.finish_reason, ev.stats or {},
                                        lps if params is not None and params.logprobs is not None else None,
                                        scores)
        raise RuntimeError("stream ended without a final event")  # unreachable by construction
