"""vLLM / SGLang request fields of the OpenAI endpoints that shape the prompt or the answer, checked
and resolved here (each a 400 naming the field when it cannot be honoured):

- `truncate_prompt_tokens` (vLLM): N >= 1 keeps only the last N prompt tokens (`truncation_side`
  "right": the first N), -1 the last context-length tokens; larger than the context is a 400;
- `prompt_logprobs` (vLLM): in [0, MAX_TOP_LOGPROBS], the alternatives returned beside each prompt
  token's logprob (vLLM's -1, the whole vocabulary, is a 400);
- `stream_options.continuous_usage_stats` (vLLM): usage on every streamed chunk, and the final usage
  chunk unless `include_usage` is false (vLLM's default for include_usage is true);
- `continue_final_message` (vLLM / SGLang chat): needs an assistant message last, and no explicit
  `add_generation_prompt: true` (`generation_prompt` resolves the default);
- chat roles: any non-empty string (a custom role is rendered by the chat template, as vLLM does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.requests.schemas import ChatMessage, StreamOptions
from tokenizer_proc.requests.stop_regex import check_stop_regexes
from tokenizer_proc.requests.validation import MAX_TOP_LOGPROBS, Limits


def truncate_prompt(ids: list[int], body: Any, limits: Limits) -> list[int]:
    """`ids` cut to `truncate_prompt_tokens` (module doc); unchanged when it is not given."""
    n, side = body.truncate_prompt_tokens, body.truncation_side or "left"
    if n is None:
        return ids
    if n == -1:
        n = limits.context_length
    if n < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 or >= 1, got {n}", "truncate_prompt_tokens")
    if n > limits.context_length:
        raise bad_request(f"truncate_prompt_tokens ({n}) is larger than the context length {limits.context_length}",
                          "truncate_prompt_tokens")
    if len(ids) <= n:
        return ids
    return ids[-n:] if side == "left" else ids[:n]


def prompt_logprobs(body: Any) -> int:
    """The number of alternatives of each prompt token asked for by `prompt_logprobs`; -1: none."""
    n = body.prompt_logprobs
    if n is None:
        return -1
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {n}", "prompt_logprobs")
    return n


def usage_options(options: StreamOptions | None) -> tuple[bool, bool]:
    """(a final usage chunk, usage on every chunk) asked for by `stream_options`."""
    if options is None:
        return False, False
    if options.include_usage is None:
        return options.continuous_usage_stats, options.continuous_usage_stats
    return options.include_usage, options.include_usage and options.continuous_usage_stats


def generation_prompt(body: Any) -> bool:
    """Whether the chat prompt ends with the template's generation prompt: `add_generation_prompt`,
    by default true unless `continue_final_message`; both true is a 400."""
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true: the first "
                              "continues the last message, the second starts a new one", "add_generation_prompt")
        return False
    return True if body.add_generation_prompt is None else body.add_generation_prompt


def check_messages(messages: Sequence[ChatMessage], continue_final_message: bool) -> None:
    """Roles are non-empty; with `continue_final_message` the last message is the assistant's."""
    for i, m in enumerate(messages):
        if not m.role.strip():
            raise bad_request(f"messages[{i}].role must not be empty", f"messages[{i}].role")
    if continue_final_message and messages and messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs an assistant message last (the message to continue), "
                          f"got {messages[-1].role!r}", "continue_final_message")


def template_extra(body: Any) -> dict[str, Any] | None:
    """The template variables beyond messages and tools: chat_template_kwargs, plus `documents`."""
    extra = dict(body.chat_template_kwargs or {})
    if body.documents is not None:
        extra["documents"] = body.documents
    return extra or None


def request_template(body: Any, trusted: bool) -> str | None:
    """A request's own chat template (vLLM's `chat_template` field), refused unless the server trusts
    request templates (--trust-request-chat-template): a template is code the server runs."""
    if body.chat_template is None:
        return None
    if not trusted:
        raise bad_request("chat_template: a request's own chat template is rendered only when the server runs "
                          "with --trust-request-chat-template", "chat_template")
    if not body.chat_template.strip():
        raise bad_request("chat_template must not be empty", "chat_template")
    return body.chat_template


def answer_options(body: Any, prompt_lps: int) -> dict[str, Any]:
    """The PreparedRequest fields of an OpenAI body that shape its answer (usage, token ids, prompt
    logprobs, stop_regex, priority)."""
    final_usage, continuous = usage_options(body.stream_options)
    return {
        "include_usage": final_usage, "continuous_usage": continuous, "return_token_ids": body.return_token_ids,
        "prompt_logprobs": prompt_lps, "stop_regexes": check_stop_regexes(body.stop_regex, "stop_regex"),
        "priority": body.priority,
    }
