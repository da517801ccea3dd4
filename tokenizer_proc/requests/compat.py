"""Declared OpenAI fields whose requested behaviour this server cannot give: a 400 naming the field.

Rule: a field that would change the result (suffix, the deprecated functions, the vLLM / SGLang
extensions of `_OUT_OF_SCOPE`) is never silently ignored; a field that changes nothing here is
declared in schemas.py and ignored. An out-of-scope field is refused only when it asks for
something: its neutral value (absent, null, false, an empty list, length_penalty 1) is accepted,
since clients send those by default.
"""

from __future__ import annotations

from typing import Any

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


# vLLM / SGLang request fields this server does not implement, with what each would need
_OUT_OF_SCOPE = {
    "use_beam_search": "there is no beam search",
    "length_penalty": "it applies to beam search, which there is not",
    "early_stopping": "it applies to beam search, which there is not",
    "include_stop_str_in_output": "a matched stop string is always cut from the output",
    "allowed_token_ids": "no restriction of the vocabulary beyond logit_bias and structured outputs",
    "bad_words": "no banned words beyond logit_bias",
    "logits_processors": "no custom logits processors",
    "custom_logit_processor": "no custom logit processors",
    "custom_params": "no custom logit processors to pass them to",
    "logprob_token_ids": "use logprobs / top_logprobs",
    "return_tokens_as_token_ids": "use return_token_ids",
    "cache_salt": "the prefix cache is shared by every request",
    "kv_transfer_params": "no disaggregated serving",
    "vllm_xargs": "no extensions read them",
    "repetition_detection": "no repetition detection",
    "watermarking": "no watermarking",
    "guided_whitespace_pattern": "structured JSON output has no free whitespace",
    "lora_path": "no LoRA adapters",
}
_COMPLETION_OUT_OF_SCOPE = {"prompt_embeds": "send text or token ids"}
_CHAT_OUT_OF_SCOPE = {"echo": "the answer does not repeat the last message"}


def _neutral(name: str, value: Any) -> bool:
    if name == "length_penalty":
        return value is None or value == 1.0
    return value is None or value is False or value == [] or value == {}


def _refuse_out_of_scope(body: object, more: dict[str, str]) -> None:
    for name, why in (_OUT_OF_SCOPE | more).items():
        if not _neutral(name, getattr(body, name, None)):
            raise bad_request(f"{name} is not supported by this server: {why}", name)
    modalities = getattr(body, "modalities", None)
    if modalities is not None and any(m != "text" for m in modalities):
        raise bad_request("modalities: only text output is supported by this server", "modalities")


def check_completion_fields(body: CompletionBody) -> None:
    if body.suffix:
        raise bad_request("suffix is not supported: the model has no fill-in-the-middle format", "suffix")
    _refuse_true(body, ("no_stop_trim", "return_hidden_states"))
    _refuse_out_of_scope(body, _COMPLETION_OUT_OF_SCOPE)


def check_chat_fields(body: ChatBody) -> None:
    if body.functions is not None or body.function_call is not None:
        raise bad_request("functions/function_call are deprecated and not supported; use tools", "functions")
    _refuse_true(body, ("no_stop_trim", "return_hidden_states"))
    _refuse_out_of_scope(body, _CHAT_OUT_OF_SCOPE)
