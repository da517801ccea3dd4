"""From a request body to the `PreparedRequest`s it asks for, for every endpoint (or ApiError 400): the one
place that builds them. Body Struct -> prompt tokens -> PreparedRequest, the checks from
tokenizer_proc.requests.validation.

Pure functions of (body, tokenizer, limits); they may run in a worker thread for long prompts.
Defaults for max new tokens: /generate 128 (SGLang), /v1/completions 16 (OpenAI), chat: as many
as the context allows (capped by --max-new-tokens-limit). Defaults are clamped to the context;
explicit values that do not fit are rejected.

The OpenAI endpoints and a batched /generate (`prepare_batch`) prepare a list: one `PreparedRequest` per
choice (`n` per prompt, several prompts on /v1/completions and a batch), indexed in order of prompts and
their choices (`prompt_index * n + i` when every prompt has the same n). Choice i of a request with a seed
samples with seed + i (so choices differ, and the whole response is reproducible); without a seed
each choice's rid seeds it (worker_proc/output/sampling.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from shared.messages import GrammarSpec, ImageInput, SamplingParams, ThinkingBudget
from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.requests.chat_template import ChatTemplateError
from tokenizer_proc.requests.compat import (
    check_chat_fields,
    check_completion_fields,
    check_generate_fields,
    sampling_seed,
)
from tokenizer_proc.requests.image_parts import place_images, template_content
from tokenizer_proc.requests.images import PromptImages
from tokenizer_proc.requests.peer_fields import (
    answer_options,
    check_messages,
    generation_prompt,
    prompt_logprobs,
    request_template,
    template_extra,
    truncate_prompt,
)
from tokenizer_proc.requests.reasoning import ReasoningPlan, grammar_after, plan_reasoning, thinking_budget
from tokenizer_proc.requests.schemas import ChatBody, CompletionBody, GenerateBody, NativeSamplingParams
from tokenizer_proc.requests.stop_regex import check_stop_regexes
from tokenizer_proc.requests.structured import native_grammar, openai_constraint, openai_grammar
from tokenizer_proc.requests.tokenizer import TextTokenizer
from tokenizer_proc.requests.tools import plan_tools, template_message_calls
from tokenizer_proc.requests.validation import (
    Limits,
    SamplingFields,
    build_sampling,
    check_rid,
    check_token_ids,
    new_rid,
    require,
)

GENERATE_DEFAULT_MAX_NEW = 128
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready to submit. `stops` are stop strings (matched here, not in
    the scheduler); `sampling.stop_token_ids` are matched by the scheduler."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stops: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False
    return_logprobs: bool = False
    priority: int = 0
    index: int = 0  # choice index in a response of several (OpenAI: prompt_index * n + i)
    prompt_index: int = 0  # which prompt of the request (usage counts each prompt once)
    echo: str | None = None  # the prompt text, returned before the output (completions echo)
    echo_only: bool = False  # echo with max_tokens 0: one token is computed and not returned
    save_prompt_state: bool = False  # the first choice of several with this prompt (prompt_sharing.py)
    keep: int = 0  # best_of > n: of this prompt's choices, the `keep` most likely are returned
    logprob_start_len: int = 0  # /generate: first prompt position of input_token_logprobs
    tool_plan: Any = None  # chat with tools: a tokenizer_proc.requests.tools.ToolPlan
    stop_regexes: tuple[str, ...] = ()  # SGLang stop_regex: the output ends where one of these matches
    return_token_ids: bool = False  # vLLM return_token_ids: prompt_token_ids and token_ids in the answer
    prompt_logprobs: int = -1  # vLLM prompt_logprobs: >= 0 returns them with this many alternatives each
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    reasoning: Any = None  # chat with --reasoning-parser: a tokenizer_proc.requests.reasoning.ReasoningPlan
    images: tuple[ImageInput, ...] = ()  # the prompt's images by offset, their tokens expanded in input_ids
    lora: str = ""  # the LoRA adapter it runs under, by name ("" = the base model; requests/adapters.py)


def _with_images(ids: list[int], images: PromptImages | None, limits: Limits,
                 param: str) -> tuple[list[int], tuple[ImageInput, ...]]:  # fmt: skip
    """The prompt with its images' tokens in place (image_parts.py; a 400 naming `param` on a mismatch)."""
    return place_images(ids, images, limits.vision, param)


