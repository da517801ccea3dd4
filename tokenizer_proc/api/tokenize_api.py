"""POST /tokenize and POST /detokenize (the vLLM / SGLang shapes).

GET /tokenizer_info: special tokens and the chat template (vLLM's; lm-eval reads it).
/tokenize `{"prompt": str | [str]}` or `{"messages": [...]}` (rendered by the chat template as chat
requests are, with `tools`, `chat_template_kwargs`, `documents`, `add_generation_prompt` and
`continue_final_message`, then encoded without special tokens unless `add_special_tokens`) ->
`{"tokens", "count", "max_model_len", "token_strs"}` (`token_strs`: the vocabulary strings of the tokens
with `return_token_strs`, else null, as vLLM answers); a list of prompts gives lists. POST /v1/tokenize
(SGLang's path) is the same. /detokenize `{"tokens": [ids]}` -> vLLM's `{"prompt": text}`, exactly (its
clients compare the whole object); POST /v1/detokenize (SGLang's path) -> SGLang's `{"text": text}`;
special tokens left out with SGLang's `skip_special_tokens`. Messages with images count each image's
tokens as a chat request does (the images are loaded: requests/images.py). Ids outside the vocabulary, a
model name this server does not serve and vLLM's per-request multimodal options (`mm_processor_kwargs`,
`media_io_kwargs`) are 4xx.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.api.openai_api import check_model
from tokenizer_proc.context import get_ctx
from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.http.plumbing import json_response, read_body
from tokenizer_proc.requests.chat_template import ChatTemplateError
from tokenizer_proc.requests.compat import refuse_unless_neutral
from tokenizer_proc.requests.image_parts import chat_image_refs, place_images
from tokenizer_proc.requests.images import PromptImages, load_images
from tokenizer_proc.requests.peer_fields import generation_prompt, request_template, template_extra
from tokenizer_proc.requests.prepare import chat_messages
from tokenizer_proc.requests.schemas import ChatBody, DetokenizeBody, TokenizeBody
from tokenizer_proc.requests.tokenizer import TextTokenizer
from tokenizer_proc.requests.tools import plan_tools
from tokenizer_proc.requests.validation import Limits, check_token_ids

_MULTIMODAL = {name: "no per-request multimodal options (the server's: --mm-processor-kwargs)"
               for name in ("mm_processor_kwargs", "media_io_kwargs")}


async def tokenize_endpoint(request: Request) -> Response:
    ctx = get_ctx(request)
    data = await read_body(request, ctx.args.max_body_bytes)
    body = await ctx.decode(data, TokenizeBody)
    check_model(ctx, body.model)
    refuse_unless_neutral(body, _MULTIMODAL)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    images = await load_images(ctx.images, chat_image_refs(body.messages))
    token_lists = await ctx.offload(len(data), _token_lists, ctx.tok, body, ctx.limits, images)

    def one(ids: list[int]) -> dict[str, Any]:
        # vocabulary strings, as transformers' convert_ids_to_tokens gives them; null unless asked (vLLM)
        strs = [ctx.tok.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.limits.context_length, "token_strs": strs}

    if isinstance(body.prompt, list):
        lists = [one(ids) for ids in token_lists]
        return json_response({"tokens": [x["tokens"] for x in lists], "count": [x["count"] for x in lists],
                              "max_model_len": ctx.limits.context_length,
                              "token_strs": [x["token_strs"] for x in lists] if body.return_token_strs else None})
    return json_response(one(token_lists[0]))


def _token_lists(tok: TextTokenizer, body: TokenizeBody, limits: Limits,
                 images: PromptImages | None) -> list[list[int]]:  # fmt: skip
    """The ids of each prompt of `body`, or of its messages (one list, each image's tokens in place)."""
    if body.messages is not None:
        return [place_images(_chat_tokens(tok, body), images, limits.vision, "messages")[0]]
    prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt or [])
    special = body.add_special_tokens is not False
    return [tok.encode(p, add_special_tokens=special) for p in prompts]


def _chat_tokens(tok: TextTokenizer, body: TokenizeBody) -> list[int]:
    """The messages as the chat endpoint renders and encodes them (tools, template variables,
    generation prompt or continue_final_message; special tokens only with add_special_tokens)."""
    chat = ChatBody(messages=body.messages, tools=body.tools, tool_choice="none",
                    chat_template_kwargs=body.chat_template_kwargs, documents=body.documents,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message)
    messages = chat_messages(chat)
    own = request_template(body, tok.chat.trust_request_template)
    try:
        text = tok.render_chat(messages, add_generation_prompt=generation_prompt(chat), extra=template_extra(chat),
                               tools=plan_tools(chat).template_tools,
                               continue_final_message=body.continue_final_message, template=own)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages" if own is None else "chat_template") from e
    return tok.encode(text, add_special_tokens=bool(body.add_special_tokens))


async def tokenizer_info_endpoint(request: Request) -> Response:
    """GET /tokenizer_info (vLLM's): the special tokens and the chat template, which lm-eval's
    remote tokenizer reads."""
    tok = get_ctx(request).tok
    info: dict[str, Any] = {k: tok.special_tokens.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    if info["eos_token"] is None and tok.eos_token_ids:
        info["eos_token"] = tok.token_text(tok.eos_token_ids[0])
    info.update(chat_template=tok.chat_template.source, model_max_length=get_ctx(request).limits.context_length,
                tokenizer_class="PreTrainedTokenizerFast")
    return json_response(info)


async def _detokenized(request: Request) -> str:
    ctx = get_ctx(request)
    data = await read_body(request, ctx.args.max_body_bytes)
    body = await ctx.decode(data, DetokenizeBody)
    check_model(ctx, body.model)
    ids = check_token_ids(body.tokens, ctx.limits.vocab_size, "tokens")
    return await ctx.offload(len(data), ctx.tok.decode, ids, body.skip_special_tokens)


async def detokenize_endpoint(request: Request) -> Response:
    """POST /detokenize: vLLM's answer, `{"prompt": text}` and nothing else."""
    return json_response({"prompt": await _detokenized(request)})


async def sglang_detokenize_endpoint(request: Request) -> Response:
    """POST /v1/detokenize: SGLang's answer, `{"text": text}`."""
    return json_response({"text": await _detokenized(request)})
