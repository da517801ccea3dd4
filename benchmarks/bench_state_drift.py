"""How far a bfloat16 or int8 recurrent state (`--mamba-ssm-dtype`) moves a long greedy generation from float32's.

    python benchmarks/bench_state_drift.py [--model-path DIR] [--tokens 4096] [--window 512]
        [--dtypes bfloat16,int8] [--prompt TEXT] [--threads N] [--deterministic] [--output-json FILE]

In process, one model: the float32-state run generates `--tokens` greedy tokens after the prompt
(the reference); for each other state dtype, on its own state pools (and KV), two requests run alone
one token per step: a free-running greedy one, compared with the reference token by token (first
divergence, agreement rate per window), and a teacher-forced one fed the reference's tokens, whose
logits at each position are compared with the reference's (relative L2 error, KL divergence, top-1
agreement). Every number is per window of `--window` positions and overall. The prompt is
`--prompt` through the checkpoint's tokenizer.json, or fixed ids when it has none. Also reported:
bytes per state slot for each dtype (what capacity planning divides the budget by).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

import torch

from shared.config import builtin_model_dir
from shared.messages import ReqSlice, SamplingParams
from shared.model_info import ModelInfo
from worker_proc.host.numerics import flush_denormals
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner
from worker_proc.state.pools import StatePools, slot_bytes

GREEDY = SamplingParams(temperature=0.0)
DEFAULT_PROMPT = (
    "hyssm serves hybrid state-space language models: Mamba2 layers mixed with attention, behind an "
    "OpenAI-compatible HTTP API, with a radix prefix cache that stores the recurrent states."
)


@dataclass
class Drift:
    """One state dtype's comparison with the float32 state, per position (lists of `tokens` entries)."""

    state_dtype: str
    free_agree: list[bool] = field(default_factory=list)  # free-running token == reference token
    forced_top1: list[bool] = field(default_factory=list)  # teacher-forced argmax == reference token
    rel_error: list[float] = field(default_factory=list)  # ||logits - ref|| / ||ref||, teacher-forced
    kl: list[float] = field(default_factory=list)  # KL(ref || logits), teacher-forced

    @property
    def first_divergence(self) -> int | None:
        """The first generated position whose free-running token differs from the reference's."""
        return next((i for i, same in enumerate(self.free_agree) if not same), None)


class Lane:
    """One request run alone on the shared model over `pools`: prefill the prompt, then one token per step."""

    def __init__(self, runner: ModelRunner, pools: StatePools, rid: str, slot: int, kv_base: int) -> None:
        self.runner, self.pools, self.rid, self.slot, self.kv_base = runner, pools, rid, slot, kv_base
        self.pos = 0

    def feed(self, ids: list[int], step: int) -> torch.Tensor:
        """Advance by `ids`; the float32 logits [V] after the last of them."""
        end = self.pos + len(ids)
        sl = ReqSlice(rid=self.rid, input_ids=ids, start_pos=self.pos, kv_slots=list(range(self.kv_base,
                      self.kv_base + end)), state_slot=self.slot, sample=True, sampling=GREEDY)  # fmt: skip
        sb = self.runner.build_batch([sl], step, all_rows=False)
        logits = self.runner.model.forward_step(sb, self.pools, self.runner.ops)
        self.pos = end
        return logits[0].float()