def prepare_generate(body: GenerateBody, tok: TextTokenizer, limits: Limits,
                     images: PromptImages | None = None) -> PreparedRequest:  # fmt: skip
    """One /generate prompt; `images`: its loaded image_data (images.py), placed at its placeholders."""
    check_generate_fields(body)
    require(not (body.text is not None and body.input_ids is not None),
            "give either text or input_ids, not both", "text")
    require(not isinstance(body.text, list), "text must be a string here", "text")
    if body.input_ids is not None:
        require(all(isinstance(t, int) for t in body.input_ids), "input_ids must be token ids", "input_ids")
        ids = check_token_ids(body.input_ids, limits.vocab_size, "input_ids")  # type: ignore[arg-type]
        require(bool(ids), "input_ids must not be empty", "input_ids")
    elif body.text is not None:
        require(bool(body.text), "text must not be empty", "text")
        ids = tok.encode(body.text)  # type: ignore[arg-type]
        require(bool(ids), "text encodes to no tokens", "text")
    else:
        raise bad_request("one of text or input_ids is required", "text")
    ids, placed = _with_images(ids, images, limits, "text" if body.text is not None else "input_ids")
    sp = body.sampling_params or NativeSamplingParams()
    require(body.logprob_start_len == -1 or body.logprob_start_len >= 0, "logprob_start_len must be -1 or >= 0",
            "logprob_start_len")
    fields = SamplingFields(
        sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.stop, sp.stop_token_ids,
        sp.ignore_eos, sampling_seed(sp), prefix="sampling_params.", frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty, repetition_penalty=sp.repetition_penalty, logit_bias=sp.logit_bias,
        min_tokens=sp.min_new_tokens, min_tokens_name="min_new_tokens",
        top_logprobs=body.top_logprobs_num if body.return_logprob else 0, top_logprobs_name="top_logprobs_num",
        prompt_logprobs=body.top_logprobs_num if body.return_logprob and body.logprob_start_len >= 0 else -1,
        grammar=native_grammar(sp), sglang_wording=True,
    )
    sampling, stops = build_sampling(fields, len(ids), GENERATE_DEFAULT_MAX_NEW, limits, tok, body.return_logprob)
    return PreparedRequest(
        rid=check_rid(body.rid) if body.rid is not None else new_rid(),
        input_ids=ids, sampling=sampling, stops=stops, skip_special_tokens=sp.skip_special_tokens,
        stream=body.stream, return_logprobs=body.return_logprob, priority=body.priority,
        logprob_start_len=max(0, body.logprob_start_len),
        stop_regexes=check_stop_regexes(sp.stop_regex, "sampling_params.stop_regex"), images=placed,
    )


MAX_N = 128
MAX_PROMPTS = 256


def _one_prompt(prompt: str | list[int], tok: TextTokenizer, limits: Limits, param: str,
                special: bool = True) -> tuple[list[int], str]:  # fmt: skip
    """(token ids, text) of one prompt; text is the prompt string, or the decoded ids. `special`:
    add the tokenizer's special tokens to a text prompt (add_special_tokens)."""
    if isinstance(prompt, str):
        require(bool(prompt), f"{param} must not be empty", param)
        ids = tok.encode(prompt, add_special_tokens=special)
        require(bool(ids), f"{param} encodes to no tokens", param)
        return ids, prompt
    ids = check_token_ids(prompt, limits.vocab_size, param)
    require(bool(ids), f"{param} must not be empty", param)
    return ids, tok.decode(ids)


