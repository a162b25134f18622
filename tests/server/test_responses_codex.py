"""Codex CLI (`codex exec`, unchanged) against the server's Responses API as a local provider (wire_api
"responses"): a turn on a forced model, and a tool call (`exec_command`) whose result comes back and is answered;
the test model that decides by the conversation, checked through the openai SDK first. Skipped where Codex is not
installed (`make agents`)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tinyloop.server.settings import Settings

from .conftest import ServerThread, agent_bin
from .test_responses_api import CLOCK, KEY, MODEL, WEATHER

openai = pytest.importorskip("openai")


CODEX = agent_bin("codex", "TINYLOOP_CODEX_BIN")
NEEDS_CODEX = pytest.mark.skipif(not CODEX, reason="Codex CLI is not installed (make agents, npm install @openai/codex, "
                                                    "or TINYLOOP_CODEX_BIN=path/to/codex)")


def codex_exec(srv: ServerThread, tmp_path, prompt: str) -> subprocess.CompletedProcess:
    """`codex exec` unchanged, in tmp_path, with the server as a local provider (wire_api "responses")."""
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "tinyloop"\n\n[model_providers.tinyloop]\nname = "TinyLoop"\n'
        f'base_url = "{srv.url}/v1"\nenv_key = "TINYLOOP_KEY"\nwire_api = "responses"\n')
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "CODEX_HOME": str(home), "TINYLOOP_KEY": KEY}
    return subprocess.run([CODEX, "exec", "--skip-git-repo-check", prompt], env=env, cwd=tmp_path,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)


@NEEDS_CODEX
def test_codex_exec_runs_a_turn(tmp_path, tokenizer):
    """`codex exec` unchanged against the server (a local provider with wire_api "responses"), on a forced model
    whose answer under the generic tool format is known: `{"response": "Hi there."}` then end-of-text."""
    from .conftest import write_forced_model

    chain = tokenizer.encode(":") + tokenizer.encode('{"response": "Hi there."}') + [tokenizer.eos_id]
    model = write_forced_model(tmp_path / "forced32k.tinyloop", chain, tokenizer, max_seq_len=32768)
    with ServerThread(Settings(model_path=model, api_key=KEY)) as srv:
        run = codex_exec(srv, tmp_path, "Say hi")
    assert run.returncode == 0 and run.stdout.strip() == "Hi there.", (run.stdout[-2000:], run.stderr[-2000:])


def test_tool_turn_model_calls_until_the_result_comes_back(tmp_path, tokenizer):
    """The agent tests' model (conftest.write_agent_tool_model) through the Responses API as Codex drives it
    (streamed, tool_choice auto, parallel calls, a function among others): a function_call item while no result
    is in the conversation, the answer once the call's function_call_output carries the file's content."""
    from .conftest import ANSWER, MARKER, write_agent_tool_model

    model = write_agent_tool_model(tmp_path / "tools.tinyloop", tokenizer, "exec_command", {"cmd": "cat marker.txt"})
    cmd = {"type": "function", "name": "exec_command", "description": "Runs a command", "strict": False,
           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}},
                          "required": ["cmd"], "additionalProperties": False}}
    kw = dict(model=MODEL, tools=[cmd, CLOCK, WEATHER], tool_choice="auto", parallel_tool_calls=True)
    with ServerThread(Settings(model_path=model, api_key=KEY)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        ask = [{"role": "user", "content": "Show marker.txt"}]
        with client.responses.stream(**kw, input=ask) as s:
            first = s.get_final_response()
        (call,) = first.output
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "exec_command",
                                                                     {"cmd": "cat marker.txt"})
        again = client.responses.create(**kw, input=[*ask, call.model_dump(exclude_none=True), {
            "type": "function_call_output", "call_id": call.call_id, "output": "Process exited with code 1\nOutput:\n"}])
        assert [o.type for o in again.output] == ["function_call"]   # no marker: it calls again
        back = [*ask, call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                                           "output": f"Process exited with code 0\nOutput:\n{MARKER}\n"}]
        with client.responses.stream(**kw, input=back) as s:
            final = s.get_final_response()
    assert [o.type for o in final.output] == ["message"] and final.output_text == ANSWER


@NEEDS_CODEX
def test_codex_exec_runs_a_tool(tmp_path, tokenizer):
    """A tool call round trip through `codex exec` unchanged: the model (conftest.write_agent_tool_model) calls
    Codex's shell tool (exec_command, a function_call item) to cat a file only the tool can bring back; Codex runs
    it in its sandbox and sends the output as a function_call_output item in its next request, whereupon the model
    answers in text and Codex exits 0 with that answer."""
    from .conftest import ANSWER, MARKER, write_agent_tool_model

    model = write_agent_tool_model(tmp_path / "tools32k.tinyloop", tokenizer, "exec_command", {"cmd": "cat marker.txt"})
    (tmp_path / "marker.txt").write_text(MARKER + "\n")
    with ServerThread(Settings(model_path=model, api_key=KEY), record=True) as srv:
        run = codex_exec(srv, tmp_path, "Show marker.txt")
    assert run.returncode == 0 and run.stdout.strip() == ANSWER, (run.stdout[-2000:], run.stderr[-3000:])
    turns = [body for path, body in srv.requests if path == "/v1/responses"]
    assert len(turns) == 2 and all(t["stream"] and t["tool_choice"] == "auto" for t in turns), turns
    assert not any(i.get("type") == "function_call_output" for i in turns[0]["input"])
    call, output = turns[1]["input"][-2:]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "exec_command",
                                                                           {"cmd": "cat marker.txt"})
    assert output["type"] == "function_call_output" and output["call_id"] == call["call_id"]
    assert "exited with code 0" in output["output"] and MARKER in output["output"], output
    assert "cat marker.txt" in run.stderr and MARKER in run.stderr   # Codex's log of the command it ran
