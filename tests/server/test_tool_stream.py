"""Tool calls streamed token by token (server/tool_stream.py): the parser's deltas add up to the same answer
however the text is cut into deltas; over HTTP, in both tool formats and for every tool_choice, parallel calls
included, the streamed deltas (the openai SDK's streaming helper puts them together) equal the non-streamed
answer, and a call's arguments arrive in fragments as they are generated; logprobs under tools, streamed
and not."""

from __future__ import annotations

import json
import random

import pytest

from conftest import varied_model
from test_hf_tokenizer import byte_level_json
from tinyloop.config import preset
from tinyloop.modelfile.loader import write_model
from tinyloop.server.settings import Settings
from tinyloop.server.tool_stream import ToolCallParser, assemble, parse
from tinyloop.tokenizer import HFTokenizer

from .conftest import ServerThread, wait_loaded
from .test_structured import MSGS, SCHEMA_OF, TOOLS, _check_calls
from .test_tool_formats import HERMES

openai = pytest.importorskip("openai")

CALL = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
OUTPUTS = {
    "hermes": [
        f"  Let me add.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
        '{"arguments": {"city": "P\\u00e9ra </t", "unit": "c"}, "name": "get_weather"}\n</tool_call>',
        "just words, no <tool_ call  ",
        "<tool_call>\n{\"name\": \"now\"}\n</tool_call>",
        f"<tool_call>\n{CALL[:-9]}",                      # cut short by max_tokens inside the arguments
        "a <tool_",
    ],
    "generic": [
        f'{{"tool_calls": [{CALL}, {{"name": "now", "arguments": {{}}}}]}}',
        '{"response": "caf\\u00e9 \\ud83d\\ude00, \\"quoted\\" \\\\ and a\\nnewline"}',
        '{"tool_calls": [{"name": "now", "arguments": {"x',
        '{"response": "cut \\ud83d',
    ],
}


def _calls(answer):
    return answer[0], [(c["function"]["name"], c["function"]["arguments"]) for c in answer[1]]


@pytest.mark.parametrize("style", ["hermes", "generic"])
def test_deltas_add_up_to_the_answer_however_the_text_is_cut(style):
    for text in OUTPUTS[style]:
        whole = _calls(parse(style, text))
        for seed in range(60):
            rnd, parser, deltas, i = random.Random(seed), ToolCallParser(style), [], 0
            while i < len(text):
                k = rnd.randint(1, 5)
                deltas += parser.feed(text[i:i + k])
                i += k
            deltas += parser.finish()
            assert _calls(assemble(deltas)) == whole, (text, seed)
    assert _calls(parse(style, OUTPUTS[style][0]))[1][0] == ("add", '{"a": 1, "b": 2}')


