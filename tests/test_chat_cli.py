"""`tinyloop chat`: the session driven through a pseudo-terminal (the shipped model; a tiny random one), and its
pieces as units: the message list of a turn, the thinking display, multi-line input, the /commands.

Timeouts are generous and nothing is timed: the machine may be loaded."""

from __future__ import annotations

import io
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tinyloop.chat_cli import DIM, ERASE, RESET, ChatREPL, ChatSettings, CommandError, Renderer, build_messages

FIXTURE = Path(__file__).parent / "fixtures" / "reference" / "nanbeige-tiny"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")
TIMEOUT = 180


class Pty:
    """`tinyloop chat ARGS` on a pseudo-terminal of its own (its controlling terminal: \\x03 is SIGINT)."""

    def __init__(self, *args: str, env: dict | None = None):
        import fcntl
        import pty
        import struct
        import termios

        e = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "xterm", **(env or {})}
        e.pop("NO_COLOR", None)
        pid, fd = pty.fork()
        if pid == 0:   # the child: exec at once, with SIGINT's default (as a shell starts a foreground program;
            try:       # a test run in a background job would otherwise pass its ignored SIGINT on)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.execve(sys.executable, [sys.executable, "-m", "tinyloop", "chat", *args], e)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.raw = ""          # everything read, as the terminal got it
        self.pos = 0           # how far `expect` has consumed (in `text`)
        self.status = None

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw).replace("\r", "")

    def _read(self, deadline: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:    # EIO: the child closed the terminal
            return False
        if not data:
            return False
        self.raw += data.decode("utf-8", "replace")
        return True

    def expect(self, pattern: str, timeout: float = TIMEOUT) -> str:
        """Read until `pattern` (a regex) appears after what was consumed; the text up to its end."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            m = rx.search(self.text, self.pos)
            if m:
                out, self.pos = self.text[self.pos:m.end()], m.end()
                return out
            if time.monotonic() > deadline or not self._read(deadline):
                m = rx.search(self.text, self.pos)
                if m:
                    continue
                raise AssertionError(f"{pattern!r} did not come; the terminal showed:\n{self.text[self.pos:]}")

    def prompt(self) -> str:
        return self.expect(r">>> $|>>> (?=\S)|>>> ")

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def interrupt_at_prompt(self) -> None:
        """Ctrl-C at the prompt, once the session waits in readline's select(): a SIGINT that lands between
        readline printing the prompt and its select() is only seen at the next key (CPython's readline), a
        window a person never hits and a test on a loaded machine does."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                wchan = Path(f"/proc/{self.pid}/wchan").read_text()
                state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:   # no /proc: give it a moment
                time.sleep(1.0)
                break
            if state == "S" and ("poll" in wchan or "select" in wchan):
                break
            time.sleep(0.05)
        self.send("\x03")

    def line(self, text: str) -> str:
        """Send a line at the prompt; what came back until the next prompt."""
        self.send(text + "\r")
        return self.prompt()

    def wait(self, timeout: float = TIMEOUT) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
            self._read(time.monotonic() + 0.2)
        raise AssertionError(f"tinyloop chat did not exit; the terminal showed:\n{self.text[self.pos:]}")

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.fd)


@pytest.fixture
def session(request):
    made = []

    def start(*args, **kw):
        p = Pty(*args, **kw)
        made.append(p)
        return p

    yield start
    for p in made:
        p.close()


STATS = r"\((\d+) tokens, loops (\d+)[^)]*finish (\w+)\)"


def test_a_session_on_the_shipped_model(session):
    """Turns stream and come back to the prompt; /loops changes the depth (the /verbose line's loops); bad
    commands are one line each; Ctrl-C stops an answer and the session goes on; Ctrl-C at an empty prompt
    does not quit; Ctrl-D quits with status 0."""
    chat = session("--temperature", "0", "--max-tokens", "6", "--verbose")
    banner = chat.prompt()
    assert "/help" in banner and "Ctrl-D" in banner
    out = chat.line("Tell me a story about a king.")
    n, loops, finish = re.search(STATS, out).groups()
    assert (n, loops, finish) == ("6", "8", "length")          # the shipped model's default_loops
    assert re.search(r"king\.\n\S.*\n\(6 tokens", out), out      # the answer's text, then the stats line
    assert "(loops: 3)" in chat.line("/loops 3")
    again = chat.line("Tell me a story about a king.")
    assert re.search(STATS, again).groups() == ("6", "3", "length")
    assert "/show" not in again and "history        4 messages" in chat.line("/show")   # two turns kept

    for bad, says in [("/loops 0", "error: loops: must be"),
                      ("/loops many", 'error: /loops: give an integer or "auto"'),
                      ("/temperature hot", "error: /temperature: give a number"),
                      ("/show-thinking maybe", "error: /show-thinking: give on or off"),
                      ("/think on", "error: /think: this model does not think"),
                      ("/frobnicate", "error: unknown command /frobnicate")]:
        out = chat.line(bad)
        assert says in out and "Traceback" not in out, out
        assert len([x for x in out.splitlines() if x.startswith("error:")]) == 1

    # Ctrl-C mid-answer: a long one (64 loops, 450 tokens: seconds even on a fast machine), stopped at its start
    chat.line("/clear")
    chat.line("/loops 64")
    chat.line("/max-tokens 450")
    chat.send("Tell me a story about a king.\r")
    chat.expect(r"king\.\n\S")            # the answer has begun
    chat.send("\x03")
    out = chat.prompt()
    assert "(stopped)" in out and "Traceback" not in out, out
    assert "history        0 messages" in chat.line("/show")      # the stopped turn is not kept
    assert "/loops N" in chat.line("/help")                        # still running

    chat.interrupt_at_prompt()                                      # at an empty prompt: a hint, no exit
    assert "Ctrl-C again" in chat.prompt()
    assert "(verbose: off)" in chat.line("/verbose")
    chat.send("\x04")                                               # Ctrl-D
    assert chat.wait() == 0


def test_multiline_input_and_two_interrupts(session, tiny_model_path):
    chat = session(str(tiny_model_path), "--temperature", "0", "--max-tokens", "3", "--verbose")
    chat.prompt()
    chat.send("first line \\\r")
    chat.expect(r"\.\.\. ")
    out = chat.line("second line")
    assert re.search(STATS, out).group(1) == "3"
    chat.send('"""\r')
    chat.expect(r"\.\.\. ")
    chat.send("a block\r")
    chat.expect(r"\.\.\. ")
    out = chat.line('of two lines"""')
    assert re.search(STATS, out)
    assert "history        4 messages" in chat.line("/show")
    chat.interrupt_at_prompt()
    assert "Ctrl-C again" in chat.prompt()
    chat.interrupt_at_prompt()
    assert chat.wait() == 0


def test_bye_and_piped_input(tiny_model_path):
    """Without a terminal: no prompt, every line a message or a command, plain output, exit at the end."""
    script = "/loops 2\nHello\n/loops 99\n/verbose on\nHello again\n/bye\nnever read\n"
    r = subprocess.run([sys.executable, "-m", "tinyloop", "chat", str(tiny_model_path), "--max-tokens", "3",
                        "--temperature", "0"], input=script, capture_output=True, text=True, timeout=TIMEOUT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert ">>>" not in r.stdout and "\x1b[" not in r.stdout
    errors = r.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: loops: must be") and "99" in errors[0], r.stderr
    assert "(loops: 2)" in r.stdout and re.search(r"\(3 tokens, loops 2", r.stdout)


def test_bad_model_and_flags_are_one_line():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "tinyloop", "chat", *args], capture_output=True, text=True,
                              timeout=TIMEOUT, stdin=subprocess.DEVNULL)

    r = run("/nonexistent/model.tinyloop")
    assert r.returncode == 2 and r.stderr.startswith("tinyloop: error: /nonexistent/model.tinyloop: no such file")
    assert len(r.stderr.strip().splitlines()) == 1
    r = run("--loops", "0")
    assert r.returncode == 2 and "loops: must be" in r.stderr and "Traceback" not in r.stderr
    r = run("--think", "on")        # the shipped model does not think
    assert r.returncode == 2 and "--think: this model does not think" in r.stderr and "Traceback" not in r.stderr


