"""What a request asks of sampling, carried with it on two channels: tokenizer -> scheduler
(GenerateReq.sampling) and scheduler -> workers (ReqSlice.sampling). The tokenizer process validates
it before a request is accepted; nothing downstream changes it (the Structs are frozen)."""

from __future__ import annotations

from typing import Literal

import msgspec


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the output (structured output), as the client gave it: validated by the
    tokenizer process, compiled by worker rank 0 (worker_proc/output/grammar.py, one compilation per
    distinct spec). `source`: the JSON schema (JSON text), the regex or the EBNF grammar (empty for
    json_object); `strict`: a json_schema object allows no properties beyond the schema's; `after`:
    the tokens (a reasoning model's `</think>`) once the output holds which the grammar constrains what
    follows, the output being free until then (empty: constrained from its first token)."""

    kind: Literal["json_schema", "json_object", "regex", "ebnf"]
    source: str = ""
    strict: bool = True
    after: tuple[int, ...] = ()


class ThinkingBudget(msgspec.Struct, frozen=True, kw_only=True):
    """A cap on a reasoning model's thinking (vLLM's `thinking_token_budget`), set by the tokenizer
    process from the reasoning parser's tags: once `tokens` output tokens were made inside the
    reasoning (from the output's start when `inside`, else after the `start` tokens) and it has not
    ended (the `end` tokens), rank 0 forces the `end` tokens one by one (worker_proc/output/logit_processing.py)."""

    tokens: int
    start: tuple[int, ...]
    end: tuple[int, ...]
    inside: bool = False


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling. Validated by the tokenizer process before a request is accepted."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = all
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives returned beside each sampled token's logprob (0..20)
    # >= 0: the logprob of every prompt token after the first, and this many alternatives at each
    # position (the request then never starts from a cached prefix: every position is computed)
    prompt_logprobs: int = -1
    frequency_penalty: float = 0.0  # minus penalty x count of the token in the output so far
    presence_penalty: float = 0.0  # minus penalty once a token occurs in the output
    repetition_penalty: float = 1.0  # tokens of prompt and output: logit / p if positive, x p if not
    logit_bias: dict[int, float] = {}  # added to the logits before sampling
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    grammar: GrammarSpec | None = None  # the output must match it; the request stops when it is complete
    thinking_budget: ThinkingBudget | None = None  # the reasoning is ended after this many tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """The sampler needs the request's tokens so far (ReqSlice.history): for its penalties, and
        to bring a grammar matcher up to date when it is not (worker_proc/output/grammar.py), and to see
        where a thinking budget stands."""
        return self.has_penalties or self.grammar is not None or self.thinking_budget is not None

    @property
    def processes_logits(self) -> bool:
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.thinking_budget is not None