def test_what_each_format_answers():
    content, calls = _calls(parse("hermes", OUTPUTS["hermes"][0]))
    assert content == "Let me add." and calls == [
        ("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "P\\u00e9ra </t", "unit": "c"}')]  # raw text
    assert _calls(parse("hermes", OUTPUTS["hermes"][1])) == ("just words, no <tool_ call", [])
    assert _calls(parse("hermes", OUTPUTS["hermes"][2])) == (None, [("now", "{}")])   # no arguments: {}
    assert _calls(parse("hermes", OUTPUTS["hermes"][3])) == (None, [("add", '{"a": 1,')])
    assert _calls(parse("hermes", OUTPUTS["hermes"][4])) == ("a <tool_", [])
    assert _calls(parse("generic", OUTPUTS["generic"][1])) == ('café 😀, "quoted" \\ and a\nnewline', [])
    assert _calls(parse("generic", OUTPUTS["generic"][3])) == ("cut ", [])   # half a surrogate pair waits


def test_deltas_come_as_the_text_does():
    """Fed character by character: content as soon as it is known, a call's first delta (index, id, type,
    name, empty arguments) once its name is complete, then its arguments in fragments."""
    parser, seen = ToolCallParser("hermes"), []
    for ch in OUTPUTS["hermes"][0]:
        seen.append(parser.feed(ch))
    seen.append(parser.finish())
    flat = [d for ds in seen for d in ds]
    assert flat[0] == {"content": "L"}
    first = next(d for d in flat if "tool_calls" in d)["tool_calls"][0]
    assert set(first) == {"index", "id", "type", "function"} and first["function"] == {"name": "add", "arguments": ""}
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in flat
                 if "tool_calls" in d and d["tool_calls"][0]["index"] == 0 and "id" not in d["tool_calls"][0]]
    assert len(fragments) == len('{"a": 1, "b": 2}') and "".join(fragments) == '{"a": 1, "b": 2}'
    assert not any(d for d in seen[:len("  Let me add.\n<tool_call>\n{\"name\": \"ad")] if "tool_calls" in d)


# -- over HTTP ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory):
    """A tiny random model with a byte-level tokenizer and a Hermes (Qwen-style) template that knows tools."""
    tok = HFTokenizer(byte_level_json(), eos_ids=[0, 2], eos_token="<|endoftext|>", chat_template=HERMES)
    cfg = preset("tiny").replace(vocab_size=tok.vocab_size, eos_token_id=0, eos_token_ids=(2,), max_seq_len=2048)
    path = write_model(tmp_path_factory.mktemp("hermes") / "hermes.tinyloop", varied_model(cfg, seed=1),
                       tokenizer=tok)
    with ServerThread(Settings(model_path=path)) as srv:
        wait_loaded(srv.url)
        yield srv


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed(client, **kw):
    """The SDK's streaming helper: its final completion, how many chunks carried a piece of each call's
    arguments, and the logprobs it collected."""
    pieces: dict[int, int] = {}
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta" and event.arguments_delta:
                pieces[event.index] = pieces.get(event.index, 0) + 1
        try:
            final = stream.get_final_completion()
        except openai.LengthFinishReasonError as cut:   # the helper refuses to parse what max_tokens cut
            final = cut.completion
    return final.choices[0], pieces


CHOICES = ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.mark.parametrize("which", ["hermes", "generic"])
@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
def test_streamed_tool_calls_equal_the_answer_and_come_token_by_token(which, choice, request):
    client = _client(request.getfixturevalue({"hermes": "hermes_server", "generic": "tiny512_server"}[which]))
    max_tokens = 160 if which == "hermes" else 60
    incremental = 0
    for seed in range(2):
        kw = dict(model="tinyloop", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=max_tokens,
                  parallel_tool_calls=True, temperature=0.7, seed=seed, logprobs=True, top_logprobs=2)
        want = client.chat.completions.create(**kw).choices[0]
        got, pieces = _streamed(client, **kw)
        assert got.finish_reason == want.finish_reason
        assert got.message.content == want.message.content
        calls = [(t.function.name, t.function.arguments) for t in want.message.tool_calls or []]
        assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls or []] == calls
        if want.finish_reason == "tool_calls":
            assert want.message.content is None or which == "hermes"
            _check_calls(want.message.tool_calls, SCHEMA_OF)
        elif choice != "auto":
            assert want.finish_reason == "length"
        # logprobs: every generated token's, streamed and not, the same (to float rounding: the second
        # request finds its prompt in the prefix cache and prefills only the rest, a call of fewer rows
        # whose kernels sum in another order)
        assert [t.token for t in got.logprobs.content] == [t.token for t in want.logprobs.content]
        assert [t.logprob for t in got.logprobs.content] == \
            pytest.approx([t.logprob for t in want.logprobs.content], abs=1e-4)
        incremental += sum(n > 1 for i, n in pieces.items() if len(calls[i][1]) > 2)
    if choice != "auto":
        assert incremental, "no call's arguments came in more than one chunk"


def test_parallel_calls_stream_as_the_answer(hermes_server):
    """Hermes `required` with parallel calls: answers of two or more calls, streamed and not, the same. Eight
    seeds are compared, then seeds are searched (non-streamed) for an answer with two calls or more (about 1
    answer in 40 on this random model), which is compared too."""
    client, several = _client(hermes_server), 0
    for seed in range(200):
        kw = dict(model="tinyloop", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=240,
                  temperature=1.0, seed=seed)
        want = client.chat.completions.create(**kw).choices[0]
        parallel = len(want.message.tool_calls or []) >= 2 and want.finish_reason == "tool_calls"
        if seed >= 8 and not parallel:
            continue
        got, _ = _streamed(client, **kw)
        calls = [(t.function.name, t.function.arguments) for t in want.message.tool_calls or []]
        assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls or []] == calls
        assert [t.index for t in getattr(got.message, "tool_calls", None) or []] == list(range(len(calls)))
        several += parallel
        if several and seed >= 7:
            break
    assert several
