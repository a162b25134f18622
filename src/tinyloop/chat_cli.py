"""`tinyloop chat [MODEL]`: a conversation in the terminal, as `ollama run` has it (docs/chat.md).

Each turn goes through the same path as the HTTP chat route: the conversation is a `chat.Chat` rendered by the
model's own chat template (`Engine.encode_prompt`), planned by `Engine.plan` (which says whether the output has
a thinking block and whether the prompt opened it: engine/thinking.py) and streamed by `Engine.stream` on the
engine core in this process. The answer's text is cut into thinking and answer by the server's
`ReasoningParser` (server/reasoning.py), so the history holds what the chat route's `message.content` would:
the answer only, thinking stripped, as the templates expect earlier turns.

Ctrl-C during an answer stops it the way the server stops a request whose client went away: the stream is
closed between steps, and closing it aborts the request on the core (`BatchEngine.abort`: its KV pages go
back to the pool). A stopped turn is not kept in the history.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .chat import Chat
from .errors import ValidationError

DIM, RESET = "\x1b[2m", "\x1b[0m"     # SGR 2 (faint) and SGR 0
ERASE = "\r\x1b[K"                   # back to the line's start, the line cleared (EL)
PROMPT, MORE = ">>> ", "... "
MAX_ANSWER_TOKENS = 2048              # without --max-tokens: the rest of the context, at most this many
BLANK_LIMIT = 32                      # an output of only whitespace this long is stopped (it never became an answer)
PLAIN_STOP = "\nUser:"                # models without a template: "Role: content" lines (docs/server.md)
ON_OFF = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}

HELP = """\
Commands:
  /loops N | auto          the depth of the next answers (auto: adaptive depth, docs/adaptive.md)
  /temperature T           sampling temperature (0: greedy)
  /max-tokens N | auto     the longest answer (auto: the rest of the context, at most 2048 tokens)
  /think on | off          let the model think (off: enable_thinking false in its chat template, else a
                           thinking budget of 0 tokens)
  /show-thinking on | off  show the thinking (dimmed on a terminal) or hide it
  /system [TEXT]           set the system message (without TEXT: remove it); clears nothing
  /verbose [on | off]      a line of stats after each answer (tokens, loops, tokens/s, first token)
  /show                    the current settings
  /clear                   forget the conversation so far
  /help                    this text
  /bye                     quit (also Ctrl-D, or Ctrl-C twice at the prompt)
Input: end a line with \\ to continue it on the next, or put a message between \"\"\" lines.
A message that starts with / is a command; start it with // to send it as text (one / is dropped).
Ctrl-C stops an answer and comes back to the prompt."""


class CommandError(ValueError):
    """A /command the session cannot take: said in one line, the session goes on."""


@dataclass
class ChatSettings:
    loops: int | str | None = None     # None: the model's default_loops
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int | None = None      # None: the rest of the context, at most MAX_ANSWER_TOKENS
    seed: int | None = None
    think: bool | None = None          # None: the template's default; False: no thinking
    show_thinking: bool = True
    verbose: bool = False
    system: str | None = None


def build_messages(history: list[dict], user: str, system: str | None = None) -> list[dict]:
    """The messages of the next turn: the system message, the turns so far (answers without their thinking),
    then the user's new message."""
    head = [{"role": "system", "content": system}] if system else []
    return head + [dict(m) for m in history] + [{"role": "user", "content": user}]


def template_kwargs(settings: ChatSettings, template: str | None) -> dict:
    """What the template is told: `enable_thinking` when /think was set and the template has the switch."""
    if settings.think is not None and template and "enable_thinking" in template:
        return {"enable_thinking": settings.think}
    return {}