# -- units ----------------------------------------------------------------------------------------------------

def test_the_message_list_feeds_the_history_back():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    msgs = build_messages(history, "And then?", system="Be brief.")
    assert msgs == [{"role": "system", "content": "Be brief."}, *history, {"role": "user", "content": "And then?"}]
    assert build_messages([], "Hi") == [{"role": "user", "content": "Hi"}]
    msgs[1]["content"] = "changed"
    assert history[0]["content"] == "Hi"       # copies


def feed_all(view, deltas):
    for d in deltas:
        view.feed(d)
    view.finish()


THOUGHT = [{"reasoning_content": "Let me"}, {"reasoning_content": " think."}, {"content": "\n\nThe "},
           {"content": "answer."}]


def test_thinking_is_dimmed_on_a_terminal():
    out = io.StringIO()
    view = Renderer(out.write, tty=True)
    feed_all(view, THOUGHT)
    assert out.getvalue() == f"{DIM}Let me think.{RESET}\n\nThe answer.\n"
    assert view.answer == "The answer." and view.thinking == "Let me think."


def test_thinking_is_labelled_without_a_terminal_and_hidden_on_request():
    out = io.StringIO()
    feed_all(Renderer(out.write, tty=False), THOUGHT)
    assert out.getvalue() == "Thinking:\nLet me think.\n\nAnswer:\nThe answer.\n"
    for tty, shown in ((True, f"{DIM}Thinking...{RESET}{ERASE}The answer.\n"), (False, "The answer.\n")):
        out = io.StringIO()
        view = Renderer(out.write, tty=tty, show_thinking=False)
        feed_all(view, THOUGHT)
        assert out.getvalue() == shown and view.thinking == "Let me think."
    out = io.StringIO()   # stopped inside the thinking: the attribute is reset
    feed_all(Renderer(out.write, tty=True), THOUGHT[:1])
    assert out.getvalue() == f"{DIM}Let me{RESET}\n"
    out = io.StringIO()   # no thinking: the answer only
    feed_all(Renderer(out.write, tty=True), [{"content": " Hello"}, {"content": " there"}])
    assert out.getvalue() == "Hello there\n"


