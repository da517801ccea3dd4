"""What a Responses request (POST /v1/responses) asks for, as the chat request that computes it.

Rules:
- the conversation is the stored conversation of `previous_response_id` (its inputs and outputs,
  without its instructions: OpenAI carries instructions over only when given again), then this
  request's `instructions` as the first (system) message, then its `input`: a string is one user
  message; items are messages (`role` system / developer / user / assistant, content a string or
  `input_text` / `output_text` parts and `input_image` parts (`image_url`: a data: or http(s) URL, the chat
  request's `image_url` part; a `file_id` is a 400: no stored files); `type` "message" or absent),
  `function_call` items (an assistant tool call) and `function_call_output` items (the tool message
  answering `call_id`);
- `tools` are function tools (flat: name, description, parameters, strict); `tool_choice` none / auto
  / required or {"type": "function", "name": ...}; `text.format` json_object / json_schema is the chat
  `response_format`; `max_output_tokens` is max_tokens; the vLLM / SGLang sampling extensions their
  Responses requests accept (top_k, min_p, seed, repetition_penalty, frequency_penalty,
  presence_penalty, stop, logit_bias, ignore_eos, skip_special_tokens, structured_outputs,
  chat_template_kwargs, priority) are the chat request's;
- anything a chat request here cannot compute is a 400 naming it: other item, part and tool types
  (files, video: "video input is not supported", built-in tools), `background`, `truncation: auto`,
  `include`, and the fields of
  `OUT_OF_SCOPE` (`conversation`, `prompt`, `top_logprobs`, ...) unless neutral (compat.py);
  `metadata` has OpenAI's limits (compat.py).
"""

from __future__ import annotations

from typing import Any

from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.requests.compat import check_metadata, refuse_unless_neutral
from tokenizer_proc.requests.schemas import (
    ChatBody,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDef,
    ImagePart,
    NamedToolChoice,
    NamedToolChoiceFunction,
    ResponsesBody,
    StreamOptions,
    TextPart,
    ToolCall,
    ToolDef,
)
from tokenizer_proc.requests.validation import require

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


# OpenAI / vLLM / SGLang Responses fields a chat request here cannot compute, with what each would need
OUT_OF_SCOPE = {
    "conversation": "no stored conversations: send the conversation, or previous_response_id",
    "prompt": "no stored prompt templates: send instructions and input",
    "top_logprobs": "responses carry no logprobs (use /v1/chat/completions)",
    "max_tool_calls": "it limits built-in tool calls, which there are not",
    "access_programs": "no OpenAI access programs", "background_options": "no background responses",
    "context_management": "no server-side compaction", "image": "no image generation",
    "moderation": "no moderation model",
    "include_stop_str_in_output": "a matched stop string is always cut from the output",
    "mm_processor_kwargs": "no per-request image processor options (the server's: --mm-processor-kwargs)",
    "cache_salt": "the prefix cache is shared by every request",
    "extra_key": "the prefix cache is shared by every request",
    "enable_response_messages": "responses carry output items only",
    "previous_input_messages": "use previous_response_id", "previous_response": "use previous_response_id",
    "vllm_xargs": "no extensions read them", "ngram_corpus_id": "no n-gram speculation corpora",
}  # fmt: skip


def check_supported(body: ResponsesBody) -> None:
    require(not body.background, "background responses are not supported (the request runs while you wait)",
            "background")
    require(body.truncation == "disabled", "truncation 'auto' is not supported: a conversation longer than the "
            "context is a 400", "truncation")
    require(not body.include, f"include {body.include!r} is not supported", "include")
    refuse_unless_neutral(body, OUT_OF_SCOPE)
    check_metadata(body.metadata)


def _image(part: dict[str, Any], param: str) -> ImagePart:
    if part.get("file_id") is not None:
        raise bad_request("input_image with a file_id is not supported (no stored files): send image_url, a data: "
                          "or http(s) URL", f"{param}.file_id")  # fmt: skip
    url = part.get("image_url")
    if not isinstance(url, str):
        raise bad_request("input_image needs image_url, a data: or http(s) URL", f"{param}.image_url")
    return ImagePart(image_url=url)


