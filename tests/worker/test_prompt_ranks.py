"""The worker's prompt logprobs: each prompt token's logprob, its alternatives and its rank (how many
tokens are at least as likely, itself included), from the logit rows of a prompt slice."""

from __future__ import annotations

import torch

from shared.messages import ReqSlice
from worker_proc.runtime.runner import ModelRunner


def test_prompt_logprobs_ranks_and_alternatives() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0],   # after token 0: next is 2 (third most likely)
                           [5.0, 1.0, 0.0, 0.5],   # after token 2: next is 0 (the most likely)
                           [1.0, 1.0, 1.0, 1.0]])  # after token 0: next is 3 (tied with all: rank 4)
    r = ReqSlice(rid="r", input_ids=[0, 2, 0], start_pos=0, kv_slots=[1, 2, 3], state_slot=1, sample=True,
                 prompt_logprobs=2, prompt_next=3)
    lps, tops, ranks = ModelRunner._prompt_logprobs(logits, [(r, 0, 3)])
    logp = torch.log_softmax(logits, dim=-1)
    assert lps["r"] == [logp[0, 2].item(), logp[1, 0].item(), logp[2, 3].item()]
    assert ranks["r"] == [3, 1, 4]
    assert [[t for t, _ in row] for row in tops["r"]][:2] == [[1, 3], [0, 1]]
    lps, tops, ranks = ModelRunner._prompt_logprobs(logits[:1], [(ReqSlice(
        rid="s", input_ids=[7], start_pos=0, kv_slots=[1], state_slot=1, sample=False, prompt_logprobs=0), 0, 1)])
    assert lps == {"s": []} and ranks == {"s": []} and tops == {}