def prompt_ids(model_dir: str, text: str, vocab: int) -> list[int]:
    """`text` through the checkpoint's tokenizer.json; fixed ids in [1, vocab) without one."""
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.exists(path):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path).encode(text).ids
    return [(7 * i + 3) % (vocab - 1) + 1 for i in range(max(8, len(text) // 4))]


def measure(runner: ModelRunner, prompt: list[int], tokens: int, dtypes: list[str]) -> list[Drift]:
    """Run the reference and, per dtype, the free and the teacher-forced lanes in lockstep (no logits kept)."""
    span = len(prompt) + tokens + 1
    ref = Lane(runner, runner.pools, "ref", 1, 1)
    lanes = {}
    for sd in dtypes:
        pools = StatePools(runner.cfg, runner.kv_capacity, runner.state_capacity, runner.dtype, runner.device,
                           state_dtype=sd)  # fmt: skip
        lanes[sd] = (Lane(runner, pools, "free", 1, 1), Lane(runner, pools, "forced", 2, 1 + span))
    drifts = {sd: Drift(sd) for sd in dtypes}
    with torch.inference_mode():
        ref_logits = ref.feed(prompt, 0)
        outs = {sd: (free.feed(prompt, 0), forced.feed(prompt, 0)) for sd, (free, forced) in lanes.items()}
        for t in range(tokens):
            want = int(ref_logits.argmax())
            ref_logp = torch.log_softmax(ref_logits, -1)
            for sd, (free_logits, forced_logits) in outs.items():
                d = drifts[sd]
                own = int(free_logits.argmax())
                d.free_agree.append(own == want)
                d.forced_top1.append(int(forced_logits.argmax()) == want)
                d.rel_error.append(float((forced_logits - ref_logits).norm() / ref_logits.norm()))
                logp = torch.log_softmax(forced_logits, -1)
                d.kl.append(float((ref_logp.exp() * (ref_logp - logp)).sum()))
                if t + 1 < tokens:
                    free, forced = lanes[sd]
                    outs[sd] = (free.feed([own], t + 1), forced.feed([want], t + 1))
            if t + 1 < tokens:
                ref_logits = ref.feed([want], t + 1)
    return [drifts[sd] for sd in dtypes]


def windows(values: list, window: int) -> list[list]:
    return [values[i : i + window] for i in range(0, len(values), window)]


def summary(d: Drift, window: int) -> dict:
    """The per-window and overall figures of one dtype (what the table and the JSON show)."""

    def mean(xs: list) -> float:
        return sum(float(x) for x in xs) / len(xs) if xs else 0.0

    return {
        "state_dtype": d.state_dtype,
        "first_divergence": d.first_divergence,
        "free_agreement": [mean(w) for w in windows(d.free_agree, window)],
        "forced_top1": [mean(w) for w in windows(d.forced_top1, window)],
        "rel_error_mean": [mean(w) for w in windows(d.rel_error, window)],
        "rel_error_max": [max(w) for w in windows(d.rel_error, window)],
        "kl_mean": [mean(w) for w in windows(d.kl, window)],
        "overall": {"free_agreement": mean(d.free_agree), "forced_top1": mean(d.forced_top1),
                    "rel_error_mean": mean(d.rel_error), "rel_error_max": max(d.rel_error, default=0.0),
                    "kl_mean": mean(d.kl)},  # fmt: skip
    }


def print_report(header: str, results: list[dict], bytes_per_slot: dict[str, int], window: int) -> None:
    print(header)
    print("bytes per state slot: " + ", ".join(f"{sd} {b}" for sd, b in bytes_per_slot.items()))
    for r in results:
        first = "none" if r["first_divergence"] is None else str(r["first_divergence"])
        o = r["overall"]
        print(f"\n{r['state_dtype']}: first divergence at generated token {first}; overall free-run agreement "
              f"{o['free_agreement']:.3f}, teacher-forced top-1 {o['forced_top1']:.3f}, logit rel error mean "
              f"{o['rel_error_mean']:.2e} max {o['rel_error_max']:.2e}, KL mean {o['kl_mean']:.2e}")
        print(f"{'window':>11} | {'free agree':>10} | {'forced top1':>11} | {'rel err mean':>12} | "
              f"{'rel err max':>11} | {'KL mean':>9}")
        for i, row in enumerate(zip(r["free_agreement"], r["forced_top1"], r["rel_error_mean"], r["rel_error_max"],
                                    r["kl_mean"], strict=True)):  # fmt: skip
            lo = i * window
            print(f"{f'{lo}-{lo + window - 1}':>11} | {row[0]:>10.3f} | {row[1]:>11.3f} | {row[2]:>12.2e} | "
                  f"{row[3]:>11.2e} | {row[4]:>9.2e}")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=builtin_model_dir())
    ap.add_argument("--tokens", type=int, default=4096, help="greedy tokens generated after the prompt")
    ap.add_argument("--window", type=int, default=512, help="positions per reported window")
    ap.add_argument("--dtypes", default="bfloat16,int8", help="state dtypes compared with float32")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--dtype", default="float32", help="the model dtype (--dtype)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--deterministic", action="store_true", help="the batch-invariant reference kernels")
    ap.add_argument("--output-json", default="")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.window < 1:
        ap.error("--tokens and --window must be positive")
    dtypes = [d for d in args.dtypes.split(",") if d]
    flush_denormals()  # as a worker process does, before its first parallel region
    torch.set_num_threads(args.threads)
    prompt = prompt_ids(args.model_path, args.prompt, ModelInfo.from_dir(args.model_path).vocab_size)
    span = len(prompt) + args.tokens + 1
    runner = ModelRunner(args.model_path,
        WorkerConfig(dtype=args.dtype, kv_slots=2 * span + 1, state_slots=2, deterministic=args.deterministic))
    bytes_per_slot = {sd: slot_bytes(runner.cfg, runner.dtype, state_dtype=sd).state_slot
                      for sd in ["float32", *dtypes]}  # fmt: skip
    results = [summary(d, args.window) for d in measure(runner, prompt, args.tokens, dtypes)]
    header = (
        f"{args.model_path}: {args.tokens} greedy tokens after a {len(prompt)}-token prompt, model "
        f"{runner.dtype}, {runner.ops.name} kernels, {args.threads} threads; against the float32 state"
    )
    print_report(header, results, bytes_per_slot, args.window)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model_path, "tokens": args.tokens, "window": args.window,
                       "prompt_len": len(prompt), "bytes_per_state_slot": bytes_per_slot, "results": results}, f,
                      indent=1)  # fmt: skip
    return results


if __name__ == "__main__":
    main()
