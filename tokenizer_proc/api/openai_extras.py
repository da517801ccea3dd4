"""The vLLM fields of the OpenAI answers, where vLLM puts them, for the requests that asked:

- `return_token_ids`: each choice's `token_ids` (its output tokens; streamed: the chunk's new ones)
  and `prompt_token_ids`, on the choice for completions and on the response for chat; streamed, the
  prompt's ids come with the first chunk of each choice;
- `prompt_logprobs`: beside `prompt_token_ids` (logprobs.prompt_logprobs shapes them); a non-streamed
  answer that did not ask has it null where vLLM's has it (openai_api.py), since vLLM's clients read it;
- `stream_options.continuous_usage_stats`: every chunk's `usage`, that of its choice so far (its
  prompt's tokens and the tokens it generated), as vLLM counts it.
The final usage chunk and the responses' `usage` are openai_api.py's.
"""

from __future__ import annotations

from typing import Any

from tokenizer_proc.api.logprobs import prompt_logprobs
from tokenizer_proc.requests.flow import Accumulated
from tokenizer_proc.requests.generation import Piece
from tokenizer_proc.requests.prepare import PreparedRequest
from tokenizer_proc.requests.tokenizer import TextTokenizer


def prompt_fields(tok: TextTokenizer, req: PreparedRequest, out: Accumulated | Piece) -> dict[str, Any]:
    """`prompt_token_ids` and `prompt_logprobs` of a request, those it asked for."""
    fields: dict[str, Any] = {}
    if req.return_token_ids:
        fields["prompt_token_ids"] = list(req.input_ids)
    if req.prompt_logprobs >= 0:
        fields["prompt_logprobs"] = prompt_logprobs(tok, req.input_ids, out.prompt_logprobs, out.prompt_top_logprobs,
                                                    out.prompt_ranks, req.prompt_logprobs)
    return fields


def choice_fields(tok: TextTokenizer, req: PreparedRequest, out: Accumulated | Piece, first: bool,
                  chat: bool) -> dict[str, Any]:  # fmt: skip
    """The fields a choice (or a chunk of it: `out` a Piece) carries; `first`: its first chunk."""
    fields: dict[str, Any] = {}
    if req.return_token_ids:
        ids = out.ids if isinstance(out, Accumulated) else out.token_ids
        fields["token_ids"] = [] if req.echo_only else list(ids)
    if first and not chat:
        fields.update(prompt_fields(tok, req, out))
    return fields


def chunk_fields(tok: TextTokenizer, req: PreparedRequest, piece: Piece, first: bool, chat: bool) -> dict[str, Any]:
    """The top-level fields of a streamed chunk of one choice: chat's prompt fields on its first
    chunk, and the usage so far with continuous usage stats."""
    fields = prompt_fields(tok, req, piece) if first and chat else {}
    if req.continuous_usage:
        completion = 0 if req.echo_only else piece.completion_tokens
        fields["usage"] = {"prompt_tokens": piece.prompt_tokens, "completion_tokens": completion,
                           "total_tokens": piece.prompt_tokens + completion}
    return fields
