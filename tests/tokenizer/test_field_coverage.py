"""Every request field a peer defines, on every route, works or is a 400 naming it; no field is
dropped silently (fake backend, in process).

The peers' field lists: OpenAI's are read from the installed openai SDK's TypedDicts; vLLM's and
SGLang's extensions are written out here from their protocol files (vLLM's chat_completion /
completion / responses protocol.py, SGLang's openai protocol.py, io_struct.py GenerateReqInput and
sampling_params.py). Each field is sent with a non-neutral value of its type (`SAMPLES`, with the
fields it needs beside it); the fields of a route's `REFUSED` set must answer 400 with `param`
naming them, every other one must be served (200) and be declared by the route's body Struct.
A field an SDK upgrade adds has no sample and fails the walk until it is decided.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from openai.types.responses import response_create_params as responses_params

from shared.config import ServerArgs
from tests.tokenizer.conftest import write_model_dir
from tests.tokenizer.test_app import serve
from tokenizer_proc.requests.schemas import (
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    GenerateBody,
    NativeSamplingParams,
    ResponsesBody,
    TokenizeBody,
)

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
RESPONSE_TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
UNSET = object()


def _openai(module: Any) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


VLLM_SAMPLING = {"use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking", "length_penalty",
                 "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
                 "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "prompt_logprobs",
                 "logprob_token_ids", "allowed_token_ids", "bad_words"}  # fmt: skip
VLLM_EXTRA = {"structured_outputs", "priority", "request_id", "session_id", "return_tokens_as_token_ids",
              "return_token_ids", "routed_experts_prompt_start", "return_token_offsets", "return_mm_kwargs",
              "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection",
              "stream_interval", "thinking_token_budget", "response_format",
              # before structured_outputs (vLLM < 0.11)
              "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
              "guided_whitespace_pattern", "logits_processors", "early_stopping"}  # fmt: skip
VLLM_CHAT = {"include_reasoning", "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens",
             "documents", "chat_template", "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs",
             "return_prompt_text"}  # fmt: skip
VLLM_COMPLETION = {"prompt_embeds", "add_special_tokens"}
SGLANG_OPENAI = {"return_hidden_states", "return_routed_experts", "routed_experts_start_len",
                 "return_cached_tokens_details", "return_token_ids", "top_k", "min_p", "min_tokens", "regex", "ebnf",
                 "repetition_penalty", "stop_token_ids", "stop_regex", "no_stop_trim", "ignore_eos",
                 "skip_special_tokens", "lora_path", "session_id", "session_params", "response_format",
                 "custom_params", "custom_logit_processor", "images_config", "bootstrap_host", "bootstrap_port",
                 "bootstrap_room", "routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank", "rid",
                 "extra_key", "cache_salt", "ngram_corpus_id", "priority", "custom_labels"}  # fmt: skip
SGLANG_CHAT = {"return_prompt_token_ids", "return_meta_info", "reasoning_effort", "task", "continue_final_message",
               "separate_reasoning", "stream_reasoning", "chat_template_kwargs", "max_dynamic_patch",
               "min_dynamic_patch", "use_audio_in_video", "input_ids"}  # fmt: skip
SGLANG_COMPLETION = {"json_schema"}
VLLM_RESPONSES = {"logit_bias", "top_k", "skip_special_tokens", "include_stop_str_in_output", "prompt_cache_key",
                  "request_id", "mm_processor_kwargs", "priority", "cache_salt", "enable_response_messages",
                  "previous_input_messages", "previous_response", "structured_outputs", "repetition_penalty",
                  "seed", "stop", "ignore_eos", "vllm_xargs"}  # fmt: skip
SGLANG_RESPONSES = {"chat_template_kwargs", "request_id", "session_id", "priority", "extra_key", "cache_salt",
                    "ngram_corpus_id", "frequency_penalty", "presence_penalty", "stop", "top_k", "min_p",
                    "repetition_penalty"}  # fmt: skip
SGLANG_GENERATE = {"rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data",
                   "mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params",
                   "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                   "return_sampling_mask", "return_text_in_logprobs", "return_flat_raw_top_logprobs",
                   "return_flat_raw_top_logprobs_b64", "stream", "log_metrics", "return_hidden_states",
                   "return_routed_experts", "routed_experts_start_len", "return_indexer_topk", "modalities",
                   "session_params", "lora_path", "lora_id", "custom_logit_processor", "positional_embed_overrides",
                   "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
                   "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "kv_router_hint",
                   "routing_key", "conversation_id", "background", "require_reasoning", "max_thinking_tokens",
                   "priority", "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy",
                   "return_prompt_token_ids", "external_trace_header", "received_time", "need_wait_for_mm_inputs",
                   "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch",
                   "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
                   "multi_item_delimiter_indices", "cache_salt", "model"}  # fmt: skip
SGLANG_SAMPLING = {"max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                   "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                   "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
                   "logit_bias", "sampling_seed"}  # fmt: skip

# a non-neutral value of each field, as the body fields it is sent as (with what it needs beside it)
SAMPLES: dict[str, Any] = {
    "model": None, "max_tokens": 3, "max_completion_tokens": 3, "temperature": 0.5, "top_p": 0.9, "n": 2,
    "stream": True, "stream_options": {"stream": True, "stream_options": {"include_usage": True}}, "stop": "zz",
    "seed": 7, "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"5": 1.0}, "user": "u",
    "suffix": "end", "best_of": 2, "echo": True, "metadata": {"k": "v"}, "store": True,
    "service_tier": "flex", "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
    "verbosity": "low", "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit"}, "audio": {"voice": "alloy", "format": "wav"},
    "moderation": {"model": "omni-moderation-latest"}, "web_search_options": {"search_context_size": "low"},
    "modalities": ["text", "audio"], "functions": [{"name": "f"}], "function_call": "auto",
    "parallel_tool_calls": {"tools": TOOLS, "parallel_tool_calls": False}, "tools": TOOLS,
    "tool_choice": {"tools": TOOLS, "tool_choice": "none"}, "response_format": {"type": "json_object"},
    "use_beam_search": True, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "watermarking": True,
    "length_penalty": 0.5, "stop_token_ids": [5], "include_stop_str_in_output": True, "ignore_eos": True,
    "min_tokens": 1, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 5, "truncation_side": {"truncate_prompt_tokens": 5, "truncation_side": "right"},
    "prompt_logprobs": 1, "logprob_token_ids": [5], "allowed_token_ids": [5], "bad_words": ["x"],
    "structured_outputs": {"regex": "[ab]+"}, "priority": 1, "request_id": "r", "session_id": "s",
    "return_tokens_as_token_ids": True, "return_token_ids": True, "routed_experts_prompt_start": 1,
    "return_token_offsets": True, "return_mm_kwargs": False, "cache_salt": "salt", "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "repetition_detection": {"min_pattern_size": 2},
    "stream_interval": 4, "thinking_token_budget": 4, "guided_json": {"type": "object"}, "guided_regex": "[ab]+",
    "guided_choice": ["a", "b"], "guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "logits_processors": ["x"], "early_stopping": True,
    "include_reasoning": False, "add_generation_prompt": False, "add_special_tokens": True,
    "continue_final_message": {"messages": [*MSGS, {"role": "assistant", "content": "Hi"}],
                               "continue_final_message": True},
    "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False}, "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"a": 1}, "return_prompt_text": True, "prompt_embeds": "AAAA",
    "return_hidden_states": True, "return_routed_experts": True, "routed_experts_start_len": 1,
    "return_cached_tokens_details": True, "regex": "[ab]+", "ebnf": 'root ::= "a"', "stop_regex": "z+",
    "no_stop_trim": True, "lora_path": "adapter", "session_params": {"id": "s"}, "custom_params": {"a": 1},
    "custom_logit_processor": "x", "images_config": {"a": 1}, "bootstrap_host": "h", "bootstrap_port": 1,
    "bootstrap_room": 1, "routed_dp_rank": 0, "disagg_prefill_dp_rank": 0, "data_parallel_rank": 0, "rid": "rid-1",
    "extra_key": "k", "ngram_corpus_id": "c", "custom_labels": {"a": "b"}, "return_prompt_token_ids": True,
    "return_meta_info": True, "task": "domain", "separate_reasoning": False, "stream_reasoning": False,
    "max_dynamic_patch": 2, "min_dynamic_patch": 1, "use_audio_in_video": True, "input_ids": [1, 2],
    "json_schema": '{"type": "object"}', "logprobs": 2, "top_logprobs": 2,
}  # fmt: skip
CHAT_SAMPLES = {**SAMPLES, "logprobs": True, "top_logprobs": {"logprobs": True, "top_logprobs": 2},
                "max_completion_tokens": {"max_tokens": UNSET, "max_completion_tokens": 3},
                "messages": [{"role": "system", "content": "be brief"}, *MSGS]}  # fmt: skip
COMPLETION_SAMPLES = {**SAMPLES, "prompt": [5, 6, 7]}
RESPONSES_SAMPLES = {
    **SAMPLES, "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    "instructions": "be brief", "max_output_tokens": 3, "tools": RESPONSE_TOOLS,
    "tool_choice": {"tools": RESPONSE_TOOLS, "tool_choice": "none"},
    "parallel_tool_calls": {"tools": RESPONSE_TOOLS, "parallel_tool_calls": False},
    "text": {"format": {"type": "json_object"}}, "truncation": "auto", "background": True,
    "include": ["message.output_text.logprobs"], "reasoning": {"effort": "low"},
    "previous_response_id": "resp_unknown", "stream_options": {"stream": True, "stream_options":
                                                               {"include_obfuscation": False}},
    "conversation": "conv_1", "prompt": {"id": "pmpt_1"}, "top_logprobs": 2, "max_tool_calls": 2,
    "access_programs": {"cyber": "standard"}, "background_options": {"completion_window": "2h"},
    "context_management": [{"type": "compaction"}], "image": {"context_compression": "auto"},
    "enable_response_messages": True, "previous_input_messages": [{"role": "user"}],
    "previous_response": {"id": "resp_1"},
}  # fmt: skip
GENERATE_SAMPLES = {
    **SAMPLES, "text": "hi", "input_ids": {"text": UNSET, "input_ids": [5, 6]}, "background": True,
    "sampling_params": {"max_new_tokens": 3}, "return_logprob": True,
    "logprob_start_len": {"return_logprob": True, "logprob_start_len": 0},
    "top_logprobs_num": {"return_logprob": True, "top_logprobs_num": 2}, "input_embeds": [[0.5]],
    "image_data": "a.png", "video_data": "a.mp4", "audio_data": "a.wav", "mm_hashes": ["h"],
    "mm_content_hashes": ["sha256:0"], "video_config": {"fps": 1}, "token_ids_logprob": [5],
    "return_sampling_mask": True, "return_text_in_logprobs": True, "return_flat_raw_top_logprobs": True,
    "return_flat_raw_top_logprobs_b64": True, "log_metrics": False, "return_indexer_topk": True,
    "modalities": ["image"], "lora_id": "l", "positional_embed_overrides": [1], "bootstrap_pair_key": "k",
    "decode_tp_size": 2, "kv_router_hint": {"a": 1}, "routing_key": "k", "conversation_id": "c",
    "require_reasoning": True, "max_thinking_tokens": 4, "no_logs": True, "return_bytes": True,
    "return_entropy": True, "external_trace_header": {"traceparent": "x"}, "received_time": 1.5,
    "need_wait_for_mm_inputs": True, "num_items_assigned": {"image": [1]}, "encoder_urls": ["u"],
    "image_max_dynamic_patch": 2, "video_max_dynamic_patch": 2, "multi_item_delimiter_indices": [1],
}  # fmt: skip
SAMPLING_SAMPLES = {
    **SAMPLES, "max_new_tokens": 3, "min_new_tokens": 1, "n": 2, "structural_tag": '{"a": 1}', "sampling_seed": 7,
}

REFUSED_OPENAI = {
    "audio", "moderation", "web_search_options", "modalities", "watermarking", "length_penalty",
    "include_stop_str_in_output", "logprob_token_ids", "allowed_token_ids", "bad_words",
    "return_tokens_as_token_ids", "routed_experts_prompt_start", "return_token_offsets", "cache_salt",
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection", "guided_whitespace_pattern",
    "logits_processors", "early_stopping", "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "return_cached_tokens_details", "no_stop_trim", "lora_path", "session_params",
    "custom_params", "custom_logit_processor", "images_config", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "disagg_prefill_dp_rank", "extra_key", "ngram_corpus_id",
}  # fmt: skip
REFUSED_CHAT = REFUSED_OPENAI | {
    "functions", "function_call", "echo", "media_io_kwargs", "mm_processor_kwargs",
    "chat_template",  # served with --trust-request-chat-template (test_peer_fields.py)
    "thinking_token_budget",  # served with --reasoning-parser (test_reasoning.py)
    "return_prompt_text", "return_prompt_token_ids", "return_meta_info", "task", "max_dynamic_patch",
    "min_dynamic_patch", "use_audio_in_video", "input_ids",
}  # fmt: skip
REFUSED_COMPLETION = REFUSED_OPENAI | {"suffix", "prompt_embeds", "json_schema", "thinking_token_budget"}
REFUSED_RESPONSES = {
    "conversation", "prompt", "top_logprobs", "max_tool_calls", "access_programs", "background_options",
    "context_management", "image", "moderation", "include_stop_str_in_output", "mm_processor_kwargs", "cache_salt",
    "extra_key", "ngram_corpus_id", "enable_response_messages", "previous_input_messages", "previous_response",
    "vllm_xargs", "background", "truncation", "include",
}  # fmt: skip
# fields that work only after another request: declared, and tested where that request is made
WORKS_ELSEWHERE = {"previous_response_id": "tests/tokenizer/test_responses_reasoning.py, tests/e2e/test_responses.py"}
REFUSED_GENERATE = {
    "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video",
    "video_config", "token_ids_logprob", "return_sampling_mask", "return_text_in_logprobs",
    "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64", "return_hidden_states",
    "return_routed_experts", "routed_experts_start_len", "return_indexer_topk", "modalities", "session_params",
    "lora_path", "lora_id", "custom_logit_processor", "positional_embed_overrides", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "disagg_prefill_dp_rank",
    "kv_router_hint", "background", "require_reasoning", "max_thinking_tokens", "extra_key", "return_bytes",
    "return_entropy", "return_prompt_token_ids", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
    "images_config", "multi_item_delimiter_indices", "cache_salt",
}  # fmt: skip
REFUSED_SAMPLING = {"structural_tag", "no_stop_trim", "custom_params"}
VLLM_TOKENIZE = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "continue_final_message",
                 "return_token_strs", "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs",
                 "media_io_kwargs"}  # fmt: skip
TOKENIZE_SAMPLES = {**CHAT_SAMPLES, "prompt": ["hi", "there"], "messages": {"prompt": UNSET, "messages": MSGS},
                    "add_generation_prompt": {"prompt": UNSET, "messages": MSGS, "add_generation_prompt": False},
                    "continue_final_message": {"prompt": UNSET, **SAMPLES["continue_final_message"]},
                    "chat_template_kwargs": {"prompt": UNSET, "messages": MSGS, "chat_template_kwargs": {"a": 1}},
                    "tools": {"prompt": UNSET, "messages": MSGS, "tools": TOOLS}, "return_token_strs": True,
                    "chat_template": {"prompt": UNSET, "messages": MSGS, "chat_template": "{{ messages }}"}}
DETOKENIZE = {"model", "tokens", "skip_special_tokens"}  # vLLM's and SGLang's
DETOKENIZE_SAMPLES = {**SAMPLES, "tokens": [104, 105, 256]}

# route: (path, the body every request starts from, its peers' fields, samples, refused fields, body Struct)
ROUTES: dict[str, tuple[str, dict[str, Any], set[str], dict[str, Any], set[str], type]] = {
    "chat": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 3},
             _openai(chat_params) | VLLM_SAMPLING | VLLM_EXTRA | VLLM_CHAT | SGLANG_OPENAI | SGLANG_CHAT,
             CHAT_SAMPLES, REFUSED_CHAT, ChatBody),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 3},
                    _openai(completion_params) | VLLM_SAMPLING | VLLM_EXTRA | VLLM_COMPLETION | SGLANG_OPENAI
                    | SGLANG_COMPLETION, COMPLETION_SAMPLES, REFUSED_COMPLETION, CompletionBody),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 3},
                  set(responses_params.ResponseCreateParamsBase.__annotations__) | {"stream"} | VLLM_RESPONSES
                  | SGLANG_RESPONSES, RESPONSES_SAMPLES, REFUSED_RESPONSES, ResponsesBody),
    "generate": ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}}, SGLANG_GENERATE,
                 GENERATE_SAMPLES, REFUSED_GENERATE, GenerateBody),
    "tokenize": ("/tokenize", {"prompt": "hi"}, VLLM_TOKENIZE, TOKENIZE_SAMPLES,
                 {"chat_template", "mm_processor_kwargs", "media_io_kwargs"}, TokenizeBody),
    "detokenize": ("/detokenize", {"tokens": [104, 105]}, DETOKENIZE, DETOKENIZE_SAMPLES, set(), DetokenizeBody),
}  # fmt: skip


def _request(base: dict[str, Any], name: str, sample: Any, model: str) -> dict[str, Any]:
    if name == "model":
        sample = model
    extra = sample if isinstance(sample, dict) and name in sample else {name: sample}
    body = {**base, **extra}
    return {k: v for k, v in body.items() if v is not UNSET}


def _outcome(r: httpx.Response, name: str) -> str:
    """"served", "refused" (a 400 whose param names the field) or what else it was."""
    if r.status_code == 200:
        return "served"
    param = r.json()["error"]["param"] if r.status_code == 400 else None
    if param is not None and (param == name or param.startswith((f"{name}.", f"{name}["))):
        return "refused"
    return f"{r.status_code}: {r.text[:200]}"


async def _walk(c: httpx.AsyncClient, path: str, cases: list[tuple[str, dict[str, Any], bool]]) -> list[str]:
    wrong = []
    for name, body, refused in cases:
        got = _outcome(await c.post(path, json=body), name)
        if got != ("refused" if refused else "served"):
            wrong.append(f"{name}: expected {'a 400 naming it' if refused else 'served'}, got {got}")
    return wrong


@pytest.fixture
def args(tmp_path_factory: pytest.TempPathFactory) -> ServerArgs:
    """A context long enough for the tool templates' prompts."""
    model = write_model_dir(str(tmp_path_factory.mktemp("long-context")), context=1024)
    return ServerArgs(model_path=model, max_new_tokens_limit=64, max_body_bytes=8192)


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_peer_field_works_or_is_refused_naming_it(args, backend, tok, route: str) -> None:
    path, base, fields, samples, refused, struct = ROUTES[route]
    missing = sorted(fields - samples.keys())
    assert not missing, f"no sample value for {missing}: decide whether each works or is refused"
    declared = {f.encode_name for f in msgspec.structs.fields(struct)}
    served = sorted(f for f in fields - refused if f not in declared)
    assert not served, f"peer fields served but not declared by {struct.__name__}: {served}"
    cases = [(f, _request(base, f, samples[f], args.model_name), f in refused)
             for f in sorted(fields) if f not in WORKS_ELSEWHERE]
    out: list[str] = []

    async def check(c: httpx.AsyncClient) -> None:
        out.extend(await _walk(c, path, cases))

    serve(args, backend, tok, check)
    assert not out, "\n".join(out)


def test_every_sampling_param_works_or_is_refused_naming_it(args, backend, tok) -> None:
    missing = sorted(SGLANG_SAMPLING - SAMPLING_SAMPLES.keys())
    assert not missing, f"no sample value for {missing}"
    declared = {f.encode_name for f in msgspec.structs.fields(NativeSamplingParams)}
    assert SGLANG_SAMPLING - REFUSED_SAMPLING <= declared
    cases = []
    for name in sorted(SGLANG_SAMPLING):
        sample = SAMPLING_SAMPLES[name]
        extra = sample if isinstance(sample, dict) and name in sample else {name: sample}
        cases.append((f"sampling_params.{name}", {"text": "hi", "sampling_params": {"max_new_tokens": 3, **extra}},
                      name in REFUSED_SAMPLING))  # fmt: skip
    out: list[str] = []

    async def check(c: httpx.AsyncClient) -> None:
        out.extend(await _walk(c, "/generate", cases))

    serve(args, backend, tok, check)
    assert not out, "\n".join(out)
