"""Declared OpenAI fields whose requested behaviour this server cannot give: a 400 naming the field.

Rule: a field that would change the result (suffix, the deprecated functions) is never silently
ignored; a field that changes nothing here is declared in schemas.py and ignored.
"""

from __future__ import annotations

from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.requests.schemas import ChatBody, CompletionBody, GenerateBody

_GENERATE_UNSUPPORTED = ("return_text_in_logprobs", "return_hidden_states", "return_bytes", "return_entropy",
                         "background")  # fmt: skip


def _refuse_true(body: object, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(body, name):
            raise bad_request(f"{name} is not supported by this server", name)


def check_generate_fields(body: GenerateBody) -> None:
    _refuse_true(body, _GENERATE_UNSUPPORTED)


def check_completion_fields(body: CompletionBody) -> None:
    if body.suffix:
        raise bad_request("suffix is not supported: the model has no fill-in-the-middle format", "suffix")
    _refuse_true(body, ("no_stop_trim", "return_hidden_states"))


def check_chat_fields(body: ChatBody) -> None:
    if body.functions is not None or body.function_call is not None:
        raise bad_request("functions/function_call are deprecated and not supported; use tools", "functions")
    _refuse_true(body, ("no_stop_trim", "return_hidden_states", "continue_final_message"))
