"""Structured output on the OpenAI routes: `response_format` and `tools` (docs/structured.md).

Both become a `Constraint` the engine core enforces token by token (engine/constraint.py), so what comes
back parses and validates, unless the output was cut short by `max_tokens` (`finish_reason: "length"`).

Tools reach the model in one of two formats:

- **hermes**, for chat templates that know tools (Qwen-derived: the template mentions `<tool_call>`): the
  template renders the `tools` variable as transformers passes it, and the model answers with
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks. `required` and named choices are
  held to that grammar; `auto` is free text, parsed afterwards.
- **generic**, for every other model (TinyLoop's own GPT-2 models, base checkpoints), as llama.cpp does: a
  system message lists the tools, and the output is one JSON object, constrained by a schema built from
  the tools: `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or, under `auto`, `{"response": "..."}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..chat import Chat
from ..engine.constraint import JSON_OPTIONS, Constraint
from ..engine.schema_rewrite import prepare
from ..errors import ValidationError
from .tool_stream import ToolCallParser, parse

STRICT = ConfigDict(strict=True)


# -- request bodies ------------------------------------------------------------------------------------------
class JSONSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the output is held to `schema` token by token (always, whatever
    `strict` says: the grammar cannot be broken, only cut short by max_tokens)."""
    model_config = ConfigDict(strict=True, populate_by_name=True, extra="forbid")
    name: str = Field("response", description="the schema's name (OpenAI requires one; not used)")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON schema (docs/structured.md: what is "
                                                                  "supported; other keywords are a 400 naming them)")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`text` (default), `json_object` (any JSON object) or `json_schema` (docs/structured.md)."""
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}}, "then": {"required": ["json_schema"]},
        "else": {"not": {"required": ["json_schema"]}}})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        if self.type != "json_schema" and "json_schema" in self.model_fields_set:
            raise ValidationError(f"response_format.json_schema: only with type json_schema (type is {self.type!r})",
                                  param="response_format.json_schema")
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint("json_object", param="response_format")
        if self.json_schema is None:
            raise ValidationError("response_format: type json_schema needs a json_schema object "
                                  '({"name": ..., "schema": {...}})', param="response_format")
        return Constraint.json_schema(self.json_schema.schema_, param="response_format")


class FunctionDef(BaseModel):
    model_config = STRICT
    name: str = Field(pattern="^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str = Field(description="the arguments as a JSON string, as OpenAI writes them")


class ToolCall(BaseModel):
    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# -- the plan: prompt, constraint, parsing --------------------------------------------------------------------
GENERIC_PROMPT = ("You can call functions. Reply with one JSON object and nothing else: "
                  '{{"tool_calls": [{{"name": <a function name>, "arguments": <its arguments>}}]}} to call {which}'
                  "{answer}.\nFunctions:\n{tools}")

@dataclass
class ToolPlan:
    """How one chat request's tools reach the model and come back. `style`: "generic" or "hermes"."""
    tools: list[FunctionDef]
    choice: str                         # auto | required | <a function's name>
    parallel: bool
    style: str

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None,
           template: str | None, template_kwargs: dict | None = None) -> "ToolPlan | None":
        """None when the request uses no tools (none given, or tool_choice "none")."""
        if choice is not None and not tools and choice != "none":
            raise ValidationError("tool_choice: needs tools", param="tool_choice")
        if not tools or choice == "none":
            return None
        fns = [t.function for t in tools]
        names = [f.name for f in fns]
        if len(set(names)) != len(names):
            raise ValidationError("tools: function names must be unique", param="tools")
        for f in fns:
            if f.parameters is not None and f.parameters.get("type", "object") != "object":
                raise ValidationError(f"tools: {f.name}'s parameters must be a JSON schema of an object",
                                      param="tools")
        picked = choice.function.name if isinstance(choice, NamedToolChoice) else (choice or "auto")
        if isinstance(choice, NamedToolChoice):
            if picked not in names:
                raise ValidationError(f"tool_choice: no tool is named {picked!r} (tools: {', '.join(names)})",
                                      param="tool_choice")
            fns = [f for f in fns if f.name == picked]
        style = tool_style(template, template_kwargs)
        # parallel calls: OpenAI's default (true) for templates that know tools; one call unless asked in the
        # generic format, as llama.cpp does (a base model asked for "one or more" rarely stops at one)
        return cls(fns, picked, (style != "generic") if parallel is None else parallel, style)

    # -- what the model sees ---------------------------------------------------------------------------------
    def openai_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.tools]

    def chat(self, chat: Chat) -> Chat:
        if self.style != "generic":  # the template renders them (transformers' `tools` variable)
            return Chat(chat.messages, tools=tuple(self.openai_tools()), template_kwargs=chat.template_kwargs)
        which = "one of them" if not self.parallel else "one or more of them"
        answer = ', or {"response": <your answer>} to answer without calling a function' \
            if self.choice == "auto" else ""
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in self.openai_tools())
        system = {"role": "system", "content": GENERIC_PROMPT.format(which=which, answer=answer, tools=listing)}
        return Chat((system, *chat.messages), template_kwargs=chat.template_kwargs)

    def _call_schema(self, f: FunctionDef) -> dict[str, Any]:
        """One call: the function's name and arguments under its parameters schema, which holds only the
        declared properties unless it says otherwise (`additionalProperties`), as OpenAI's strict mode has it."""
        args = dict(f.parameters or {"type": "object", "properties": {}})
        args.setdefault("additionalProperties", False)
        return {"type": "object", "properties": {"name": {"const": f.name}, "arguments": args},
                "required": ["name", "arguments"], "additionalProperties": False}

    def _calls_schema(self) -> dict[str, Any]:
        calls = [self._call_schema(f) for f in self.tools]
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {"type": "array", "items": items, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}

    def constraint(self, tokenizer=None) -> Constraint | None:
        """Generic: the reply's JSON schema. Hermes: `required`/named are one or more <tool_call> blocks
        (a Lark grammar around each call's schema); `auto` is free text. XML: the same blocks of XML calls.
        `tokenizer`: the model's; a tag that is one token of its own is written as that token (llguidance
        counts added tokens as special: a quoted tag would allow the token and then refuse it)."""
        self._tags = {t: t for t in (OPEN_TAG, CLOSE_TAG) if _one_token(tokenizer, t)}
        if self.style == "xml":
            if self.choice == "auto":
                return None
            warnings: list[str] = []
            return Constraint("grammar", self._xml_grammar(warnings), param="tools", warnings=tuple(warnings))
        if self.style == "hermes":
            if self.choice == "auto":
                return None
            warnings = []
            calls = [self._call_schema(f) for f in self.tools]
            # the JSON written as response_format's is (no free whitespace): llguidance's options in the schema
            held = _held(calls[0] if len(calls) == 1 else {"anyOf": calls}, warnings)
            one = json.dumps({**held, "x-guidance": JSON_OPTIONS})
            repeat = ' ("\\n" call)*' if self.parallel else ""
            lark = f'start: call{repeat}\ncall: {self._tag(OPEN_TAG)} "\\n" %json {one} "\\n" {self._tag(CLOSE_TAG)}\n'
            return Constraint("grammar", lark, param="tools", warnings=tuple(warnings))
        reply = {"type": "object", "properties": {"tool_calls": self._calls_schema()},
                 "required": ["tool_calls"], "additionalProperties": False}
        if self.choice == "auto":
            answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                      "additionalProperties": False}
            reply = {"anyOf": [reply, answer]}
        return Constraint.json_schema(reply, param="tools")

    def _xml_grammar(self, warnings: list[str]) -> str:
        """`required` / named calls in the XML format (a template's): per function its `<function=NAME>`,
        then each declared parameter as `<parameter=P>\nvalue\n</parameter>\n` in the schema's order (the required
        ones always, the others optional). A string's value is free text up to `</parameter>` (its `enum`, `const`
        or `pattern`, if any, held too); any other value is JSON under its schema, as the template writes it."""
        rules, calls = ["TEXT: /(.|\\n)*/"], []
        for i, f in enumerate(self.tools):
            params = f.parameters or {"type": "object", "properties": {}}
            props = params.get("properties") or {}
            required = set(params.get("required") or [])
            parts = []
            for j, (name, schema) in enumerate(props.items()):
                rule = f"p{i}_{j}"
                value = _xml_value(f.name, name, schema if isinstance(schema, dict) else {}, rule, rules, warnings)
                rules.append(f"{rule}: {json.dumps(f'<parameter={name}>' + chr(10))} {value}")
                parts.append(rule if name in required else f"{rule}?")
            calls.append(f"f{i}")
            head = f"{self._tag(OPEN_TAG)} {json.dumps(f'{chr(10)}<function={f.name}>{chr(10)}')}"
            rules.append(f"f{i}: {head} {' '.join(parts)} \"</function>\\n\" {self._tag(CLOSE_TAG)}")
        repeat = ' ("\\n" call)*' if self.parallel else ""
        return "\n".join([f"start: call{repeat}", f"call: {' | '.join(calls)}", *rules]) + "\n"

    def _tag(self, text: str) -> str:
        """A tag in a Lark grammar: the token itself where it is one, else its text."""
        return text if text in getattr(self, "_tags", {}) else json.dumps(text)

    # -- what comes back -------------------------------------------------------------------------------------
    def parser(self) -> ToolCallParser:
        """Reads one choice's output as it is generated (server/tool_stream.py): streamed deltas and the
        non-streamed message both come from it."""
        return ToolCallParser(self.style, self.tools)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of one choice's whole output."""
        return parse(self.style, text, self.tools)


OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


def _one_token(tokenizer, text: str) -> bool:
    if tokenizer is None:
        return False
    try:
        return len(tokenizer.encode(text, add_special_tokens=False)) == 1
    except TypeError:
        return False   # TinyLoop's GPT-2 tokenizer: no added tokens


STRING_OK = {"type", "enum", "const", "pattern", "description", "title", "default", "examples"}


def _held(schema: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    """A tool schema as the grammar holds it inside a tool-call block (engine/schema_rewrite.py: keywords
    llguidance lacks rewritten, unknown formats written as plain strings, with a warning). What it would
    leave loose is a 400: a call inside a block of text is not checked afterwards as response_format's
    answer is."""
    prepared = prepare(schema)
    if prepared.loose:
        raise ValidationError(f"tools: {prepared.loose[0]}: cannot be held while generating, and tool calls in this "
                              "model's tool format are not checked afterwards; remove it from the schema",
                              param="tools", code="unsupported_schema")
    warnings.extend(prepared.warnings)
    return prepared.schema


def _xml_value(fn: str, name: str, schema: dict[str, Any], rule: str, rules: list[str], warnings: list[str]) -> str:
    """The grammar of one XML parameter's value, with its closing `\n</parameter>\n`."""
    end = json.dumps("\n</parameter>\n")
    if schema.get("type") != "string":
        return f"%json {json.dumps({**_held(schema, warnings), 'x-guidance': JSON_OPTIONS})} {end}"
    extra = sorted(set(schema) - STRING_OK)
    if extra:
        raise ValidationError(f"tools: {fn}'s parameter {name!r}: the XML tool format writes a string as free text, "
                              f"so {', '.join(extra)} cannot be held to; remove it, or use tool_choice \"auto\"",
                              param="tools", code="unsupported_schema")
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return "(" + " | ".join(json.dumps(str(v)) for v in values) + f") {end}"
    if "pattern" in schema:
        rules.append(f"{rule.upper()}V: /{schema['pattern'].removeprefix('^').removesuffix('$')}/")
        return f"{rule.upper()}V {end}"
    rules.append(f"{rule}v[lazy]: TEXT {end}")
    return f"{rule}v"


def tool_style(template: str | None, template_kwargs: dict | None = None) -> str:
    """The tool format a chat template speaks: "xml" (`<tool_call>` blocks of `<function=NAME>`: e.g.
    Qwen3-Coder; a template's `tool_call_format: "json"` switch makes it "hermes"), "hermes" (JSON in
    `<tool_call>` blocks) or "generic" (no tool format: the JSON reply)."""
    if not template or "<tool_call>" not in template:
        return "generic"
    if "<function=" in template and (template_kwargs or {}).get("tool_call_format") != "json":
        return "xml"
    return "hermes"


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def message_for_template(m: dict[str, Any], style: str) -> dict[str, Any]:
    """A conversation message as a template that knows tools sees it: an assistant's earlier tool calls and a
    tool's result as transformers passes them (arguments as objects). The generic format shows a conversation's
    tool round trips otherwise: `generic_conversation`."""
    calls = m.get("tool_calls")
    out = {"role": m["role"], "content": m["content"]}
    if calls:
        out["tool_calls"] = [{"type": "function", "id": c["id"], "function": {
            "name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"]) or {}}} for c in calls]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


