"""bench_quality's state round trip: a long greedy generation whose recurrent state is stored and resumed
every `store_every` tokens, for each state dtype, against the uninterrupted float32 run.

One model, in process. The reference: a float32 state, `tokens` greedy tokens after the prompt, one per
step, never interrupted. For every state dtype (``--mamba-ssm-dtype``'s choices,
worker_proc.kernels.state_codec.STATE_DTYPES, float32 included) on pools of its own, two requests run
alone one token per step:
- free-running: its own greedy tokens, compared with the reference's (agreement, first divergence);
- teacher-forced: fed the reference's tokens, its logits compared with the reference's at every
  position (max and mean |logit difference|, top-1 agreement with the reference's token);
and whenever its position (prompt included) reaches a multiple of `store_every` (the end of a state
store block, --state-cache-block-tokens) each stores its recurrent state as the state store does (the
bytes of every state tensor of its slot, values and int8 scales alike, in pool order: StoreTier's state
entry), clears the slot, and resumes from those bytes in another slot (as the store's loader fills
one), so every later token comes from a resumed state. Storing is lossless by design, so the float32
lanes must equal the reference exactly: the control that this path adds nothing; the other dtypes show
what their storage costs over a long generation, per `window` positions (where the drift by position
shows) and overall.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from benchmarks.bench_state_drift import Lane, windows
from worker_proc.kernels.state_codec import STATE_DTYPES
from worker_proc.runtime.runner import ModelRunner
from worker_proc.state.pools import StatePools

DEFAULT_STORE_EVERY = 64


def store_state(pools: StatePools, slot: int) -> bytes:
    """The state entry of `slot`: every state tensor's [layers, ...] bytes at the slot, in pool order."""
    return b"".join(t[:, slot].contiguous().view(torch.uint8).numpy().tobytes() for t in pools.states.values())


def resume_state(pools: StatePools, slot: int, entry: bytes) -> None:
    """Fill `slot` from a `store_state` entry (ValueError when its size is not this layout's)."""
    payload = torch.frombuffer(bytearray(entry), dtype=torch.uint8)
    offset = 0
    for t in pools.states.values():
        n = t[:, 0].numel() * t.element_size()
        part = payload[offset : offset + n].clone()  # aligned for the view below
        t[:, slot].copy_(part.view(t.dtype).view(t[:, 0].shape))
        offset += n
    if offset != len(entry):
        raise ValueError(f"state entry of {len(entry)} B for a layout of {offset} B")


class ResumingLane(Lane):
    """A Lane whose state can be stored, its slot cleared, and resumed from the stored bytes in another slot."""

    def __init__(self, runner: ModelRunner, pools: StatePools, rid: str, slots: tuple[int, int], kv_base: int) -> None:
        super().__init__(runner, pools, rid, slots[0], kv_base)
        self.spare = slots[1]
        self.resumes = 0

    def store_and_resume(self) -> None:
        entry = store_state(self.pools, self.slot)
        self.pools.clear_state(self.slot)
        resume_state(self.pools, self.spare, entry)
        self.slot, self.spare = self.spare, self.slot
        self.resumes += 1


@dataclass
class RoundTrip:
    """One state dtype's lanes against the uninterrupted float32 reference, per generated position."""

    state_dtype: str
    free_agree: list[bool] = field(default_factory=list)
    forced_top1: list[bool] = field(default_factory=list)
    max_diff: list[float] = field(default_factory=list)  # max |logits - reference logits|, teacher-forced
    mean_diff: list[float] = field(default_factory=list)
    resumes: int = 0

    @property
    def first_divergence(self) -> int | None:
        return next((i for i, same in enumerate(self.free_agree) if not same), None)


def runner_for(model_path: str, dtype: str, prompt_len: int, tokens: int) -> ModelRunner:
    """A runner whose KV holds two lanes of the prompt and the generation, with 4 state slots."""
    from worker_proc.runtime.config import WorkerConfig

    span = prompt_len + tokens + 1
    return ModelRunner(model_path, WorkerConfig(dtype=dtype, kv_slots=2 * span + 1, state_slots=4))


