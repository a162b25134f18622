"""The two formats tools reach a model in (server/structured.py), without a model: the Hermes `<tool_call>`
format of tool-aware chat templates (rendered with `tools`, held to the grammar, parsed back) and the generic
JSON format."""

from __future__ import annotations

import json

import pytest

from tinyloop.chat import Chat, render_template
from tinyloop.engine.constraint import Grammars
from tinyloop.errors import ValidationError
from tinyloop.server.structured import Tool, ToolPlan

HERMES = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
          "</tools>\nCall them inside <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
          "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
          "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}),
    Tool.model_validate({"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}})]


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, tokenizer.vocab_size)


def feed(grammars, constraint, text, tokenizer):
    m = grammars.matcher(constraint)
    for t in tokenizer.encode(text):
        if not m.allows(t):
            return m, False
        m.accept(t)
    return m, True


def test_hermes_renders_tools_holds_calls_to_the_grammar_and_parses_them(grammars, tokenizer):
    plan = ToolPlan.of(TOOLS, "required", None, HERMES)
    assert plan.style == "hermes" and plan.parallel   # OpenAI's default where the template knows tools
    chat = plan.chat(Chat(({"role": "user", "content": "1 + 2?"},)))
    prompt = render_template(HERMES, chat)
    assert '"name": "add"' in prompt and "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant")
    c = plan.constraint()
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    m, ok = feed(grammars, c, one, tokenizer)
    assert ok and m.allows(tokenizer.eos_id)
    assert not feed(grammars, c, "Sure! " + one, tokenizer)[1]                    # required: no text first
    assert not feed(grammars, c, one.replace('"b": 2', '"b": "two"'), tokenizer)[1]  # arguments validate
    assert not feed(grammars, c, one.replace('{"name"', '{\n"name"'), tokenizer)[1]   # no free whitespace
    assert feed(grammars, c, one + "\n" + one.replace("add", "now").replace('{"a": 1, "b": 2}', "{}"), tokenizer)[1]
    content, calls = plan.parse("Let me add.\n" + one)
    assert content == "Let me add." and [c["function"]["name"] for c in calls] == ["add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2} and calls[0]["id"].startswith("call_")
    auto = ToolPlan.of(TOOLS, "auto", None, HERMES)
    assert auto.constraint() is None and auto.parse("just words") == ("just words", [])


def test_generic_format(grammars, tokenizer):
    plan = ToolPlan.of(TOOLS, None, False, None)
    assert plan.style == "generic" and not plan.parallel and plan.choice == "auto"
    system = plan.chat(Chat(({"role": "user", "content": "hi"},))).messages[0]
    assert system["role"] == "system" and '{"response": <your answer>}' in system["content"]
    c = plan.constraint()
    assert feed(grammars, c, '{"response": "hello"}', tokenizer)[1]
    assert feed(grammars, c, '{"tool_calls": [{"name": "now", "arguments": {}}]}', tokenizer)[1]
    two = '{"tool_calls": [{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}]}'
    assert not feed(grammars, c, two, tokenizer)[1]          # parallel_tool_calls false: one call
    assert plan.parse('{"response": "hello"}') == ("hello", [])
    cut = plan.parse('{"tool_calls": [{"name": "now", "arguments": {"x')   # cut short: the call as far as it got
    assert cut[0] is None and [(c["function"]["name"], c["function"]["arguments"]) for c in cut[1]] == [("now", '{"x')]
    with pytest.raises(ValidationError):
        ToolPlan.of(None, "required", None, None)
    assert ToolPlan.of(TOOLS, "none", None, None) is None


def test_hermes_tool_schemas_rewritten_or_refused_by_keyword(grammars, tokenizer):
    """Inside a <tool_call> block the schema keywords llguidance lacks are rewritten as for response_format
    (engine/schema_rewrite.py); what would be left to a check after generation is a 400 naming it (calls in a
    block of text are not checked), and a oneOf that may overlap is refused in the API's words."""
    deps = Tool.model_validate({"type": "function", "function": {"name": "pay", "parameters": {
        "type": "object", "properties": {"card": {"type": "string"}, "zip": {"type": "string"},
                                         "note": {"type": "string", "format": "markdown"}},
        "dependentRequired": {"card": ["zip"]}, "propertyNames": {"enum": ["card", "zip", "note"]}}}})
    plan = ToolPlan.of([deps], "required", None, HERMES)
    c = plan.constraint()
    assert any("'markdown'" in w for w in grammars.check(c))
    call = '<tool_call>\n{"name": "pay", "arguments": %s}\n</tool_call>'
    assert feed(grammars, c, call % '{"card": "4111", "zip": "02139"}', tokenizer)[1]
    assert feed(grammars, c, call % '{"zip": "02139"}', tokenizer)[1]
    m, ok = feed(grammars, c, call % '{"card": "4111"}', tokenizer)
    assert not (ok and m.allows(tokenizer.eos_id))   # card without zip: the grammar does not let it end
    for schema, word in (({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems at #/"),
                         ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, "oneOf")):
        tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": schema}}}})
        with pytest.raises(ValidationError, match=word) as err:
            grammars.check(ToolPlan.of([tool], "required", None, HERMES).constraint())
        assert err.value.param == "tools" and err.value.code == "unsupported_schema"
        assert "coerce_one_of" not in str(err.value)
    exact = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"x": {"oneOf": [{"type": "object"}, {"type": "object", "required": ["a"]}]}}}}})
    c = ToolPlan.of([exact], "required", None, HERMES).constraint()   # overlapping, but written out exactly
    assert feed(grammars, c, call.replace("pay", "f") % '{"x": {"b": 1}}', tokenizer)[1]
    assert not feed(grammars, c, call.replace("pay", "f") % '{"x": {"a": 1}}', tokenizer)[1]  # both branches