class Renderer:
    """Thinking and answer deltas (the `ReasoningParser`'s: {"reasoning_content": ...} / {"content": ...}) to
    the terminal. Thinking is shown dimmed (SGR 2) on a terminal, under a "Thinking:" label otherwise (then the
    answer under "Answer:"), or not at all (on a terminal a dimmed "Thinking..." stands in for it, erased when
    the answer starts); the answer as it comes, its leading whitespace dropped. `answer` and `thinking` collect
    the text either way."""

    def __init__(self, write: Callable[[str], Any], *, tty: bool, show_thinking: bool = True):
        self.write, self.tty, self.show = write, tty, show_thinking
        self.state = "start"          # "start" | "think" (shown) | "hidden" (the stand-in shown) | "answer"
        self.answer = ""
        self.thinking = ""

    def feed(self, delta: dict) -> None:
        if delta.get("reasoning_content"):
            text = delta["reasoning_content"]
            self.thinking += text
            if self.state == "answer":
                return
            if not self.show:
                if self.tty and self.state == "start":
                    self.write(f"{DIM}Thinking...{RESET}")
                    self.state = "hidden"
                return
            if self.state == "start":
                self.write(DIM if self.tty else "Thinking:\n")
                self.state = "think"
            self.write(text)
        elif delta.get("content"):
            text = delta["content"]
            if not self.answer:
                text = text.lstrip()
                if not text:
                    return
            if self.state == "think":
                self.write(RESET + "\n\n" if self.tty else "\n\nAnswer:\n")
            elif self.state == "hidden":
                self.write(ERASE)
            self.state = "answer"
            self.answer += text
            self.write(text)

    def finish(self) -> None:
        """The end of the output (or its interruption): the dim attribute reset, a newline."""
        if self.state == "think" and self.tty:
            self.write(RESET)
        elif self.state == "hidden":
            self.write(ERASE)
        self.write("\n")