RESULTS = "Function results:"
RESULTS_CUE = "Answer with these results, or call another function if you still need one."


def generic_conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation as a model without a tool format sees it (the generic format): each tool round trip, an
    assistant's calls and the tools' results, on the user's side. After the user's message come `Function
    results:`, per result its call (`NAME {arguments}`) and `returned:` with what it returned, and a cue to answer
    with them; a later round adds its own block after that (what was shown stays as it was: the prefix cache keeps
    it). An assistant's text beside its calls stays its turn, and the results open a user turn of their own, so
    user and assistant still alternate. Written as the model's own earlier reply, a call is what a model not
    trained on tools copies: SmolLM2-135M-Instruct under Claude Code's and Codex's prompts called the same function
    again after its result in 12 of 12 conversations (P(answer) <= 0.01); shown this way it answered in 12 of 12
    (P 0.71-0.96; docs/structured.md, "The formats tools reach the model in")."""
    calls: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    block: list[str] = []   # the results of the round being read

    def close_round() -> None:
        if block:
            shown = "\n\n".join([RESULTS + "\n" + "\n\n".join(block), RESULTS_CUE])
            if out and out[-1]["role"] == "user":
                before = out[-1]["content"]
                out[-1] = {"role": "user", "content": f"{before}\n\n{shown}" if before else shown}
            else:
                out.append({"role": "user", "content": shown})
            block.clear()

    for m in messages:
        if m["role"] == "tool":
            block.append(f"{calls.get(m.get('tool_call_id'), 'A function')} returned:\n{m['content']}")
            continue
        close_round()
        if m["role"] == "assistant" and m.get("tool_calls"):
            for c in m["tool_calls"]:
                args = _loads(c["function"]["arguments"])
                shown = json.dumps(args, ensure_ascii=False) if args is not None else c["function"]["arguments"]
                calls[c["id"]] = f"{c['function']['name']} {shown}"
            if m["content"]:
                out.append({"role": "assistant", "content": m["content"]})
            continue
        out.append({"role": m["role"], "content": m["content"]})
    close_round()
    return out


def message_of(plan: ToolPlan, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
    """A chat choice's `message` and `finish_reason` under tools."""
    content, calls = plan.parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return message, finish_reason
