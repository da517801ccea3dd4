"""Request bodies of the HTTP API as msgspec Structs (typed decoding).

`msgspec.json.decode(body, type=X)` does the type checks and names the offending field
(`... - at `$.sampling_params.top_k``); range and cross-field checks live in `validation.py`.
Fields are the SGLang native (`/generate`) and OpenAI (`/v1/...`) names; the SGLang/vLLM
extensions (top_k, min_p, ignore_eos, stop_token_ids, skip_special_tokens, repetition_penalty,
min_tokens, chat_template_kwargs) are accepted on the OpenAI endpoints too.

Every field a route reads is declared here or in its base (schemas_peer.py); any other field is a
400 naming it (fields.py: OpenAI's "Unrecognized request argument supplied"), where vLLM and SGLang
would ignore it. Fields that change nothing here (metadata, store, service_tier, user,
reasoning_effort, prediction, modalities "text", request_id, session_id, rid,
spaces_between_special_tokens, ...) are declared so they are type-checked and then ignored; OpenAI /
vLLM / SGLang fields out of scope are declared so that any value but their neutral one is a 400
naming them (compat.py). Chat messages and tool definitions are content (`open_keys`): keys beyond
their declared ones are not refused.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from tokenizer_proc.requests.schemas_peer import (
    GeneratePeerFields,
    Int,
    OpenAIPeerFields,
    ResponsesPeerFields,
    Seed,
)

# Every integer of a body is a signed 64-bit value (`Int`, schemas_peer.py), checked while decoding: a
# wider one is a 400 naming its field (it could not be encoded for the scheduler, and no field means
# anything there). Seeds (`Seed`) decode at any size and are range-checked with the range they take.

# A prompt as OpenAI allows it: text, token ids, or a batch of either (each prompt of a batch is
# an independent request).
PromptT = str | list[str | Int | list[Int]]
StopT = str | list[str]


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
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
    seed: Seed | None = None
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: Int = 0
    n: Int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: StopT | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: Seed | None = None  # SGLang's name of seed
    spaces_between_special_tokens: bool = True  # fast tokenizers never put spaces between special tokens
    stream_interval: Int | None = None  # tokens per streamed chunk: the stream's chunking is this server's
    # SGLang fields out of scope: a true / non-null value is a 400 (compat.py)
    no_stop_trim: bool = False
    structural_tag: Any = None
    custom_params: Any = None


class GenerateBody(GeneratePeerFields):
    """POST /generate (SGLang native)."""

    text: str | list[str] | None = None  # a list: a batch, one answer each (native_batch.py)
    input_ids: list[Int | list[Int]] | None = None  # flat: one prompt; a list of lists: a batch
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None  # a list: one per prompt
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: Int = 0
    logprob_start_len: Int = -1
    priority: Int = 0
    # SGLang fields that sglang-router writes into every request it forwards (with these values):
    # logging-only ones are ignored; a true value of the others is a 400 (compat.py)
    model: str | None = None
    log_metrics: bool = True
    no_logs: bool = False
    return_text_in_logprobs: bool = False
    return_hidden_states: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    background: bool = False


class StreamOptions(_Body):
    include_usage: bool | None = None  # None: only with continuous_usage_stats (vLLM's default is true)
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # OpenAI's stream padding: accepted, never added here


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (>= 0.11): one constraint (structured.py); the options change
    nothing here (no fallback, compact JSON, no properties beyond a schema's) but whitespace_pattern
    and structural_tag, which are a 400."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: Any = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class _OpenAIBody(OpenAIPeerFields):
    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    stop: StopT | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int = 1
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: Int = 0
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted and ignored: they change nothing a model server computes
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    prediction: Any = None
    modalities: list[str] | None = None
    # SGLang extensions sglang-router writes into every request it forwards (a true value is a 400)
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    # vLLM / SGLang extensions (peer_fields.py, structured.py, stop_regex.py)
    structured_outputs: StructuredOutputs | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: StopT | None = None
    prompt_logprobs: Int | None = None
    return_token_ids: bool = False
    truncate_prompt_tokens: Int | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: Int = 0
    spaces_between_special_tokens: bool = True  # fast tokenizers never put spaces between special tokens
    request_id: str | None = None  # identifiers: accepted and ignored
    rid: str | None = None


class CompletionBody(_OpenAIBody):
    """POST /v1/completions."""

    prompt: PromptT | None = None
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None  # out of scope: a 400 (compat.py)
    json_schema: Any = None  # SGLang's; out of scope here: use response_format (compat.py)
    thinking_token_budget: Any = None  # vLLM's, for reasoning models' completions: out of scope


# The parts of a chat message's content list, told apart by their `type` (any other type is a 400 naming it)
class TextPart(_Body, tag_field="type", tag="text"):
    text: str


class ImageUrl(_Body):
    url: str  # a data:image/...;base64, URL or an http(s) URL (image_fetch.py)
    detail: str | None = None  # OpenAI's resolution hint: the checkpoint's image processor decides the size


class ImagePart(_Body, tag_field="type", tag="image_url"):
    """An image of a message (requests/image_parts.py): `{"url": ...}`, or the URL alone."""

    image_url: str | ImageUrl


class VideoPart(_Body, tag_field="type", tag="video_url"):
    """Declared so that it is refused by name: video input is not supported."""

    video_url: Any = None


ContentPart = TextPart | ImagePart | VideoPart


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"


class ToolCall(_Body):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(_Body):
    """One chat message: content, so keys beyond these are not refused (fields.py) but unused."""

    open_keys: ClassVar[bool] = True
    role: str  # system, developer, user, assistant, tool, or a custom role the template renders
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    """A chat tool: keys beyond these are not refused (fields.py) but unused."""

    open_keys: ClassVar[bool] = True
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    function: NamedToolChoiceFunction
    type: Literal["function"] = "function"


class ChatBody(_OpenAIBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None  # None: true unless continue_final_message (generation_prompt)
    functions: Any = None
    function_call: Any = None
    continue_final_message: bool = False  # the model continues the last (assistant) message
    add_special_tokens: bool = False  # vLLM: special tokens beyond the template's (a BOS) are added
    documents: list[dict[str, Any]] | None = None  # vLLM: the template's `documents` (RAG)
    echo: Any = None  # vLLM's chat echo: out of scope, a true value is a 400 (compat.py)
    separate_reasoning: bool = True  # with --reasoning-parser: reasoning_content apart from content (reasoning.py)
    stream_reasoning: bool = True
    include_reasoning: bool = True  # vLLM: false drops reasoning_content from the answer (reasoning.py)
    thinking_token_budget: Int | None = None  # vLLM: the reasoning is ended after this many tokens
    chat_template: str | None = None  # vLLM: the request's own template, with --trust-request-chat-template
    # SGLang chat fields out of scope: a non-neutral value is a 400 (compat.py)
    return_prompt_token_ids: Any = None
    return_meta_info: Any = None
    task: Any = None
    input_ids: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    use_audio_in_video: Any = None


class TokenizeBody(_Body):
    """POST /tokenize (vLLM/SGLang): a prompt, or chat messages rendered by the template as the chat
    endpoint renders them (tools, chat_template_kwargs, continue_final_message)."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False
    chat_template: str | None = None
    mm_processor_kwargs: Any = None  # vLLM's; out of scope: a non-empty value is a 400
    media_io_kwargs: Any = None


