"""Declared peer fields whose requested behaviour this server cannot give: a 400 naming the field.

Rules:
- a field that would change the result (suffix, the deprecated functions, the OpenAI / vLLM /
  SGLang fields of the tables below, on every route) is never silently ignored; a field that
  changes nothing here is declared in schemas.py / schemas_peer.py and ignored; an undeclared field
  is a 400 (fields.py);
- an out-of-scope field is refused only when it asks for something: its neutral value (absent,
  null, false, an empty list or object; length_penalty 1, routed_experts_start_len 0, top_logprobs 0)
  is accepted,
  since clients and routers send those by default;
- `metadata` (chat, completions, responses) is OpenAI's: at most 16 pairs, keys of at most 64
  characters, values strings of at most 512 characters.
"""

from __future__ import annotations

import math
from typing import Any

from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.requests.schemas import ChatBody, CompletionBody, GenerateBody, NativeSamplingParams
from tokenizer_proc.requests.validation import MAX_TOP_LOGPROBS

MAX_BEAM_WIDTH = MAX_TOP_LOGPROBS // 2
"""The largest beam width (n with use_beam_search): each step asks 2 x width alternatives, at most
MAX_TOP_LOGPROBS (vLLM's default max_logprobs gives it the same limit)."""
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

_NO_MULTIMODAL = "images are the only media served, without per-request options (the server's: --mm-processor-kwargs)"
_NO_VIDEO = "video input is not supported"
_NO_PD = "no prefill/decode disaggregation"
_LORA_BY_NAME = "adapters are named by lora_path (or model)"
_NO_CUSTOM = "no custom logit processors"
_SHARED_CACHE = "the prefix cache is shared by every request"
_NO_EXPERTS = "no routed-expert or hidden-state capture"

# OpenAI / vLLM / SGLang fields of /v1/completions and /v1/chat/completions, with what each would need
OUT_OF_SCOPE = {
    "audio": "only text output is supported", "moderation": "no moderation model",
    "web_search_options": "no web search",
    "early_stopping": "beam search always runs until no live beam can beat the finished ones",
    "include_stop_str_in_output": "a matched stop string is always cut from the output",
    "allowed_token_ids": "no restriction of the vocabulary beyond logit_bias and structured outputs",
    "bad_words": "no banned words beyond logit_bias", "logits_processors": _NO_CUSTOM,
    "custom_logit_processor": _NO_CUSTOM, "custom_params": "no custom logit processors to pass them to",
    "logprob_token_ids": "use logprobs / top_logprobs", "return_tokens_as_token_ids": "use return_token_ids",
    "return_token_offsets": "no token offsets", "return_prompt_text": "no rendered prompt in the answer",
    "routed_experts_prompt_start": _NO_EXPERTS, "return_routed_experts": _NO_EXPERTS,
    "routed_experts_start_len": _NO_EXPERTS, "media_io_kwargs": _NO_MULTIMODAL,
    "mm_processor_kwargs": _NO_MULTIMODAL, "images_config": _NO_MULTIMODAL, "cache_salt": _SHARED_CACHE,
    "extra_key": _SHARED_CACHE, "kv_transfer_params": _NO_PD, "ec_transfer_params": _NO_PD,
    "bootstrap_host": _NO_PD, "bootstrap_port": _NO_PD, "bootstrap_room": _NO_PD,
    "disagg_prefill_dp_rank": _NO_PD, "vllm_xargs": "no extensions read them",
    "repetition_detection": "no repetition detection", "watermarking": "no watermarking",
    "guided_whitespace_pattern": "structured JSON output has no free whitespace",
    "session_params": "no sessions: send the whole prompt", "ngram_corpus_id": "no n-gram speculation corpora",
    "return_cached_tokens_details": "usage has cached_tokens only",
}  # fmt: skip
_COMPLETION_OUT_OF_SCOPE = {
    "prompt_embeds": "send text or token ids", "json_schema": "use response_format or structured_outputs",
    "thinking_token_budget": "the reasoning budget applies to chat requests",
}  # fmt: skip
_CHAT_OUT_OF_SCOPE = {
    "echo": "the answer does not repeat the last message", "return_prompt_token_ids": "use return_token_ids",
    "return_meta_info": "no SGLang meta_info on this route (use /generate)", "task": "no quick-instruction tasks",
    "input_ids": "send messages (or use /v1/completions with token ids)", "max_dynamic_patch": _NO_MULTIMODAL,
    "min_dynamic_patch": _NO_MULTIMODAL, "use_audio_in_video": _NO_VIDEO,
}  # fmt: skip
# SGLang GenerateReqInput fields of /generate
GENERATE_OUT_OF_SCOPE = {
    "return_text_in_logprobs": "logprobs carry token ids", "return_hidden_states": _NO_EXPERTS,
    "return_bytes": "no image generation", "return_entropy": "no entropy output",
    "background": "the request runs while you wait", "input_embeds": "send text or input_ids",
    **{name: _NO_MULTIMODAL for name in (
        "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video",
        "video_config", "modalities", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
        "video_max_dynamic_patch", "images_config", "need_wait_for_mm_inputs", "num_items_assigned",
        "encoder_urls", "positional_embed_overrides")},
    "video_data": _NO_VIDEO, "token_ids_logprob": "use top_logprobs_num", "return_sampling_mask": "no sampling masks",
    "return_flat_raw_top_logprobs": "logprobs are nested lists", "return_flat_raw_top_logprobs_b64": "as above",
    "return_routed_experts": _NO_EXPERTS, "routed_experts_start_len": _NO_EXPERTS,
    "return_indexer_topk": _NO_EXPERTS, "return_prompt_token_ids": "use return_logprob with logprob_start_len 0",
    "session_params": "no sessions: send the whole prompt", "lora_id": _LORA_BY_NAME,
    "custom_logit_processor": _NO_CUSTOM, "bootstrap_host": _NO_PD, "bootstrap_port": _NO_PD,
    "bootstrap_room": _NO_PD, "bootstrap_pair_key": _NO_PD, "decode_tp_size": _NO_PD,
    "disagg_prefill_dp_rank": _NO_PD, "kv_router_hint": _NO_PD,
    "require_reasoning": "no reasoning switch (use the chat template)",
    "max_thinking_tokens": "use thinking_token_budget on /v1/chat/completions", "extra_key": _SHARED_CACHE,
    "cache_salt": _SHARED_CACHE, "multi_item_delimiter_indices": "no multi-item scoring",
}  # fmt: skip
_SAMPLING_OUT_OF_SCOPE = {
    "no_stop_trim": "a matched stop string is always cut from the output",
    "structural_tag": "use json_schema, regex or ebnf", "custom_params": "no custom logit processors to pass them to",
}  # fmt: skip
_NEUTRAL_NUMBERS = {"routed_experts_start_len": 0, "routed_experts_prompt_start": 0,
                    "top_logprobs": 0}