def _prompts(body: CompletionBody, tok: TextTokenizer, limits: Limits) -> list[tuple[list[int], str]]:
    """Every prompt of the request: a string, a list of token ids, or a batch (list) of either."""
    prompt = body.prompt
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        return [_one_prompt(prompt, tok, limits, "prompt", body.add_special_tokens)]
    require(bool(prompt), "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [_one_prompt(prompt, tok, limits, "prompt")]  # type: ignore[arg-type]
    if any(isinstance(p, int) for p in prompt):
        raise bad_request("prompt must be a string, a list of token ids, or a list of strings or of token-id "
                          "lists (not a mix of ids and prompts)", "prompt")
    require(len(prompt) <= MAX_PROMPTS, f"prompt has {len(prompt)} prompts; at most {MAX_PROMPTS}", "prompt")
    return [_one_prompt(p, tok, limits, f"prompt[{i}]", body.add_special_tokens)  # type: ignore[arg-type]
            for i, p in enumerate(prompt)]


def _check_common(body: CompletionBody | ChatBody) -> None:
    require(1 <= body.n <= MAX_N, f"n must be in [1, {MAX_N}], got {body.n}", "n")
    require(body.stream or body.stream_options is None,
            "stream_options is only allowed with stream=true", "stream_options")


def _choices(base: PreparedRequest, n: int, prompt_index: int, first: int, rid: str | None) -> list[PreparedRequest]:
    """`n` choices of one prompt, indexed from `first`: choice i of a seeded request samples with seed + i;
    each choice's rid is `<rid>-<index>` (`rid` None: the base's, for a request of one choice)."""
    out = []
    for i in range(n):
        index = first + i
        seed, sampling = base.sampling.seed, base.sampling
        if seed is not None and i > 0:
            sampling = msgspec.structs.replace(sampling, seed=(seed + i) % (1 << 63))
        out.append(replace(base, rid=base.rid if rid is None else f"{rid}-{index}", sampling=sampling, index=index,
                           prompt_index=prompt_index))
    return out


def _per_prompt(body: GenerateBody, prompts: int) -> list[NativeSamplingParams]:
    """Each prompt's sampling parameters: the one object for all, or a list of one per prompt (SGLang)."""
    sp = body.sampling_params
    if not isinstance(sp, list):
        return [sp or NativeSamplingParams()] * prompts
    require(len(sp) == prompts, f"sampling_params has {len(sp)} entries for {prompts} prompt(s): give one per "
            "prompt, or one object for all", "sampling_params")  # fmt: skip
    return sp


def _singles(body: GenerateBody) -> list[GenerateBody]:
    """One body per prompt (its sampling_params still the batch's)."""
    if isinstance(body.text, list):
        require(body.input_ids is None, "give either text or input_ids, not both", "text")
        return [msgspec.structs.replace(body, text=t, rid=None) for t in body.text]
    if body.input_ids and all(isinstance(t, list) for t in body.input_ids):
        return [msgspec.structs.replace(body, input_ids=ids, rid=None) for ids in body.input_ids]
    if body.input_ids and any(isinstance(t, list) for t in body.input_ids):
        raise bad_request("input_ids must be token ids or a list of token-id lists, not a mix", "input_ids")
    return [msgspec.structs.replace(body, rid=None)]


def prepare_batch(body: GenerateBody, tok: TextTokenizer, limits: Limits,
                  images: Sequence[PromptImages | None] = ()) -> list[PreparedRequest]:  # fmt: skip
    """A /generate body with several answers (tokenizer_proc.api.native_batch): one request per prompt and
    choice, rid `<rid>-<index>`, the index counting every prompt's choices in order. `images`: each prompt's
    (none given: no prompt has images)."""
    singles = _singles(body)
    field = "text" if isinstance(body.text, list) else "input_ids"
    require(bool(singles), f"{field} is an empty batch", field)
    params = _per_prompt(body, len(singles))
    listed = isinstance(body.sampling_params, list)
    for pi, sp in enumerate(params):
        name = f"sampling_params[{pi}].n" if listed else "sampling_params.n"
        require(1 <= sp.n <= MAX_N, f"{name} must be in [1, {MAX_N}], got {sp.n}", name)
    require(sum(sp.n for sp in params) <= 2 * MAX_N, f"at most {2 * MAX_N} answers per request",
            "sampling_params" if listed else "sampling_params.n")
    base_rid = body.rid if body.rid is not None else new_rid()
    out: list[PreparedRequest] = []
    for pi, (single, sp) in enumerate(zip(singles, params, strict=True)):
        base = prepare_generate(msgspec.structs.replace(single, sampling_params=msgspec.structs.replace(sp, n=1)),
                                tok, limits, images[pi] if images else None)  # fmt: skip
        out.extend(_choices(base, sp.n, pi, len(out), base_rid))
    return out


def prepare_completion(body: CompletionBody, tok: TextTokenizer, limits: Limits) -> list[PreparedRequest]:
    _check_common(body)
    check_completion_fields(body)
    prompts = _prompts(body, tok, limits)
    grammar = openai_grammar(body)
    want_logprobs = body.logprobs is not None
    top = body.logprobs or 0
    # echo with max_tokens 0 scores the prompt only (legacy OpenAI): one token is generated and dropped
    echo_only = body.echo and body.max_tokens == 0
    # best_of > n: best_of choices are generated per prompt and the n with the highest sum of
    # logprobs are returned (not streamable, as on OpenAI)
    best_of = body.best_of or body.n
    require(best_of >= body.n, f"best_of ({best_of}) must be >= n ({body.n})", "best_of")
    require(best_of <= MAX_N, f"best_of must be at most {MAX_N}", "best_of")
    require(best_of == body.n or not body.stream, "best_of > n cannot be streamed", "best_of")
    rid = new_rid("cmpl-")
    several = len(prompts) * best_of > 1
    plp = prompt_logprobs(body)
    out: list[PreparedRequest] = []
    for pi, (whole, text) in enumerate(prompts):
        _with_images(whole, None, limits, "prompt")  # no images here: a placeholder token is a 400
        ids = truncate_prompt(whole, body, limits)
        text = text if ids is whole else tok.decode(ids)
        fields = SamplingFields(
            1 if echo_only else body.max_tokens, body.temperature, body.top_p, body.top_k, body.min_p, body.stop,
            body.stop_token_ids,
            body.ignore_eos, body.seed, max_tokens_name="max_tokens", **_openai_extras(body, grammar),
            top_logprobs=top, top_logprobs_name="logprobs",
            prompt_logprobs=max(top if body.echo and want_logprobs else -1, plp),
        )
        sampling, stops = build_sampling(fields, len(ids), COMPLETION_DEFAULT_MAX_TOKENS, limits, tok,
                                         want_logprobs or best_of > body.n)
        base = PreparedRequest(
            rid=rid, input_ids=ids, sampling=sampling, stops=stops,
            skip_special_tokens=body.skip_special_tokens, stream=body.stream,
            return_logprobs=want_logprobs, echo=text if body.echo else None, echo_only=echo_only,
            keep=body.n if best_of > body.n else 0, **answer_options(body, plp),
        )
        out.extend(_choices(base, best_of, pi, pi * best_of, rid if several else None))
    return out


def _openai_extras(body: CompletionBody | ChatBody, grammar: GrammarSpec | None) -> dict[str, object]:
    return {
        "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty,
        "repetition_penalty": body.repetition_penalty, "logit_bias": body.logit_bias,
        "min_tokens": body.min_tokens, "grammar": grammar,
    }


def chat_messages(body: ChatBody) -> list[dict[str, object]]:
    if body.messages is None:
        raise bad_request("messages is required", "messages")
    require(bool(body.messages), "messages must not be empty", "messages")
    check_messages(body.messages, body.continue_final_message)
    out: list[dict[str, object]] = []
    for m in body.messages:
        content = template_content(m.content) if isinstance(m.content, list) else m.content or ""
        msg: dict[str, object] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = template_message_calls([
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls
            ])
        out.append(msg)
    return out


def _thinking(tokens: int, plan: ReasoningPlan | None, tok: TextTokenizer) -> ThinkingBudget | None:
    require(plan is not None, "thinking_token_budget needs a reasoning model served with --reasoning-parser",
            "thinking_token_budget")
    require(tokens >= 0, "thinking_token_budget must be >= 0", "thinking_token_budget")
    assert plan is not None  # for the type checker: required above
    return thinking_budget(plan, tokens, lambda text: tok.encode(text, add_special_tokens=False))


def prepare_chat(body: ChatBody, tok: TextTokenizer, limits: Limits,
                 images: PromptImages | None = None) -> list[PreparedRequest]:  # fmt: skip
    """The choices of one chat request; `images`: its image parts loaded (images.py), in message order."""
    _check_common(body)
    check_chat_fields(body)
    require(body.max_tokens is None or body.max_completion_tokens is None,
            "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    require(body.logprobs or not body.top_logprobs, "top_logprobs requires logprobs=true", "top_logprobs")
    messages = chat_messages(body)
    plan = plan_tools(body, tok.chat.tool_call_parser)
    named = openai_constraint(body)
    grammar = named[1] if named is not None else None
    if plan.grammar is not None:
        if named is not None:
            raise bad_request(f"{named[0]} cannot be combined with a required or named tool_choice", named[0])
        grammar = plan.grammar
    own = request_template(body, tok.chat.trust_request_template)
    try:
        text = tok.render_chat(messages, add_generation_prompt=generation_prompt(body), extra=template_extra(body),
                               tools=plan.template_tools, continue_final_message=body.continue_final_message,
                               template=own)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages" if own is None else "chat_template") from e
    whole, placed = _with_images(tok.encode(text, add_special_tokens=body.add_special_tokens), images, limits,
                                 "messages")  # fmt: skip
    ids = truncate_prompt(whole, body, limits)
    require(bool(ids), "messages encode to no tokens", "messages")
    require(not placed or ids is whole, "truncate_prompt_tokens cannot cut a prompt with images",
            "truncate_prompt_tokens")
    reasoning = plan_reasoning(tok.chat.reasoning_parser, text, body.separate_reasoning, body.stream_reasoning,
                               body.include_reasoning)
    if grammar is not None and (after := grammar_after(reasoning)):  # constrain the answer, not the thinking
        grammar = msgspec.structs.replace(grammar, after=tuple(tok.encode(after, add_special_tokens=False)))
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    fields = SamplingFields(
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        body.temperature, body.top_p, body.top_k, body.min_p, body.stop, body.stop_token_ids,
        body.ignore_eos, body.seed, max_tokens_name=name, **_openai_extras(body, grammar),
        top_logprobs=body.top_logprobs or 0, prompt_logprobs=(plp := prompt_logprobs(body)),
    )
    sampling, stops = build_sampling(fields, len(ids), None, limits, tok, body.logprobs)
    if body.thinking_token_budget is not None:
        budget = _thinking(body.thinking_token_budget, reasoning, tok)
        sampling = msgspec.structs.replace(sampling, thinking_budget=budget)
    base = PreparedRequest(
        rid=new_rid("chatcmpl-"), input_ids=ids, sampling=sampling, stops=stops,
        skip_special_tokens=body.skip_special_tokens, stream=body.stream, **answer_options(body, plp),
        return_logprobs=body.logprobs, tool_plan=plan if plan.mode else None, reasoning=reasoning, images=placed,
    )
    return _choices(base, body.n, 0, 0, base.rid if body.n > 1 else None)
