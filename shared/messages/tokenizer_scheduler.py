"""The two channels between the tokenizer process and a scheduler (shared/channels.py):
`ToScheduler` (TOKENIZER_TO_SCHEDULER: requests, aborts, cache flushes, info queries) and
`ToTokenizer` (SCHEDULER_TO_TOKENIZER: each request's tokens and its one final TokenOut, the answers
to those queries, and the end of serving). The scheduler owns a request's fate from its GenerateReq
on; what must hold: exactly one TokenOut per request has `finished=True`, and nothing follows it."""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.messages.images import ImageInput
from shared.messages.lora import LoraAdapter
from shared.messages.sampling import SamplingParams
from shared.messages.server_info import SchedulerInfo

FinishReason = Literal["stop", "length", "abort", "error"]


# ---------------------------------------------------------------- tokenizer -> scheduler
class GenerateReq(msgspec.Struct, tag=True, kw_only=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    priority: int = 0  # larger = more important (used with --schedule-policy priority)
    # save the recurrent state after prompt[:-1] in the cache (a checkpoint), so that requests with
    # the same prompt arriving later (the other choices of n > 1) compute only its last token
    save_prompt_state: bool = False
    # the prompt's images, by offset (shared/messages/images.py); their positions of input_ids hold each
    # image's placeholder token
    images: list[ImageInput] = []
    lora: str = ""  # the adapter the request runs under, by name (LoadLoraReq); "" = the base model


class AbortReq(msgspec.Struct, tag=True, kw_only=True):
    rid: str
    reason: str = "client disconnected"


class FlushCacheReq(msgspec.Struct, tag=True, kw_only=True):
    req_id: int
    include_store: bool = False  # empty the state store too (POST /flush_cache?include_store=true)


class GetInfoReq(msgspec.Struct, tag=True, kw_only=True):
    req_id: int


class LoadLoraReq(msgspec.Struct, tag=True, kw_only=True):
    """Register a checked adapter under its name (answered by LoraResp); a name in use is refused."""

    req_id: int
    adapter: LoraAdapter


class UnloadLoraReq(msgspec.Struct, tag=True, kw_only=True):
    """Forget an adapter (answered by LoraResp at once): new requests naming it are refused from now on; its
    running and waiting requests finish under it, and its adapter slot is freed when the last one ends."""

    req_id: int
    name: str


ToScheduler = GenerateReq | AbortReq | FlushCacheReq | GetInfoReq | LoadLoraReq | UnloadLoraReq


# ---------------------------------------------------------------- scheduler -> tokenizer
class TokenOut(msgspec.Struct, kw_only=True, array_like=True):
    """New tokens of one request since its previous TokenOut. Exactly one per request has
    `finished=True`; nothing follows it."""

    rid: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    matched_stop_token: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[float] | None = None
    error: str | None = None
    # with finish_reason "error": the request itself can never run on this server (it was rejected
    # before running; `error` names the limit) or its constraint left it no token to sample
    # (StepResult.grammar_rejected; `error` names the problem), so the client is told 400, not 503
    rejected: bool = False
    # with SamplingParams.top_logprobs: (token id, logprob) alternatives of each token of token_ids
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # with SamplingParams.prompt_logprobs, on the first TokenOut only: the logprob of prompt tokens
    # 1..prompt_len-1 (the first has none) and their alternatives
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_ranks: list[int] | None = None  # the rank of each of those prompt tokens (1 = the most likely)
    queue_s: float = -1.0  # on the first TokenOut with tokens: seconds the request waited for admission


class TokenOutBatch(msgspec.Struct, tag=True, kw_only=True):
    outs: list[TokenOut]


class FlushCacheResp(msgspec.Struct, tag=True, kw_only=True):
    req_id: int
    ok: bool
    message: str = ""


class LoraResp(msgspec.Struct, tag=True, kw_only=True):
    """Answer to LoadLoraReq / UnloadLoraReq: `message` names the problem when not ok."""

    req_id: int
    ok: bool
    message: str = ""


class InfoResp(msgspec.Struct, tag=True, kw_only=True):
    """Answer to GetInfoReq."""

    req_id: int
    info: SchedulerInfo


class SchedulerDead(msgspec.Struct, tag=True, kw_only=True):
    """Sent by the scheduler (or on its behalf by launch.py) when serving cannot continue."""

    reason: str


ToTokenizer = TokenOutBatch | FlushCacheResp | InfoResp | LoraResp | SchedulerDead
