"""Peer request fields (OpenAI, vLLM, SGLang) that this server declares without computing anything
from them: the bases of the body Structs of schemas.py.

Rules: a field here is either accepted and ignored, because it changes nothing a model server
computes (identifiers, routing and caching hints, OpenAI account features), or declared `Any` so
that any value but its neutral one (absent, null, false, an empty list or object; see compat.py)
is a 400 naming it; compat.py holds the reason of each refusal. A field that is neither declared
here nor in schemas.py is a 400 (fields.py).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

Int = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
# a seed of any size decodes, so that validation.build_sampling refuses one out of range with the range it takes
Seed = int


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class SglangRouting(_Body):
    """SGLang routing / accounting fields of every route: accepted and ignored (this server places
    requests on its replicas itself; labels and sessions change no output)."""

    session_id: str | None = None
    routed_dp_rank: Int | None = None
    data_parallel_rank: Int | None = None
    custom_labels: dict[str, str] | None = None


class GeneratePeerFields(SglangRouting):
    """SGLang GenerateReqInput fields /generate does not compute (compat.py `GENERATE_OUT_OF_SCOPE`)."""

    conversation_id: str | None = None  # tracking only: accepted and ignored
    routing_key: str | None = None
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    input_embeds: Any = None
    image_data: Any = None  # SGLang's images of the prompt(s) (requests/image_parts.py)
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: Any = None
    video_config: Any = None
    modalities: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    images_config: Any = None
    token_ids_logprob: Any = None
    return_sampling_mask: Any = None
    return_flat_raw_top_logprobs: Any = None
    return_flat_raw_top_logprobs_b64: Any = None
    return_routed_experts: Any = None
    routed_experts_start_len: Any = None
    return_indexer_topk: Any = None
    return_prompt_token_ids: Any = None
    session_params: Any = None
    lora_path: str | list[str | None] | None = None  # the LoRA adapter by name, or one per prompt (adapters.py)
    lora_id: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    disagg_prefill_dp_rank: Any = None
    kv_router_hint: Any = None
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None
    require_reasoning: Any = None
    max_thinking_tokens: Any = None
    extra_key: Any = None
    cache_salt: Any = None
    multi_item_delimiter_indices: Any = None


class OpenAIPeerFields(SglangRouting):
    """OpenAI, vLLM and SGLang fields of /v1/completions and /v1/chat/completions that this server
    does not compute (compat.py `OUT_OF_SCOPE`)."""

    # OpenAI: hints and account features that change nothing computed here
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    # vLLM: accepted and ignored (a decoding backend choice; render-endpoint and stream-batching options)
    guided_decoding_backend: str | None = None
    return_mm_kwargs: bool = True
    stream_interval: Int | None = None
    # vLLM's beam search (requests/beam_search.py, checked by compat.check_beam_search): n is the beam width
    use_beam_search: bool | None = None
    length_penalty: float | None = None  # the beam score's exponent of the length (1 when null)
    # refused unless neutral
    audio: Any = None
    moderation: Any = None
    web_search_options: Any = None
    early_stopping: Any = None
    include_stop_str_in_output: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    logprob_token_ids: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_offsets: Any = None
    return_prompt_text: Any = None
    routed_experts_prompt_start: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    watermarking: Any = None
    guided_whitespace_pattern: Any = None
    lora_path: str | None = None  # SGLang's: the LoRA adapter by name, as `model` names it (openai_api.check_model)
    custom_logit_processor: Any = None
    custom_params: Any = None
    session_params: Any = None
    return_routed_experts: Any = None
    routed_experts_start_len: Any = None
    return_cached_tokens_details: Any = None
    images_config: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    disagg_prefill_dp_rank: Any = None
    extra_key: Any = None
    ngram_corpus_id: Any = None


class ResponsesPeerFields(_Body):
    """OpenAI and vLLM / SGLang fields of /v1/responses that this server does not compute
    (responses_input.py `OUT_OF_SCOPE`)."""

    # accepted and ignored: identifiers, caching hints
    request_id: str | None = None
    session_id: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    # refused unless neutral
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    access_programs: Any = None
    background_options: Any = None
    context_management: Any = None
    image: Any = None
    moderation: Any = None
    include_stop_str_in_output: Any = None
    mm_processor_kwargs: Any = None
    cache_salt: Any = None
    enable_response_messages: Any = None
    previous_input_messages: Any = None
    previous_response: Any = None
    vllm_xargs: Any = None
    extra_key: Any = None
    ngram_corpus_id: Any = None
