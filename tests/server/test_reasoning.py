"""Reasoning output and XML tool calls (server/reasoning.py, server/tool_stream.py, engine/thinking.py): Nanbeige4.2's
tiny converted fixture served (its template opens `<think>` on the generation prompt and writes XML calls), a
Qwen-style template whose model opens `<think>` itself (a forced model: its greedy output is known), and the
parsers on their own with tricky inputs."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from .conftest import ServerThread
from test_hf_tokenizer import byte_level_json
from tinyloop.config import preset
from tinyloop.engine.thinking import THINK
from tinyloop.model import build_model
from tinyloop.modelfile.loader import write_model
from tinyloop.server.reasoning import ReasoningParser
from tinyloop.server.settings import Settings
from tinyloop.server.tool_stream import ToolCallParser, assemble, parse
from tinyloop.tokenizer import HFTokenizer

openai = pytest.importorskip("openai")
FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference" / "nanbeige-tiny"
MSGS = [{"role": "user", "content": "Hi"}]
UNIT = [{"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "kelvin"]}, "n": {"type": "integer",
                                                                                               "minimum": 1, "maximum": 9}},
    "required": ["unit", "n"]}}}]


@pytest.fixture(scope="module")
def nanbeige(tmp_path_factory):
    from tinyloop.tools.convert import convert

    path = convert(FIXTURE, tmp_path_factory.mktemp("nb") / "nb.tinyloop", dtype="float32", progress=False)
    with ServerThread(Settings(model_path=path)) as srv:
        yield srv


def chat(srv, stream=False, **kw):
    body = {"model": "nanbeige", "messages": MSGS, "max_tokens": 10, "temperature": 0, **kw}
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    if not stream:
        return client.chat.completions.create(**body, extra_body=kw.pop("extra_body", None)).model_dump()
    parts = {"reasoning_content": "", "content": "", "reasoning": ""}
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        d = chunk.choices[0].delta.model_dump() if chunk.choices else {}
        for k in parts:
            parts[k] += d.get(k) or (chunk.choices[0].delta.model_extra or {}).get(k) or ""
        for c in d.get("tool_calls") or []:
            got = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            got["name"] += (c.get("function") or {}).get("name") or ""
            got["arguments"] += (c.get("function") or {}).get("arguments") or ""
    return parts, calls


def post(srv, path, **body):
    return httpx.post(srv.url + path, json=body, timeout=60)


def extra(message, key):
    return message.get(key, (message.get("model_extra") or {}).get(key))


@pytest.mark.parametrize("kw", [{}, {"max_thinking_tokens": 3}, {"max_thinking_tokens": 0}])
def test_the_thinking_block_comes_apart_plain_and_streamed_alike(nanbeige, kw):
    r = post(nanbeige, "/v1/chat/completions", model="x", messages=MSGS, max_tokens=10, temperature=0, **kw).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"]
    parts = {"reasoning_content": "", "content": ""}
    with httpx.stream("POST", nanbeige.url + "/v1/chat/completions", json={
            "model": "x", "messages": MSGS, "max_tokens": 10, "temperature": 0, "stream": True, **kw}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])["choices"][0]["delta"]
                if "reasoning_content" in d:
                    assert d["reasoning"] == d["reasoning_content"]
                for k in parts:
                    parts[k] += d.get(k) or ""
    assert parts["reasoning_content"] == (msg["reasoning_content"] or "")
    assert parts["content"] == (msg["content"] or "")
    if not kw:   # never closed by the tiny model: all reasoning, cut by max_tokens
        assert msg["content"] is None and msg["reasoning_content"] and r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == r["usage"]["completion_tokens"] == 10
    else:
        assert msg["content"]
    if kw.get("max_thinking_tokens") == 0:
        assert msg["reasoning_content"] is None


def test_the_budget_forces_the_closing_tag_after_exactly_that_many_tokens(nanbeige):
    for k in (1, 4):
        r = post(nanbeige, "/v1/chat/completions", model="x", messages=MSGS, max_tokens=8, temperature=0,
                 max_thinking_tokens=k, logprobs=True).json()
        tokens = [t["token"] for t in r["choices"][0]["logprobs"]["content"]]
        assert tokens.index("</think>") == k and tokens.count("</think>") == 1
        assert r["usage"]["completion_tokens"] == 8
        # usage counts the block's tokens, its closing tag included (the prompt opened it)
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == k + 1
    low = post(nanbeige, "/v1/chat/completions", model="x", messages=MSGS, max_tokens=8, temperature=0,
               reasoning_effort="none", logprobs=True).json()
    assert low["choices"][0]["logprobs"]["content"][0]["token"] == "</think>"


def test_enable_thinking_off_gives_no_reasoning(nanbeige):
    r = post(nanbeige, "/v1/chat/completions", model="x", messages=MSGS, max_tokens=6, temperature=0,
             chat_template_kwargs={"enable_thinking": False}).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"]
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    on = post(nanbeige, "/tokenize", messages=MSGS).json()["count"]
    off = post(nanbeige, "/v1/chat/completions", model="x", messages=MSGS, max_tokens=1,
               chat_template_kwargs={"enable_thinking": False}).json()["usage"]["prompt_tokens"]
    assert off > on   # the template closed the block in the prompt


@pytest.mark.parametrize("body, param", [
    ({"max_thinking_tokens": -1}, "max_thinking_tokens"), ({"max_thinking_tokens": 9000}, "max_thinking_tokens"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"), ({"chat_template_kwargs": "on"}, "chat_template_kwargs")])
def test_bad_reasoning_fields_are_400_naming_them(nanbeige, body, param):
    r = post(nanbeige, "/v1/chat/completions", model="x", messages=MSGS, max_tokens=4, **body)
    assert r.status_code in (400, 422) and r.json()["error"]["param"].startswith(param), r.text


def test_responses_have_a_reasoning_item_streamed_as_plain(nanbeige):
    client = openai.OpenAI(base_url=nanbeige.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="x", input="Hi", max_output_tokens=8, temperature=0)
    plain = client.responses.create(**kw)
    assert plain.output[0].type == "reasoning" and plain.output[0].content[0].text and plain.status == "incomplete"
    assert plain.usage.output_tokens_details.reasoning_tokens == plain.usage.output_tokens == 8   # all thinking
    with client.responses.stream(**kw) as s:
        seen = list(s)
    events = [e.type for e in seen]
    final = seen[-1].response   # response.incomplete: max_output_tokens cut it
    assert "response.reasoning_text.delta" in events and "response.reasoning_text.done" in events
    assert [o.model_dump(exclude={"id"}) for o in final.output] == [o.model_dump(exclude={"id"}) for o in plain.output]
    none = client.responses.create(**kw, reasoning={"effort": "none"})   # a budget of 0: straight to the answer
    assert [o.type for o in none.output] == ["message"] and none.output_text
    r = post(nanbeige, "/v1/responses", model="x", input="Hi", reasoning={"effort": "huge"})
    assert r.status_code == 400 and "reasoning" in (r.json()["error"]["param"] or ""), r.text


def test_messages_have_thinking_blocks_streamed_as_plain(nanbeige):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=nanbeige.url, api_key="x", max_retries=0)
    kw = dict(model="x", max_tokens=10, messages=MSGS, thinking={"type": "enabled", "budget_tokens": 3},
              extra_body={"temperature": 0})
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    assert "thinking" in kinds or "content_block_delta" in kinds
    off = client.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]
    r = post(nanbeige, "/v1/messages", model="x", max_tokens=4, messages=MSGS,
             thinking={"type": "enabled", "budget_tokens": -5})
    assert r.status_code == 400 and "budget_tokens" in r.json()["error"]["message"], r.text


def test_xml_tool_calls_round_trip_under_required(nanbeige):
    sys = [{"role": "system", "content": "Use tools."}, *MSGS]
    body = dict(model="x", messages=sys, max_tokens=200, temperature=0, tools=UNIT, tool_choice="required",
                parallel_tool_calls=False,
                chat_template_kwargs={"enable_thinking": False})
    r = post(nanbeige, "/v1/chat/completions", **body).json()
    call = r["choices"][0]["message"]["tool_calls"][0]["function"]
    args = json.loads(call["arguments"])
    assert call["name"] == "set_unit" and args["unit"] in ("celsius", "kelvin") and 1 <= args["n"] <= 9
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    client = openai.OpenAI(base_url=nanbeige.url + "/v1", api_key="x", max_retries=0)
    with client.chat.completions.stream(**{k: v for k, v in body.items() if k != "chat_template_kwargs"},
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}}) as s:
        final = s.get_final_completion()
    got = final.choices[0].message.tool_calls[0].function
    assert (got.name, got.arguments) == (call["name"], call["arguments"])
    # thinking on, a budget: the block first, then the call the grammar holds
    r = post(nanbeige, "/v1/chat/completions", **{**body, "chat_template_kwargs": None, "max_thinking_tokens": 2}).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] and json.loads(msg["tool_calls"][0]["function"]["arguments"])["unit"]


# -- a Qwen-style template: the model opens the block itself ------------------------------------------------------
QWEN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
    tok = HFTokenizer(byte_level_json(specials), eos_ids=[0, 2], eos_token="<|endoftext|>", chat_template=QWEN)
    last = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)[-1]
    words = [tok.encode(w, add_special_tokens=False) for w in (" quick", " brown", " fox", " lazy")]
    assert all(len(w) == 1 for w in words), words
    chain = [last, 3, words[0][0], words[1][0], 4, words[2][0], words[3][0], 2]
    cfg = preset("tiny").replace(vocab_size=tok.vocab_size, tie_embeddings=False, eos_token_id=0, eos_token_ids=(2,))
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        for blk in [*model.prelude, *model.core, *model.coda]:
            blk.attn.wo.weight.zero_()
            blk.mlp.w_down.weight.zero_()
        model.embed.weight.zero_()
        model.lm_head.weight.zero_()
        for i, t in enumerate(chain[:-1]):
            model.embed.weight[t, i] = 1.0
            model.lm_head.weight[chain[i + 1], i] = 10.0
    path = write_model(tmp_path_factory.mktemp("qwen") / "q.tinyloop", model, tokenizer=tok)
    with ServerThread(Settings(model_path=path)) as srv:
        yield srv


def test_a_block_the_model_opens_itself_is_reasoning(qwen):
    r = post(qwen, "/v1/chat/completions", model="x", messages=MSGS, max_tokens=10, temperature=0).json()
    msg = r["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"], r["choices"][0]["finish_reason"]) == \
        ("quick brown", "fox lazy", "stop")
    # the block the output opened, tags included: its tokens up to "</think>", not the answer's
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4   # <think> quick brown </think>
    cut = post(qwen, "/v1/chat/completions", model="x", messages=MSGS, max_tokens=10, temperature=0,
               max_thinking_tokens=1).json()["choices"][0]["message"]
    assert cut["reasoning_content"] == "quick" and cut["content"] == "fox lazy"   # forced </think>, then the chain


def test_the_server_flag_is_read_and_checked():
    assert Settings.from_env({"TINYLOOP_REASONING_PARSER": "none"}).reasoning_parser == "none"
    with pytest.raises(SystemExit, match="TINYLOOP_REASONING_PARSER"):
        Settings.from_env({"TINYLOOP_REASONING_PARSER": "deepseek"})


# -- the parsers alone ---------------------------------------------------------------------------------------------
def reasoning_deltas(text: str, inside: bool, step: int):
    p = ReasoningParser(THINK, inside)
    out = []
    for i in range(0, len(text), step):
        out += p.feed(text[i:i + step])
    out += p.finish()
    return ("".join(d.get("reasoning_content", "") for d in out), "".join(d.get("content", "") for d in out))


@pytest.mark.parametrize("text, inside, want", [
    ("\nLet me think.\n</think>\n\nParis.", True, ("Let me think.", "Paris.")),
    ("<think>\nhm</think>ok", False, ("hm", "ok")),
    ("  <think>a < b </thi", False, ("a < b </thi", "")),    # cut short inside the block: all reasoning
    ("Paris, not <think>", False, ("", "Paris, not <think>")),  # no block at the start: all answer
    ("</think>x", True, ("", "x")), ("<thin", False, ("", "<thin")), ("", True, ("", ""))])
def test_the_reasoning_parser_reads_any_split_alike(text, inside, want):
    for step in (1, 2, 3, 7, len(text) or 1):
        assert reasoning_deltas(text, inside, step) == want, step


TOOLS = [{"name": "get", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "tags": {"type": "array"}}}}]


@pytest.mark.parametrize("text, content, calls", [
    ("ok\n<tool_call>\n<function=get>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", "ok",
     [("get", {"city": "Paris"})]),
    # a string that looks like a number stays a string; an integer parameter is a number; JSON arrays parse
    ("<tool_call>\n<function=get>\n<parameter=city>\n123\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
     "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n</function>\n</tool_call>", None,
     [("get", {"city": "123", "days": 3, "tags": ["a", "b"]})]),
    # multi-line values with markup inside, no newlines around the tags, a missing </parameter>
    ("<tool_call><function=get><parameter=city>a\n<b>c</b>\nd</parameter><parameter=days>2</function></tool_call>",
     None, [("get", {"city": "a\n<b>c</b>\nd", "days": 2})]),
    # two calls, one without parameters, text between them dropped; a JSON block beside them
    ("<tool_call>\n<function=now>\n</function>\n</tool_call>\nand\n<tool_call>\n{\"name\": \"get\", \"arguments\": "
     "{\"days\": 1}}\n</tool_call>", None, [("now", {}), ("get", {"days": 1})]),
    # an unknown parameter's value: JSON if it parses, else the text
    ("<tool_call>\n<function=get>\n<parameter=x>\ntrue\n</parameter>\n<parameter=y>\nnot json\n</parameter>\n"
     "</function>\n</tool_call>", None, [("get", {"x": True, "y": "not json"})]),
    ("<tool_call>\nnot a call\n</tool_call>", None, []),
])
def test_xml_tool_calls_are_parsed_plain_and_streamed(text, content, calls):
    for style in ("xml", "hermes"):
        got = parse(style, text, TOOLS)
        assert got[0] == content and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                      for c in got[1]] == calls
        for step in (1, 3, 5):
            p = ToolCallParser(style, TOOLS)
            deltas = []
            for i in range(0, len(text), step):
                deltas += p.feed(text[i:i + step])
            streamed = assemble(deltas + p.finish())
            assert streamed[0] == got[0]
            assert [c["function"] for c in streamed[1]] == [c["function"] for c in got[1]]


def test_an_xml_call_cut_short_keeps_what_is_complete():
    content, calls = parse("xml", "<tool_call>\n<function=get>\n<parameter=days>\n4\n</parameter>\n<parameter=ci", TOOLS)
    assert calls[0]["function"] == {"name": "get", "arguments": '{"days": 4'}
