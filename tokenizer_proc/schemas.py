"""Request bodies of the HTTP API as msgspec Structs (typed decoding, unknown fields rejected).

`msgspec.json.decode(body, type=X)` does the type checks and names the offending field
(`... - at `$.sampling_params.top_k``); range and cross-field checks live in `validation.py`.
Fields are the SGLang native (`/generate`) and OpenAI (`/v1/...`) names; a few SGLang/vLLM
extensions (top_k, min_p, ignore_eos, stop_token_ids, skip_special_tokens) are accepted on the
OpenAI endpoints too.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# Every integer of a body is a signed 64-bit value, checked while decoding: a wider one is a 400
# naming its field (it could not be encoded for the scheduler, and no field means anything there).
Int = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]

# A prompt as OpenAI allows it: text, token ids, or a batch of either. Only batches of one are
# served (n=1, one prompt per request); validation rejects the others with a clear message.
PromptT = str | list[str | Int | list[Int]]
StopT = str | list[str]


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class NativeSamplingParams(_Body):
    max_new_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    stop: StopT | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool = False
    seed: Int | None = None
    skip_special_tokens: bool = True


class GenerateBody(_Body):
    """POST /generate (SGLang native)."""

    text: str | None = None
    input_ids: list[Int] | None = None
    sampling_params: NativeSamplingParams | None = None
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    priority: Int = 0


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAIBody(_Body):
    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    stop: StopT | None = None
    seed: Int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: bool = True


class CompletionBody(_OpenAIBody):
    """POST /v1/completions."""

    prompt: PromptT | None = None
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class ChatBody(_OpenAIBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
