"""Chat prompts: a conversation rendered to the text a model was trained on.

A model file with a Hugging Face chat template (imported checkpoints, `tinyloop convert`) renders it with
Jinja2 the way transformers' `apply_chat_template` does: a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, `raise_exception`, `strftime_now`, a `tojson` filter that keeps
non-ASCII text, the tokenizer's special-token strings (`bos_token`, `eos_token`) as variables, and
`add_generation_prompt`. transformers' `{% generation %}...{% endgeneration %}` block (it marks assistant
text for training masks) is registered as a no-op block, as plain Jinja2 rejects it.

TinyLoop's own GPT-2 models are not chat-tuned and carry no template: a conversation becomes one
"Role: content" line per message and an "Assistant:" cue (`render_plain`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}
ASSISTANT_CUE = "Assistant:"


# the variables and functions the renderer itself gives a template: template_kwargs cannot replace them
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                      "strftime_now"})


class ChatTemplateError(ValueError):
    """A template that cannot render this conversation (its own `raise_exception`, or a Jinja error)."""


@dataclass(frozen=True)
class Chat:
    """A conversation to prompt with: `messages` are {"role": ..., "content": str} dicts, in order."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = ()   # OpenAI tool definitions, for templates that render them (`tools`)
    # More variables for the template, as transformers' apply_chat_template(**kwargs) passes them
    # (`enable_thinking`: Qwen-style templates). The template's own variables win.
    template_kwargs: dict | None = None

    def __post_init__(self):
        object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))
        object.__setattr__(self, "template_kwargs", dict(self.template_kwargs or {}))
        if not self.messages:
            raise ChatTemplateError("messages: must contain at least one message")


def render_plain(chat: Chat) -> str:
    """The template of models without one:

        System: You are terse.
        User: Capital of France?
        Assistant:
    """
    lines = [f"{ROLE_NAMES.get(m['role'], m['role'].title())}: {m['content']}" for m in chat.messages]
    return "\n".join(lines + [ASSISTANT_CUE])


@lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}body{% endgeneration %}` renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise ChatTemplateError(f"the model's chat template refused this conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_template(source: str, chat: Chat, *, bos_token: str | None = None, eos_token: str | None = None,
                    add_generation_prompt: bool = True) -> str:
    """The conversation through a Hugging Face chat template."""
    from jinja2 import TemplateError

    try:
        env = {k: v for k, v in chat.template_kwargs.items() if k not in RESERVED}
        if chat.tools:
            env["tools"] = [dict(t) for t in chat.tools]
        env.update(messages=[dict(m) for m in chat.messages], bos_token=bos_token or "", eos_token=eos_token or "",
                   add_generation_prompt=add_generation_prompt)
        return _compile(source).render(**env)
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template failed: {exc}") from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:   # a variable of a wrong type
        raise ChatTemplateError(f"the model's chat template failed: {type(exc).__name__}: {exc}") from None
