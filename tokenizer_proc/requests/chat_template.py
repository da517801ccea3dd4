"""Chat templates: Jinja templates from `tokenizer_config.json` rendered in a sandbox.

Source order: `--chat-template` (a file, or the name of one of the checkpoint's named templates), then
`chat_template` in tokenizer_config.json (a string, or a list of named templates of which "default"
is used), then a `chat_template.jinja` file beside it, then DEFAULT_CHAT_TEMPLATE.

DEFAULT_CHAT_TEMPLATE (documented default) is the Granite style the built-in model uses:
`<|start_of_role|>{role}<|end_of_role|>{content}<|end_of_text|>\\n` per message, and
`<|start_of_role|>assistant<|end_of_role|>` as the generation prompt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenizer_proc.make_builtin_tokenizer import GRANITE_STYLE_CHAT_TEMPLATE

DEFAULT_CHAT_TEMPLATE = GRANITE_STYLE_CHAT_TEMPLATE


class ChatTemplateError(ValueError):
    """The template cannot be compiled, or rendering these messages failed (message is one line)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def select_template(config: dict[str, Any], model_dir: str, choice: str = "") -> str:
    """The template source for a model (see module docstring for the order). `choice`
    (--chat-template) overrides it: a file, else the name of one of the checkpoint's named templates
    (ChatTemplateError naming what exists when it is neither)."""
    raw = config.get("chat_template")
    named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)} if isinstance(raw, list) else {}
    if choice:
        if os.path.isfile(choice):
            with open(choice, encoding="utf-8") as f:
                return f.read()
        if isinstance(named.get(choice), str):
            return named[choice]
        have = ", ".join(sorted(str(n) for n in named)) or "none"
        raise ChatTemplateError(f"--chat-template {choice!r} is not a file, nor one of the checkpoint's named chat "
                                f"templates ({have})")
    if isinstance(raw, list):
        raw = named.get("default") or next((v for v in named.values() if isinstance(v, str)), None)
    if isinstance(raw, str) and raw.strip():
        return raw
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return DEFAULT_CHAT_TEMPLATE


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to. Immutable."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self.source = source
        self._special = dict(special_tokens or {})

    def render(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render; `extra` (chat_template_kwargs) are more template variables, which cannot replace
        messages, tools or add_generation_prompt."""
        variables: dict[str, Any] = {"documents": None, **self._special, **(extra or {})}
        variables.update(messages=list(messages), add_generation_prompt=add_generation_prompt, tools=tools)
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from e