def measure_roundtrip(runner: ModelRunner, prompt: list[int], tokens: int, store_every: int,
                      dtypes: list[str]) -> list[RoundTrip]:  # fmt: skip
    """The reference and, per dtype, the free and the teacher-forced resuming lanes in lockstep."""
    if store_every < 1:
        raise ValueError(f"store_every must be >= 1, got {store_every}")
    span = len(prompt) + tokens + 1
    ref = Lane(runner, runner.pools, "ref", 1, 1)
    lanes = {}
    for sd in dtypes:
        pools = StatePools(runner.cfg, runner.kv_capacity, runner.state_capacity, runner.dtype, runner.device,
                           state_dtype=sd)  # fmt: skip
        lanes[sd] = (ResumingLane(runner, pools, "free", (1, 2), 1), ResumingLane(runner, pools, "forced", (3, 4),
                                                                                   1 + span))  # fmt: skip
    out = {sd: RoundTrip(sd) for sd in dtypes}
    with torch.inference_mode():
        ref_logits = ref.feed(prompt, 0)
        outs = {sd: (free.feed(prompt, 0), forced.feed(prompt, 0)) for sd, (free, forced) in lanes.items()}
        for t in range(tokens):
            want = int(ref_logits.argmax())
            for sd, (free_logits, forced_logits) in outs.items():
                r = out[sd]
                own = int(free_logits.argmax())
                diff = (forced_logits - ref_logits).abs()
                r.free_agree.append(own == want)
                r.forced_top1.append(int(forced_logits.argmax()) == want)
                r.max_diff.append(float(diff.max()))
                r.mean_diff.append(float(diff.mean()))
                if t + 1 < tokens:
                    free, forced = lanes[sd]
                    if free.pos % store_every == 0:  # at a block's end (absolute position), as the store
                        free.store_and_resume()
                        forced.store_and_resume()
                    outs[sd] = (free.feed([own], t + 1), forced.feed([want], t + 1))
            if t + 1 < tokens:
                ref_logits = ref.feed([want], t + 1)
    for sd, (free, _forced) in lanes.items():
        out[sd].resumes = free.resumes
    return [out[sd] for sd in dtypes]


def summary(r: RoundTrip, window: int) -> dict:
    """Per-window and overall figures of one dtype (what the table and the JSON show)."""

    def mean(xs: list) -> float:
        return sum(float(x) for x in xs) / len(xs) if xs else 0.0

    return {
        "state_dtype": r.state_dtype,
        "resumes": r.resumes,
        "first_divergence": r.first_divergence,
        "max_logit_diff": [max(w) for w in windows(r.max_diff, window)],
        "mean_logit_diff": [mean(w) for w in windows(r.mean_diff, window)],
        "forced_top1": [mean(w) for w in windows(r.forced_top1, window)],
        "free_agreement": [mean(w) for w in windows(r.free_agree, window)],
        "overall": {"max_logit_diff": max(r.max_diff, default=0.0), "mean_logit_diff": mean(r.mean_diff),
                    "forced_top1": mean(r.forced_top1), "free_agreement": mean(r.free_agree)},  # fmt: skip
    }


def run_roundtrip(model_path: str, dtype: str, prompt: list[int], tokens: int, store_every: int, window: int,
                  dtypes: list[str] | None = None) -> dict:  # fmt: skip
    """The round trip's document: its parameters and one summary per state dtype."""
    dtypes = list(STATE_DTYPES) if dtypes is None else dtypes
    unknown = [d for d in dtypes if d not in STATE_DTYPES]
    if unknown:
        raise ValueError(f"unknown state dtype(s) {unknown} (known: {', '.join(STATE_DTYPES)})")
    runner = runner_for(model_path, dtype, len(prompt), tokens)
    trips = measure_roundtrip(runner, prompt, tokens, store_every, dtypes)
    return {"tokens": tokens, "store_every": store_every, "window": window, "prompt_len": len(prompt),
            "results": [summary(r, window) for r in trips]}  # fmt: skip


def print_roundtrip(doc: dict) -> None:
    w = doc["window"]
    print(f"\nstate round trip: {doc['tokens']} greedy tokens after a {doc['prompt_len']}-token prompt, the state "
          f"stored and resumed every {doc['store_every']} tokens, against the uninterrupted float32 run")
    for r in doc["results"]:
        o, first = r["overall"], "none" if r["first_divergence"] is None else str(r["first_divergence"])
        print(f"{r['state_dtype']}: {r['resumes']} resumes; first divergence at generated token {first}; overall max "
              f"|logit diff| {o['max_logit_diff']:.2e}, forced top-1 {o['forced_top1']:.3f}, free-run agreement "
              f"{o['free_agreement']:.3f}")  # fmt: skip
        print(f"{'window':>11} | {'max |dlogit|':>12} | {'mean |dlogit|':>13} | {'forced top1':>11} | "
              f"{'free agree':>10}")  # fmt: skip
        rows = zip(r["max_logit_diff"], r["mean_logit_diff"], r["forced_top1"], r["free_agreement"], strict=True)
        for i, (mx, mn, top1, agree) in enumerate(rows):
            span = f"{i * w}-{min(i * w + w, doc['tokens']) - 1}"
            print(f"{span:>11} | {mx:>12.2e} | {mn:>13.2e} | {top1:>11.3f} | {agree:>10.3f}")