def _neutral(name: str, value: Any) -> bool:
    if name in _NEUTRAL_NUMBERS and value == _NEUTRAL_NUMBERS[name] and value is not True:
        return True
    return value is None or value is False or value == [] or value == {}


def refuse_unless_neutral(body: object, reasons: dict[str, str], prefix: str = "") -> None:
    """A 400 naming the first field of `reasons` that `body` sets to a non-neutral value."""
    for name, why in reasons.items():
        if not _neutral(name, getattr(body, name, None)):
            raise bad_request(f"{prefix}{name} is not supported by this server: {why}", prefix + name)


def check_metadata(metadata: dict[str, Any] | None, param: str = "metadata") -> None:
    """OpenAI's limits of `metadata` (module doc)."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(f"{param} has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed", param)
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise bad_request(f"{param} keys must be at most {MAX_METADATA_KEY_CHARS} characters, got one of "
                              f"{len(key)}", f"{param}.{key[:MAX_METADATA_KEY_CHARS]}")  # fmt: skip
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"{param} values must be strings of at most {MAX_METADATA_VALUE_CHARS} characters",
                              f"{param}.{key}")  # fmt: skip


def check_generate_fields(body: GenerateBody) -> None:
    refuse_unless_neutral(body, GENERATE_OUT_OF_SCOPE)
    sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params]
    for i, sp in enumerate(sps):
        if sp is not None:
            prefix = f"sampling_params[{i}]." if isinstance(body.sampling_params, list) else "sampling_params."
            refuse_unless_neutral(sp, _SAMPLING_OUT_OF_SCOPE, prefix)


def sampling_seed(sp: NativeSamplingParams) -> int | None:
    """The seed of native sampling params: `seed`, or SGLang's `sampling_seed`; both, differing, is a 400."""
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise bad_request("seed and sampling_seed name the same seed: give one", "sampling_params.sampling_seed")
    return sp.seed if sp.seed is not None else sp.sampling_seed


def check_beam_search(body: CompletionBody | ChatBody) -> None:
    """vLLM's beam search fields (requests/beam_search.py runs it): `length_penalty` only with
    `use_beam_search`; a beam search is not echoed, its width is `n` (at most
    MAX_BEAM_WIDTH), and `best_of`, when given, equals it."""
    penalty = body.length_penalty
    if penalty is not None and not math.isfinite(penalty):
        raise bad_request("length_penalty must be a finite number", "length_penalty")
    if not body.use_beam_search:
        if penalty is not None and penalty != 1.0:
            raise bad_request("length_penalty applies to beam search: set use_beam_search", "length_penalty")
        return
    if not 1 <= body.n <= MAX_BEAM_WIDTH:
        raise bad_request(f"n is the beam width with use_beam_search: it must be in [1, {MAX_BEAM_WIDTH}], got "
                          f"{body.n}", "n")  # fmt: skip
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != body.n:
        raise bad_request(f"best_of ({best_of}) must equal n ({body.n}) with use_beam_search: the beam width is n "
                          "and the n best beams are returned", "best_of")  # fmt: skip
    if getattr(body, "echo", False) is True:
        raise bad_request("use_beam_search does not combine with echo", "echo")


def _refuse_openai(body: CompletionBody | ChatBody, more: dict[str, str]) -> None:
    refuse_unless_neutral(body, OUT_OF_SCOPE | more)
    check_beam_search(body)
    if body.no_stop_trim or body.return_hidden_states:
        name = "no_stop_trim" if body.no_stop_trim else "return_hidden_states"
        raise bad_request(f"{name} is not supported by this server", name)
    modalities = body.modalities
    if modalities is not None and any(m != "text" for m in modalities):
        raise bad_request("modalities: only text output is supported by this server", "modalities")
    check_metadata(body.metadata)


def check_completion_fields(body: CompletionBody) -> None:
    if body.suffix:
        raise bad_request("suffix is not supported: the model has no fill-in-the-middle format", "suffix")
    _refuse_openai(body, _COMPLETION_OUT_OF_SCOPE)


def check_chat_fields(body: ChatBody) -> None:
    for name in ("functions", "function_call"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name} is deprecated and not supported; use tools", name)
    _refuse_openai(body, _CHAT_OUT_OF_SCOPE)
