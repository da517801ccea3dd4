"""Drafting with the checkpoint's MTP layers (--speculative-algorithm NEXTN): `MtpDrafter`, one per
worker rank, owns the MTP layers' KV and runs them once per step after sampling.

KV: one K and one V tensor per MTP layer, [kv_capacity + 1 + scratch, kv_heads, head_dim]. Token slot s
holds the MTP layer's KV of the position whose model KV is in slot s (the scheduler's slot numbers, so
the MTP KV needs no bookkeeping of its own: a slot freed, cached or shared is so for both); the scratch
slots after them hold the positions of this step's draft chains only, and are overwritten by the next.

Every step (every rank, given the same next tokens and accepted counts): row i of every slice runs the
MTP layers on (the token after row i, the model's final-normed hidden state at i), writing the MTP KV of
row i's slot. The token after a row is the next input, after a slice's last row the sampled token (for
a verify slice: after its last accepted row, the token sampled there; its rejected rows write slots the
scheduler frees) or, for a prompt chunk that does not sample, `prompt_next`. A slice with `draft_next`
= K then guesses K tokens greedily: the LM head over the MTP output of its last accepted row gives the
first, and each further one comes from the MTP layers run on the previous guess and the previous MTP
output, one decode position further, attending over the request's MTP KV and its chain's scratch slots.
Guesses are only proposals: the verify step decides, so a cached prefix whose last MTP entry saw
another continuation costs acceptance, never correctness.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from shared.messages import ReqSlice
from worker_proc.host.memory import zeros
from worker_proc.kernels import KernelOps
from worker_proc.model.batch import DecodeGroup, StepBatch
from worker_proc.model.hybrid import HybridForCausalLM, MtpHead
from worker_proc.model.tp import AttnShard

logger = logging.getLogger(__name__)


@dataclass
class MtpKV:
    """The MTP layers' K and V (`KVLayers`), each [token slots + scratch, kv_heads, head_dim]."""

    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)


class MtpDrafter:
    def __init__(self, model: HybridForCausalLM, kv_capacity: int) -> None:
        if model.mtp is None:
            raise ValueError("the model was built without its MTP layers")
        self.model = model
        self.head: MtpHead = model.mtp
        self.token_slots = kv_capacity + 1
        cfg, tp = model.cfg, model.tp
        shard = AttnShard.of(cfg, tp.rank, tp.size)
        self._row_shape = (shard.kv_heads, cfg.attn.head_dim)
        self.kv = MtpKV()
        self._grow(0)

    @property
    def scratch(self) -> int:
        return int(self.kv.k[0].shape[0]) - self.token_slots

    def _grow(self, scratch: int) -> None:
        """At least `scratch` scratch slots (the token slots' KV kept)."""
        rows = self.token_slots + scratch
        dev, dtype = self.model.device, self.model.dtype
        for kv in (self.kv.k, self.kv.v):
            for j in range(self.model.cfg.mtp_layers):
                fresh = zeros((rows, *self._row_shape), dtype, dev)
                if j < len(kv):
                    fresh[: kv[j].shape[0]] = kv[j]
                    kv[j] = fresh
                else:
                    kv.append(fresh)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.kv.k, *self.kv.v))

    @torch.inference_mode()
    def step(self, sb: StepBatch, reqs: list[ReqSlice], hidden: torch.Tensor, next_tokens: list[int],
             accepted: list[int], ops: KernelOps) -> dict[str, list[int]]:  # fmt: skip
        """Run the MTP layers over the step's rows (`hidden`: the model's final-normed hidden states,
        every row; `next_tokens[i]`: slice i's sampled token or -1; `accepted[i]`: a verify slice's
        accepted drafts) and return each `draft_next` slice's guesses."""
        after = sb.input_ids.clone()
        after[:-1] = sb.input_ids[1:]
        last_rows: list[int] = []  # per slice: its last row that stays (the newest token's row)
        fixes: list[tuple[int, int]] = []
        at = 0
        for r, token, n_ok in zip(reqs, next_tokens, accepted, strict=True):
            last = at + (n_ok if r.drafts else len(r.input_ids) - 1)
            nxt = token if token >= 0 else r.prompt_next
            fixes.append((last, nxt if nxt >= 0 else r.input_ids[-1]))
            last_rows.append(last)
            at += len(r.input_ids)
        idx = torch.tensor([row for row, _ in fixes], dtype=torch.int64, device=after.device)
        after[idx] = torch.tensor([tok for _, tok in fixes], dtype=torch.int64, device=after.device)
        model = self.model
        mtp_batch = dataclasses.replace(sb, kept_inputs=None)  # the MTP layers keep no recurrent inputs
        out = self.head(model.embed_scaled(after), hidden, mtp_batch, model.rope(sb.rope_input), self.kv, ops)
        wanted = [i for i, r in enumerate(reqs) if r.draft_next > 0 and next_tokens[i] >= 0]
        if not wanted:
            return {}
        rows = torch.tensor([last_rows[i] for i in wanted], dtype=torch.int64, device=out.device)
        positions = sb.positions[rows]
        prefixes = [sb.kv_full[i][: p + 1] for i, p in zip(wanted, positions.tolist(), strict=True)]
        guesses = self._chain(out[rows], positions, prefixes, max(reqs[i].draft_next for i in wanted), ops,
                              sb.rope_input[..., rows])
        return {reqs[i].rid: guesses[b][: reqs[i].draft_next] for b, i in enumerate(wanted)}

    def _chain(self, h: torch.Tensor, positions: torch.Tensor, prefixes: list[torch.Tensor], k: int,
               ops: KernelOps, rope_at: torch.Tensor) -> list[list[int]]:  # fmt: skip
        """`k` greedy guesses per row of `h` (MTP outputs at `positions`, whose MTP KV slots are
        `prefixes`; `rope_at`: their rotary positions, StepBatch.rope_input), the later ones by decode
        steps over scratch slots."""
        model, n = self.model, h.shape[0]
        if self.scratch < n * (k - 1):
            self._grow(n * (k - 1))
        token = model.logits(h).argmax(dim=-1)
        guesses = [token]
        device = h.device
        kv_len = torch.tensor([int(p.shape[0]) for p in prefixes], dtype=torch.int64, device=device)
        slots = list(prefixes)
        rows = torch.arange(n, dtype=torch.int64, device=device)
        for j in range(1, k):
            scratch = self.token_slots + rows * (k - 1) + (j - 1)
            slots = [torch.cat((s, scratch[b : b + 1])) for b, s in enumerate(slots)]
            pos = positions + j
            group = DecodeGroup(rows, rows, torch.nn.utils.rnn.pad_sequence(slots, batch_first=True), kv_len + j)
            batch = StepBatch(token, pos, scratch, (), (group,), rows, ())
            h = self.head(model.embed_scaled(token), h, batch, model.rope(rope_at + j), self.kv, ops)
            token = model.logits(h).argmax(dim=-1)
            guesses.append(token)
        return torch.stack(guesses, dim=1).tolist()

    def check_integrity(self) -> None:
        for t in (*self.kv.k, *self.kv.v):
            assert t.shape[0] >= self.token_slots and tuple(t.shape[1:]) == self._row_shape, t.shape
            assert not t[0].any(), "MTP KV slot 0 (padding) was written"