def test_multiline_input_rules():
    def read(*lines):
        it = iter(lines)

        def fake_input(prompt):
            try:
                return next(it)
            except StopIteration:
                raise EOFError from None

        return ChatREPL.read_message(type("R", (), {"input": staticmethod(fake_input), "interactive": True})())

    assert read("one line") == "one line"
    assert read("first \\", "second\\", "third") == "first \nsecond\nthird"
    assert read('"""', "a", "", "b", '"""') == "a\n\nb"
    assert read('"""starts here', 'ends here"""') == "starts here\nends here"
    assert read('"""all in one"""') == "all in one"
    with pytest.raises(EOFError):
        read('"""', "never closed")


@pytest.fixture(scope="module")
def nanbeige(tmp_path_factory):
    from tinyloop.engine import Engine
    from tinyloop.tools.convert import convert

    return Engine.load(convert(FIXTURE, tmp_path_factory.mktemp("nb") / "nb.tinyloop", dtype="float32",
                               progress=False))


def repl(engine, **kw):
    out, err = io.StringIO(), io.StringIO()
    r = ChatREPL(engine, ChatSettings(temperature=0, max_tokens=6, **kw), out=out, err=err, interactive=False,
                 tty=True)
    return r, out, err


def test_a_thinking_model_through_its_template(nanbeige):
    """Nanbeige's template opens <think> in the generation prompt: the tiny random model's output is all
    thinking (dimmed); /think off renders enable_thinking false (the block closed in the prompt), so the output
    is all answer; the history holds answers only, fed back through the template."""
    r, out, err = repl(nanbeige)
    ids, _ = r.prompt("Hi")
    assert nanbeige.tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n")
    r.answer("Hi")
    assert out.getvalue().startswith(DIM) and RESET in out.getvalue()
    assert r.history == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]

    r.command("/think off")
    ids, _ = r.prompt("Again")
    text = nanbeige.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<|im_start|>user\nHi<|im_end|>" in text and "<|im_start|>user\nAgain<|im_end|>" in text
    out.truncate(0), out.seek(0)
    r.answer("Again")
    assert DIM not in out.getvalue()
    answer = r.history[-1]["content"]
    assert answer and "<think>" not in answer and r.history[-2] == {"role": "user", "content": "Again"}
    assert answer in nanbeige.tokenizer.decode(r.prompt("Third")[0])      # fed back
    assert not err.getvalue()

    r2, out2, _ = repl(nanbeige, show_thinking=False)
    r2.answer("Hi")
    assert out2.getvalue().startswith(f"{DIM}Thinking...{RESET}{ERASE}\n{DIM}(the answer ended inside its thinking: ")