def _content(content: Any, param: str, images: bool = False) -> str | list[ContentPart]:
    """A message's content: its text, or (`images`: a message that may hold input_image parts) its parts when
    one is an image."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of text parts", param)
    out: list[ContentPart] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            out.append(_image(part, f"{param}[{j}]"))
            continue
        if kind in ("input_video", "video_url"):
            raise bad_request("video input is not supported", f"{param}[{j}]")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            allowed = ", ".join((*TEXT_PARTS, "input_image") if images else TEXT_PARTS)
            raise bad_request(f"content part of type {kind!r} is not supported ({allowed})", f"{param}[{j}]")
        out.append(TextPart(text=part["text"]))
    if all(isinstance(p, TextPart) for p in out):
        return "".join(p.text for p in out)  # type: ignore[union-attr]
    return out


def _text(content: Any, param: str) -> str:
    text = _content(content, param)
    assert isinstance(text, str)  # without images the parts are joined
    return text


def _str_field(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{key} must be a string", f"{param}.{key}")
    return value


def input_messages(body: ResponsesBody) -> list[ChatMessage]:
    """This request's own messages: its instructions, then its input."""
    out: list[ChatMessage] = []
    if body.instructions:
        out.append(ChatMessage(role="system", content=body.instructions))
    if body.input is None:
        raise bad_request("input is required", "input")
    if isinstance(body.input, str):
        return [*out, ChatMessage(role="user", content=body.input)]
    for i, item in enumerate(body.input):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"role {role!r} is not one of {', '.join(ROLES)}", f"{param}.role")
            out.append(ChatMessage(role=role, content=_content(item.get("content"), f"{param}.content", True)))
        elif kind == "function_call":
            call = ToolCall(id=_str_field(item, "call_id", param),
                            function=FunctionCall(name=_str_field(item, "name", param),
                                                  arguments=_str_field(item, "arguments", param)))  # fmt: skip
            out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{param}.output")
            out.append(ChatMessage(role="tool", content=text, tool_call_id=_str_field(item, "call_id", param)))
        elif kind != "reasoning":  # an earlier output's reasoning: templates drop it from earlier turns
            raise bad_request(f"input item of type {kind!r} is not supported (message, function_call, "
                              "function_call_output, reasoning)", f"{param}.type")  # fmt: skip
    return out


def _tools(body: ResponsesBody) -> list[ToolDef] | None:
    if not body.tools:
        return None
    out = []
    for i, tool in enumerate(body.tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tool of type {kind!r} is not supported (function tools only)", f"tools[{i}].type")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request("parameters must be a JSON schema object", f"tools[{i}].parameters")
        description = tool.get("description")
        out.append(ToolDef(function=FunctionDef(name=_str_field(tool, "name", f"tools[{i}]"), parameters=params,
                                                description=description if isinstance(description, str) else None,
                                                strict=tool.get("strict"))))  # fmt: skip
    return out


def _tool_choice(body: ResponsesBody) -> Any:
    """The chat tool_choice of a Responses request; "auto" and "none" without tools are no choice at all
    (OpenAI accepts them so, and the SDKs send "auto" by default on some paths)."""
    choice = body.tool_choice
    if choice in ("auto", "none") and not body.tools:
        return None
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                          "tool_choice")
    return NamedToolChoice(function=NamedToolChoiceFunction(name=choice["name"]))


def _response_format(body: ResponsesBody) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    require(fmt.schema is not None, "text.format of type json_schema needs a schema", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema,
                                                   "strict": bool(fmt.strict)}}  # fmt: skip


def chat_body(body: ResponsesBody, messages: list[ChatMessage]) -> ChatBody:
    """The chat request over the whole conversation `messages`."""
    return ChatBody(
        model=body.model, messages=messages, max_tokens=body.max_output_tokens, temperature=body.temperature,
        top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
        repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, logit_bias=body.logit_bias, ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens, structured_outputs=body.structured_outputs,
        chat_template_kwargs=body.chat_template_kwargs, priority=body.priority, stop=body.stop, stream=body.stream,
        stream_options=StreamOptions(include_usage=True) if body.stream else None, tools=_tools(body),
        tool_choice=_tool_choice(body), parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body),
    )
