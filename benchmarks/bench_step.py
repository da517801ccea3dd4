"""Worker step time in process: `ModelRunner.step` for a prefill and for decode at several batch sizes.

    python benchmarks/bench_step.py --model-path DIR [--threads 2] [--batches 1,8,32] [--prompt-len 128]
        [--dtype float32] [--mamba-ssm-dtype float32] [--deterministic] [--runs 3] [--device cpu|cuda]

No server, no sockets: the figures are the model's own cost per step (what `/get_server_info`
reports as `scheduler.loop.worker_ms_mean` on a live server). Each batch size prefills its requests
one by one (the first prefill's time is the cold-prompt figure), then times decode steps; medians
over `--runs` runs of the whole sequence.

On the CPU each run also measures a one-row step's floor right after its batch-1 decode steps: the
products' weights read once by the execution plan's own read pass (`plan_timing.read_bytes_per_s`).
The step / floor ratio is taken run by run, so that both halves meet the same minute of a machine
whose memory bandwidth drifts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shared.config import builtin_model_dir
from shared.messages import ForwardBatch, ReqSlice, SamplingParams
from worker_proc.host.memory import map_load_blocks
from worker_proc.host.numerics import flush_denormals
from worker_proc.plan.execution_plan import instances_of
from worker_proc.plan.product_timer import read_bytes_per_s, weight_bytes
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)
SLOT_STRIDE = 4096  # KV slots reserved per request


def _timed(runner: ModelRunner, batch: ForwardBatch) -> tuple[float, dict[str, int]]:
    t0 = time.perf_counter()
    res = runner.step(batch)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t0, res.next_tokens


def run_batch(runner: ModelRunner, batch_size: int, prompt_len: int, steps: int, step0: int) -> tuple[float, float]:
    """(seconds of the first prefill, median seconds of a decode step at `batch_size`)."""
    pos: dict[str, tuple[int, int]] = {}
    prefill_s = 0.0
    step = step0
    for b in range(batch_size):
        rid, base = f"r{b}", b * SLOT_STRIDE + 1
        ids = [(7 * i + b) % 200 + 1 for i in range(prompt_len)]
        req = ReqSlice(rid=rid, input_ids=ids, start_pos=0, kv_slots=list(range(base, base + prompt_len)),
                       state_slot=b + 1, sample=True, sampling=GREEDY, output_len=0)  # fmt: skip
        step += 1
        dt, toks = _timed(runner, ForwardBatch(step=step, reqs=[req], clears=[b + 1]))
        prefill_s = prefill_s or dt
        pos[rid] = (prompt_len, toks[rid])
    times = []
    for s in range(steps):
        reqs = []
        for b in range(batch_size):
            rid, base = f"r{b}", b * SLOT_STRIDE + 1
            p, tok = pos[rid]
            reqs.append(ReqSlice(rid=rid, input_ids=[tok], start_pos=p, kv_slots=list(range(base, base + p + 1)),
                                 state_slot=b + 1, sample=True, sampling=GREEDY, output_len=s + 1))  # fmt: skip
        step += 1
        dt, toks = _timed(runner, ForwardBatch(step=step, reqs=reqs))
        times.append(dt)
        for rid, (p, _) in pos.items():
            pos[rid] = (p + 1, toks[rid])
    return prefill_s, statistics.median(times[1:] or times)


def floor_s(runner: ModelRunner) -> float:
    """Seconds a one-row step takes at least this minute: the products' weights (each tensor once) over
    the rate the plan's read pass reads them at now."""
    instances = instances_of(runner.model)
    rate = read_bytes_per_s(instances)
    return weight_bytes(instances) / rate if rate > 0 else 0.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=builtin_model_dir())
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mamba-ssm-dtype", default="float32", help="recurrent-state storage: float32, bfloat16, int8")
    ap.add_argument("--deterministic", action="store_true", help="the batch-invariant mode")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="torch device of the model: cpu (default), cuda, cuda:N")
    ap.add_argument("--quantization", default="", choices=("", "int8", "int4", "fp8"),
                    help="weights quantized at load, as the server's --quantization")
    args = ap.parse_args(argv)
    flush_denormals()  # as a worker process does, before its first parallel region
    map_load_blocks()  # the worker's load policy; the runner applies the steps' once loaded
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    runner = ModelRunner(
        args.model_path,
        WorkerConfig(
            device=args.device,
            dtype=args.dtype,
            kv_slots=max(batches) * SLOT_STRIDE,
            state_slots=max(batches),
            deterministic=args.deterministic,
            quantization=args.quantization,
            state_dtype=args.mamba_ssm_dtype,
        ),
    )
    results: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    floors: list[tuple[float, float]] = []  # (floor seconds, batch-1 step / floor) per run
    step = 0
    for _ in range(args.runs):
        for b in batches:
            results[b].append(run_batch(runner, b, args.prompt_len, args.decode_steps, step))
            step += 10_000
            if b == 1 and runner.device.type == "cpu":
                floor = floor_s(runner)
                floors.append((floor, results[b][-1][1] / floor if floor > 0 else 0.0))
    mode = "deterministic" if args.deterministic else "default"
    quant = f", {args.quantization} weights" if args.quantization else ""
    print(
        f"{args.model_path} ({runner.dtype}{quant} on {runner.device}, {args.mamba_ssm_dtype} state, "
        f"{args.threads} threads, {mode} mode, {runner.ops.name} kernels); medians of {args.runs} runs"
    )
    print(f"{'batch':>5} | {'prefill ' + str(args.prompt_len) + ' ms':>14} | {'decode ms/step':>14} | {'tok/s':>8}")
    for b in batches:
        prefill = statistics.median(r[0] for r in results[b]) * 1000
        decode = statistics.median(r[1] for r in results[b]) * 1000
        print(f"{b:>5} | {prefill:>14.1f} | {decode:>14.2f} | {b / decode * 1000:>8.1f}")
    if floors:
        print(
            f"one-row step floor (weights read once, measured after each run's batch-1 steps): "
            f"{statistics.median(f for f, _ in floors) * 1000:.2f} ms; batch-1 step / floor, run by run: "
            f"{', '.join(f'{r:.2f}' for _, r in floors)} (median {statistics.median(r for _, r in floors):.2f})"
        )


if __name__ == "__main__":
    main()