def test_commands_change_the_settings(nanbeige):
    r, out, _ = repl(nanbeige)
    r.command("/loops 3")
    r.command("/temperature 0.5")
    r.command("/max-tokens 9")
    r.command("/show-thinking off")
    r.command("/system You are terse.")
    s = r.settings
    assert (s.loops, s.temperature, s.max_tokens, s.show_thinking, s.system) == (3, 0.5, 9, False, "You are terse.")
    assert r.prompt("Hi")[1] == 9
    assert r.params(9).loops == 3 and r.params(9).stop == []      # a template: no "Role: content" stop
    r.command("/loops auto")
    assert s.loops == "auto"
    r.command("/max-tokens auto")
    assert s.max_tokens is None
    assert r.command("/bye") is False and r.command("/help") is True and "/loops N" in out.getvalue()
    for bad in ("/loops 65", "/temperature -1", "/max-tokens 0", "/think maybe", "/nope"):
        with pytest.raises((CommandError, ValueError)):
            r.command(bad)


def test_ctrl_c_aborts_the_request_on_the_core(nanbeige):
    """SIGINT during an answer: the stream is closed between steps, the request aborted on the engine core (as
    the server aborts one whose client left), the turn not kept; the session's next answer runs as usual."""
    r, out, err = repl(nanbeige)
    r.settings.max_tokens = 200
    sent = []
    before = signal.getsignal(signal.SIGINT)   # (the default handler, or SIG_IGN in a background job)

    def write(text):
        out.write(text)
        if not sent:   # the first output: Ctrl-C
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    r.write = write
    r.answer("Hi")
    core = nanbeige.core()
    assert "(stopped)" in out.getvalue() and not core.has_work and core.num_running == 0 and r.history == []
    assert signal.getsignal(signal.SIGINT) is before     # restored
    del r.write
    r.settings.max_tokens = 4
    r.answer("Hi")
    assert len(r.history) == 2 and not err.getvalue()


def test_an_answer_of_only_whitespace_says_so_and_is_not_kept(tiny_model_path):
    """`echo "hi there" | tinyloop chat --temperature 0` on the shipped model printed an empty line: its greedy
    output is spaces to the end of the context. Such an output is stopped after BLANK_LIMIT tokens (or ends at
    max_tokens), the session says what happened, and the blank turn is not fed back to the next one."""
    from tinyloop.chat_cli import BLANK_LIMIT
    from tinyloop.engine import Engine

    engine = Engine.load(tiny_model_path)
    space = engine.tokenizer.encode(" ")
    assert len(space) == 1
    out, err = io.StringIO(), io.StringIO()
    r = ChatREPL(engine, ChatSettings(temperature=0, max_tokens=200), out=out, err=err, interactive=False, tty=False)
    plain = r.params
    r.params = lambda n: plain(n).replace(logit_bias={space[0]: 100.0})   # the model says nothing but spaces
    r.answer("hi there")
    text = out.getvalue()
    assert f"(no answer: the model wrote only whitespace ({BLANK_LIMIT} tokens, stopped)" in text, text
    assert r.history == [] and not err.getvalue()
    core = engine.core()
    assert not core.has_work and core.num_running == 0          # the stopped request was aborted on the core
    r.settings.max_tokens = 5                                   # shorter than the limit: it ends by itself
    out.truncate(0), out.seek(0)
    r.answer("hi there")
    assert "(no answer: the model wrote only whitespace (5 tokens);" in out.getvalue() and r.history == []
    r.params = plain                                            # a real answer is kept as before
    r.answer("hi there")
    assert len(r.history) == 2 and r.history[-1]["content"]