class _Passthrough:
    """The split of an output without a thinking block: all answer."""

    def feed(self, text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        return []


def splitter(thinking_plan):
    """The thinking/answer split of one output: the chat route's `ReasoningParser` for the plan's block."""
    if thinking_plan is None:
        return _Passthrough()
    from .server.reasoning import ReasoningParser

    return ReasoningParser(thinking_plan.tags, thinking_plan.inside)


def on_off(value: str, name: str) -> bool:
    v = value.strip().lower()
    if v not in ON_OFF:
        raise CommandError(f"{name}: give on or off, got {value.strip()!r}")
    return ON_OFF[v]


def int_or_auto(value: str, name: str) -> int | str:
    """A command's integer argument, or "auto"."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise CommandError(f'{name}: give an integer or "auto", got {value!r}') from None


@contextmanager
def _interrupt_flag():
    """Ctrl-C as a flag while an answer streams (checked between the engine's steps), the usual
    KeyboardInterrupt again afterwards."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


class ChatREPL:
    def __init__(self, engine, settings: ChatSettings | None = None, *, out=None, err=None,
                 input_fn: Callable[[str], str] = input, interactive: bool | None = None, tty: bool | None = None):
        self.engine = engine
        self.settings = settings or ChatSettings()
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.input = input_fn
        self.interactive = sys.stdin.isatty() if interactive is None else interactive
        if tty is None:
            tty = self.out.isatty() and not os.environ.get("NO_COLOR")
        self.tty = tty
        self.history: list[dict] = []
        self.template = getattr(engine.tokenizer, "chat_template", None)
        from .engine.thinking import model_tags
        self.thinks = model_tags(engine.tokenizer) is not None

    # -- output --------------------------------------------------------------------------------------------
    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def note(self, text: str) -> None:
        """A line about the session (dimmed on a terminal)."""
        self.write(f"{DIM}{text}{RESET}\n" if self.tty else f"{text}\n")

    def error(self, text: str) -> None:
        self.out.flush()
        self.err.write(f"error: {text}\n")
        self.err.flush()

    # -- input ---------------------------------------------------------------------------------------------
    def read_message(self) -> str:
        """One message: a line; lines joined while each ends in a backslash; or a \"\"\" block. EOFError at the
        end of input, KeyboardInterrupt on Ctrl-C."""
        prompt = PROMPT if self.interactive else ""
        more = MORE if self.interactive else ""
        line = self.input(prompt)
        if line.lstrip().startswith('"""'):
            first = line.lstrip()[3:]
            if first.rstrip().endswith('"""'):
                return first.rstrip()[:-3]
            lines = [first] if first else []
            while True:
                line = self.input(more)
                if line.rstrip().endswith('"""'):
                    lines.append(line.rstrip()[:-3])
                    return "\n".join(lines).strip("\n")
                lines.append(line)
        lines = []
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = self.input(more)
        lines.append(line)
        return "\n".join(lines)

    # -- commands ------------------------------------------------------------------------------------------
    def _check(self, **kw) -> None:
        """A setting checked as a request's would be (SamplingParams.validate against the model's limits)."""
        from .engine.knobs import SamplingParams

        cfg = self.engine.config
        try:
            SamplingParams(**kw).validate(max_loops=cfg.max_loops, vocab_size=cfg.vocab_size,
                                          default_loops=cfg.default_loops)
        except ValidationError as exc:
            raise CommandError(str(exc)) from None

    def command(self, line: str) -> bool:
        """Run a /command; False when the session should end."""
        name, _, arg = line.strip().partition(" ")
        name, arg = name.lower(), arg.strip()
        s = self.settings
        if name in ("/bye", "/exit", "/quit"):
            return False
        if name in ("/help", "/?"):
            self.write(HELP + "\n")
        elif name == "/clear":
            self.history.clear()
            self.note("(the conversation is cleared)")
        elif name == "/loops":
            if not arg:
                raise CommandError(f"/loops: give a depth in 1..{self.engine.config.max_loops} or auto")
            value = int_or_auto(arg, "/loops")
            self._check(loops=value)
            s.loops = value
            self.note(f"(loops: {value})")
        elif name == "/temperature":
            try:
                value = float(arg)
            except ValueError:
                raise CommandError(f"/temperature: give a number such as 0.7 (0: greedy), got {arg!r}") from None
            self._check(temperature=value)
            s.temperature = value
            self.note(f"(temperature: {value:g})")
        elif name == "/max-tokens":
            value = int_or_auto(arg, "/max-tokens")
            if value == "auto":
                s.max_tokens = None
            else:
                self._check(max_tokens=value)
                s.max_tokens = value
            self.note(f"(max tokens: {s.max_tokens or 'auto'})")
        elif name == "/think":
            s.think = self._think(on_off(arg, "/think"))
            self.note(f"(thinking: {'on' if s.think else 'off'})")
        elif name == "/show-thinking":
            s.show_thinking = on_off(arg, "/show-thinking")
            self.note(f"(thinking {'shown' if s.show_thinking else 'hidden'})")
        elif name == "/verbose":
            s.verbose = on_off(arg, "/verbose") if arg else not s.verbose
            self.note(f"(verbose: {'on' if s.verbose else 'off'})")
        elif name == "/system":
            s.system = arg or None
            self.note("(system message set)" if arg else "(no system message)")
        elif name == "/show":
            self.write(self.describe() + "\n")
        else:
            raise CommandError(f"unknown command {name} (/help lists the commands)")
        return True

    def _think(self, on: bool) -> bool:
        if not self.thinks:
            raise CommandError("/think: this model does not think (its chat template and tokenizer have no "
                               "<think> block)")
        return on

    def describe(self) -> str:
        s, cfg = self.settings, self.engine.config
        think = "the model does not think"
        if self.thinks:
            think = ("the template's default" if s.think is None else "on" if s.think else "off") + \
                f"; {'shown' if s.show_thinking else 'hidden'}"
        return "\n".join([
            f"model          {self.engine.path}",
            f"loops          {s.loops if s.loops is not None else cfg.default_loops} (1..{cfg.max_loops} or auto)",
            f"temperature    {s.temperature:g}",
            f"max tokens     {s.max_tokens or f'auto (the rest of the {self.engine.max_seq_len}-token context)'}",
            f"thinking       {think}",
            f"verbose        {'on' if s.verbose else 'off'}",
            f"system         {s.system!r}" if s.system else "system         none",
            f"history        {len(self.history)} messages"])

    # -- a turn --------------------------------------------------------------------------------------------
    def params(self, max_tokens: int):
        from .engine.knobs import SamplingParams

        s = self.settings
        budget = 0 if s.think is False and self.thinks and "enable_thinking" not in (self.template or "") else None
        return SamplingParams(max_tokens=max_tokens, loops=s.loops, temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, seed=s.seed, stop=[] if self.template else [PLAIN_STOP],
                              max_thinking_tokens=budget)

    def prompt(self, user: str) -> tuple[list[int], int]:
        """The next turn's prompt ids and its max_tokens. The oldest turns are dropped (saying so) while the
        conversation leaves too little of the context for an answer."""
        want = self.settings.max_tokens or MAX_ANSWER_TOKENS
        limit = self.engine.max_seq_len
        dropped = 0
        while True:
            chat = Chat(build_messages(self.history, user, self.settings.system),
                        template_kwargs=template_kwargs(self.settings, self.template))
            ids = self.engine.encode_prompt(chat)
            room = limit - len(ids)
            if room >= min(want, 64) or (not self.history and room >= 1):
                break
            if not self.history:
                raise ValidationError(f"the message is {len(ids)} tokens with the template; the model's context is "
                                      f"{limit} tokens: shorten it", param="messages")
            del self.history[:2]   # one user message and its answer
            dropped += 1
        if dropped:
            self.note(f"(the {dropped} oldest turn{'s' if dropped > 1 else ''} dropped to fit the {limit}-token "
                      "context)")
        return ids, min(want, room)

    def answer(self, user: str) -> None:
        """One turn: the answer streamed, the turn kept in the history unless Ctrl-C stopped it."""
        ids, max_tokens = self.prompt(user)
        params = self.params(max_tokens)
        plan = self.engine.plan(ids, params)           # checks, and the output's thinking block
        split = splitter(plan.thinking)
        view = Renderer(self.write, tty=self.tty, show_thinking=self.settings.show_thinking)
        final = None
        stopped = False
        tokens = 0
        blank = False        # only whitespace so far, and BLANK_LIMIT tokens of it: given up
        with _interrupt_flag() as stop:
            stream = self.engine.stream(ids, params)
            try:
                for ev in stream:
                    for d in split.feed(ev.text):
                        view.feed(d)
                    tokens += len(ev.token_ids)
                    if ev.finish_reason is not None:
                        final = ev
                    if stop.is_set():
                        stopped = True
                        break
                    if tokens >= BLANK_LIMIT and final is None and not view.answer and not view.thinking:
                        blank = True   # (a small model at temperature 0 can repeat a space to the end of its context)
                        break
                if not stopped:
                    for d in split.finish():
                        view.feed(d)
            except KeyboardInterrupt:   # (a Ctrl-C just before the flag's handler was in place)
                stopped = True
            finally:
                stream.close()         # an unfinished request is aborted on the core (Engine._stream)
                view.finish()
        if blank or (final is not None and not stopped and not view.answer.strip() and not view.thinking.strip()):
            self.note(f"(no answer: the model wrote only whitespace ({tokens} tokens{', stopped' if blank else ''}); "
                      "the turn is not kept. Try another /temperature or /loops, or a chat model: docs/models.md)")
            return
        if stopped or final is None:
            self.note("(stopped)")
            return
        if not view.answer and view.thinking and not self.settings.show_thinking:
            self.note(f"(the answer ended inside its thinking: {len(view.thinking)} characters hidden; "
                      "/show-thinking on shows them)")
        if self.settings.verbose:
            self.note(stats_line(final.stats or {}, final.finish_reason))
        if final.finish_reason == "length" and max_tokens < (self.settings.max_tokens or MAX_ANSWER_TOKENS):
            self.note("(the answer reached the end of the model's context; /clear starts over)")
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": view.answer.strip()}]

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self) -> int:
        if self.interactive:
            _enable_readline()
            cfg = self.engine.config
            self.note(f"{Path(str(self.engine.path)).name}: {self.settings.loops or cfg.default_loops} loops "
                      f"(1..{cfg.max_loops} or auto). /help for commands; /bye or Ctrl-D quits.")
        interrupts = 0
        while True:
            try:
                text = self.read_message()
            except EOFError:
                if self.interactive:
                    self.write("\n")
                return 0
            except KeyboardInterrupt:
                interrupts += 1
                if interrupts >= 2 or not self.interactive:
                    self.write("\n")
                    return 0
                self.write("\n")
                self.note("(Ctrl-C again, Ctrl-D or /bye to quit)")
                continue
            interrupts = 0
            if not text.strip():
                continue
            try:
                if text.startswith("//"):
                    text = text[1:]
                elif text.startswith("/"):
                    if not self.command(text):
                        return 0
                    continue
                self.answer(text)
            except (CommandError, ValidationError) as exc:
                self.error(str(exc))
            except Exception as exc:   # noqa: BLE001 - the session goes on; one line, no traceback
                self.error(f"{type(exc).__name__}: {exc}")


def stats_line(stats: dict, finish_reason: str | None) -> str:
    parts = [f"{stats.get('completion_tokens', 0)} tokens", f"loops {stats.get('loops_used')}",
             f"{stats.get('tokens_per_second', 0):g} tokens/s",
             f"first token {stats.get('time_to_first_token_ms', 0):.0f} ms",
             f"prompt {stats.get('prompt_tokens', 0)} tokens", f"finish {finish_reason}"]
    return "(" + ", ".join(parts) + ")"


def _enable_readline() -> None:
    """Line editing and the session's input history where the readline module is (not on Windows)."""
    try:
        import readline  # noqa: F401 - importing it is what gives input() line editing
    except ImportError:
        pass


def run_chat(args) -> int:
    """`tinyloop chat`: the model resolved as `generate` and `serve` resolve it, then the session."""
    from .errors import ModelFileError
    from .modelfile.header import header_config, resolve_model_path

    def fail(msg: str) -> int:
        print(f"tinyloop: error: {msg}", file=sys.stderr)
        return 2

    think = None if args.think is None else args.think == "on"
    settings = ChatSettings(loops=args.loops, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed, think=think,
                            show_thinking=not args.hide_thinking, verbose=args.verbose, system=args.system)
    try:
        path = resolve_model_path(args.model)
        cfg = header_config(path)   # flags checked against the header before torch loads
        from .engine.knobs import SamplingParams
        SamplingParams(max_tokens=args.max_tokens or 1, loops=args.loops, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed).validate(
            max_loops=cfg.max_loops, vocab_size=cfg.vocab_size, default_loops=cfg.default_loops)
        from .engine import Engine

        engine = Engine.load(path, kv_format=args.kv)
        repl = ChatREPL(engine, settings)
        if think is not None:
            repl._think(think)
    except (ModelFileError, ValidationError) as exc:
        return fail(str(exc))
    except CommandError as exc:   # --think on a model that does not think
        return fail(str(exc).replace("/think", "--think", 1))
    except NotImplementedError as exc:
        return fail(str(exc))
    return repl.run()


def add_command(sub, loops_arg: Callable[[str], int | str]) -> None:
    """The `chat` subcommand (registered by cli.build_parser, which passes its `--loops` parser)."""
    from .quant.kv_formats import KV_FORMATS

    c = sub.add_parser("chat", help="chat with a model in the terminal (as `ollama run`; docs/chat.md)",
                       description="A conversation with the model through its own chat template: answers "
                       "stream as they are generated, the thinking of models that think is shown dimmed (or "
                       "hidden), and /commands change the depth, temperature and more (/help lists them). "
                       "Ctrl-C stops an answer; Ctrl-D, /bye or Ctrl-C twice at the prompt quits.")
    c.add_argument("model", nargs="?", help="a .tinyloop file, a packaged model's name or a pulled hf: name "
                   "(default: $TINYLOOP_MODEL_PATH or the shipped model)")
    c.add_argument("--loops", type=loops_arg, help="an integer, or \"auto\"; default: the model's default_loops")
    c.add_argument("--temperature", type=float, default=0.7, help="default: %(default)s (0: greedy)")
    c.add_argument("--top-k", type=int, default=0, help="default: %(default)s (off)")
    c.add_argument("--top-p", type=float, default=1.0, help="default: %(default)s (off)")
    c.add_argument("--max-tokens", type=int, help=f"the longest answer (default: the rest of the context, at most "
                   f"{MAX_ANSWER_TOKENS})")
    c.add_argument("--seed", type=int, help="sampling seed (default: fresh entropy)")
    c.add_argument("--system", help="a system message")
    c.add_argument("--think", choices=["on", "off"], help="let a thinking model think (off: enable_thinking false "
                   "in its template, else a thinking budget of 0); default: the template's own default")
    c.add_argument("--hide-thinking", action="store_true", help="do not show the thinking (/show-thinking on "
                   "shows it again)")
    c.add_argument("--verbose", action="store_true", help="a line of stats after each answer (/verbose)")
    c.add_argument("--kv", default="fp16", choices=list(KV_FORMATS), help="KV cache format (default: %(default)s)")
    c.set_defaults(func=run_chat)