class DetokenizeBody(_Body):
    """POST /detokenize (vLLM/SGLang)."""

    tokens: list[Int]
    model: str | None = None
    skip_special_tokens: bool = False  # SGLang's: special tokens left out of the text


class ResponseFormat(_Body):
    """`text.format` of a Responses request: text, json_object, or json_schema (name, schema, strict)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseText(_Body):
    format: ResponseFormat | None = None
    verbosity: str | None = None  # a hint for OpenAI's own models: ignored


class ResponsesStreamOptions(_Body):
    include_obfuscation: bool | None = None  # OpenAI's stream padding: accepted, never added here


class ResponsesBody(ResponsesPeerFields):
    """POST /v1/responses (the OpenAI Responses API). `input` items and `tools` are checked item by
    item where they are turned into chat messages (responses_input.py), naming the item at fault.
    The vLLM / SGLang sampling extensions their Responses requests accept are passed to the chat
    request that computes the response."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Seed | None = None
    repetition_penalty: float | None = None
    stop: StopT | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: ResponseText | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    background: bool = False
    include: list[str] | None = None
    # accepted and ignored, as on chat: hints for OpenAI's own models
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    stream_options: ResponsesStreamOptions | None = None
    # vLLM / SGLang extensions, as on chat
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: Int = 0
