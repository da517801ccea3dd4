"""Per-endpoint preparation: body Struct -> prompt tokens -> PreparedRequest (or ApiError 400).

Pure functions of (body, tokenizer, limits); they may run in a worker thread for long prompts.
Defaults for max new tokens: /generate 128 (SGLang), /v1/completions 16 (OpenAI), chat: as many
as the context allows (capped by --max-new-tokens-limit). Defaults are clamped to the context;
explicit values that do not fit are rejected.
"""

from __future__ import annotations

from tokenizer_proc.chat_template import ChatTemplateError
from tokenizer_proc.errors import bad_request
from tokenizer_proc.schemas import ChatBody, CompletionBody, GenerateBody, NativeSamplingParams
from tokenizer_proc.tokenizer import TextTokenizer
from tokenizer_proc.validation import (
    Limits,
    PreparedRequest,
    SamplingFields,
    build_sampling,
    check_rid,
    check_token_ids,
    new_rid,
    reject_unsupported,
    require,
)

GENERATE_DEFAULT_MAX_NEW = 128
COMPLETION_DEFAULT_MAX_TOKENS = 16


def prepare_generate(body: GenerateBody, tok: TextTokenizer, limits: Limits) -> PreparedRequest:
    require(not (body.text is not None and body.input_ids is not None),
            "give either text or input_ids, not both", "text")
    if body.input_ids is not None:
        ids = check_token_ids(body.input_ids, limits.vocab_size, "input_ids")
        require(bool(ids), "input_ids must not be empty", "input_ids")
    elif body.text is not None:
        require(bool(body.text), "text must not be empty", "text")
        ids = tok.encode(body.text)
        require(bool(ids), "text encodes to no tokens", "text")
    else:
        raise bad_request("one of text or input_ids is required", "text")
    sp = body.sampling_params or NativeSamplingParams()
    fields = SamplingFields(
        sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.stop, sp.stop_token_ids,
        sp.ignore_eos, sp.seed, prefix="sampling_params.",
    )
    sampling, stops = build_sampling(fields, len(ids), GENERATE_DEFAULT_MAX_NEW, limits, tok, body.return_logprob)
    return PreparedRequest(
        rid=check_rid(body.rid) if body.rid is not None else new_rid(),
        input_ids=ids, sampling=sampling, stops=stops, skip_special_tokens=sp.skip_special_tokens,
        stream=body.stream, return_logprobs=body.return_logprob, priority=body.priority,
    )


def _prompt_ids(body: CompletionBody, tok: TextTokenizer, limits: Limits) -> list[int]:
    prompt = body.prompt
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        text: str | None = prompt
    elif prompt and all(isinstance(p, int) for p in prompt):
        return check_token_ids(prompt, limits.vocab_size, "prompt")  # type: ignore[arg-type]
    elif len(prompt) == 1 and isinstance(prompt[0], str):
        text = prompt[0]
    elif len(prompt) == 1 and isinstance(prompt[0], list):
        ids = check_token_ids(prompt[0], limits.vocab_size, "prompt")
        require(bool(ids), "prompt must not be empty", "prompt")
        return ids
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    else:
        raise bad_request("prompt must be a string, a list of token ids, or a list of one of those "
                          "(batches of several prompts are not supported)", "prompt")
    require(bool(text), "prompt must not be empty", "prompt")
    ids = tok.encode(text or "")
    require(bool(ids), "prompt encodes to no tokens", "prompt")
    return ids


def _common_openai_checks(body: CompletionBody | ChatBody) -> None:
    require(body.n == 1, f"n={body.n} is not supported (only n=1)", "n")
    reject_unsupported(body, {"frequency_penalty": 0.0, "presence_penalty": 0.0})
    require(body.stream or body.stream_options is None,
            "stream_options is only allowed with stream=true", "stream_options")


def prepare_completion(body: CompletionBody, tok: TextTokenizer, limits: Limits) -> PreparedRequest:
    _common_openai_checks(body)
    reject_unsupported(body, {"echo": False, "best_of": 1})
    require(body.suffix is None, "suffix is not supported", "suffix")
    require(body.logprobs is None or body.logprobs == 0,
            "logprobs: only 0 (the sampled token's log-probability) is supported", "logprobs")
    ids = _prompt_ids(body, tok, limits)
    fields = SamplingFields(
        body.max_tokens, body.temperature, body.top_p, body.top_k, body.min_p, body.stop, body.stop_token_ids,
        body.ignore_eos, body.seed, max_tokens_name="max_tokens",
    )
    want_logprobs = body.logprobs is not None
    sampling, stops = build_sampling(fields, len(ids), COMPLETION_DEFAULT_MAX_TOKENS, limits, tok, want_logprobs)
    return PreparedRequest(
        rid=new_rid("cmpl-"), input_ids=ids, sampling=sampling, stops=stops,
        skip_special_tokens=body.skip_special_tokens, stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        return_logprobs=want_logprobs,
    )


def _chat_messages(body: ChatBody) -> list[dict[str, str]]:
    if body.messages is None:
        raise bad_request("messages is required", "messages")
    require(bool(body.messages), "messages must not be empty", "messages")
    out = []
    for m in body.messages:
        if isinstance(m.content, list):
            content = "".join(part.text for part in m.content)
        else:
            content = m.content or ""
        out.append({"role": m.role, "content": content})
    return out


def prepare_chat(body: ChatBody, tok: TextTokenizer, limits: Limits) -> PreparedRequest:
    _common_openai_checks(body)
    require(body.max_tokens is None or body.max_completion_tokens is None,
            "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    require(not body.top_logprobs, "top_logprobs is not supported (only the sampled token's logprob)",
            "top_logprobs")
    messages = _chat_messages(body)
    try:
        text = tok.render_chat(messages)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from e
    ids = tok.encode(text, add_special_tokens=False)
    require(bool(ids), "messages encode to no tokens", "messages")
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    fields = SamplingFields(
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        body.temperature, body.top_p, body.top_k, body.min_p, body.stop, body.stop_token_ids,
        body.ignore_eos, body.seed, max_tokens_name=name,
    )
    sampling, stops = build_sampling(fields, len(ids), None, limits, tok, body.logprobs)
    return PreparedRequest(
        rid=new_rid("chatcmpl-"), input_ids=ids, sampling=sampling, stops=stops,
        skip_special_tokens=body.skip_special_tokens, stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        return_logprobs=body.logprobs,
    )
