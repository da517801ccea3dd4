"""bench_peers' transformers column: ``model.generate`` timed in its own process.

Run by bench_peers as ``python benchmarks/peers_transformers.py JOB.json OUT.json``;
transformers is imported only here (it is not a dependency of the project). JOB holds the model
directory, its dtype (``float32`` when absent; the model is loaded in it and OUT's ``dtype`` says
which dtype its parameters had), the thread count, the output length, the ``warmup`` prompt (one list
of ids: generated 2 tokens on before anything is timed; no measured prompt shares a token with it), the
``settle`` rule ({"quiet_s", "timeout_s", "max_cpu"}, see `settle`) and, per run, the same prompts the
servers get:
``throughput`` {batch size: [prompts]}, ``cold`` [prompt], ``prefix`` [prefix + suffix], ``shared``
[shared prefix + third suffix] (each a list of token ids; all prompts of a batch have the same length,
so no padding). OUT gets, per run, the
bench_peers metric keys (see peers_report.METRICS). Definitions (greedy, EOS ignored through
min_new_tokens = max_new_tokens):
- ``tps_cB``: B * out / seconds of one static-batch generate of B prompts;
- ``ttft_cold_ms``: generate of 1 token on the cold prompt (prefill + one step), after `settle`
  (as each TTFT below; the seconds waited are ``settle_*_s``);
- ``ttft_prefix_ms``: the same on the continuation prompt, prefix + suffix (transformers keeps no
  cache across calls, so it is a whole prompt);
- ``ttft_shared_ms``: the same on the shared-prefix scenario's measured prompt (also a whole prompt;
  the two requests that teach a server the prefix have nothing to teach here and are not sent);
- ``decode_ms``: median gap between consecutive new tokens of the batch-1 generate, timed by a
  streamer (transformers calls its put() once per generated token).
"""

from __future__ import annotations

import gc
import json
import logging
import statistics
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)


class _TokenClock:
    """A generate() streamer that records when each put() happens (the prompt first, then each token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: object) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _generate(model: Any, torch: Any, prompts: list[list[int]], new: int, pad_id: int, clock: Any = None) -> float:
    ids = torch.tensor(prompts, dtype=torch.long)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad_id, streamer=clock)  # fmt: skip
    dt = time.perf_counter() - t0
    if out.shape[1] != ids.shape[1] + new:
        raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, expected {new}")
    return dt


DTYPES = ("float32", "bfloat16")
SETTLE_POLL_S = 0.05


def settle(quiet_s: float = 0.5, timeout_s: float = 120.0, max_cpu: float = 0.25,
           cpu_clock: Any = time.process_time) -> float:  # fmt: skip
    """Before a timed generate, as bench_peers waits for an idle server: collect garbage, then wait until
    this process (every thread: torch's OpenMP workers spin on after a parallel region) used at most
    `max_cpu` cores over a window of `quiet_s` seconds; a busier window starts afresh. Returns the seconds
    waited; RuntimeError after `timeout_s`."""
    gc.collect()
    t0 = time.monotonic()
    start, cpu0 = t0, cpu_clock()
    while True:
        time.sleep(SETTLE_POLL_S)  # polling period of the CPU clock (the condition is read below)
        now, cpu = time.monotonic(), cpu_clock()
        if now - start >= quiet_s:
            if (cpu - cpu0) / max(now - start, 1e-9) <= max_cpu:
                return now - t0
            start, cpu0 = now, cpu
        if now - t0 > timeout_s:
            raise RuntimeError(f"this process did not go quiet within {timeout_s:.0f}s")


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Every run of `job` (see the module docstring); raises ValueError on a dtype not in DTYPES."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = str(job.get("dtype", "float32"))
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch.set_num_threads(int(job["threads"]))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, dtype))
    model.eval()
    load_s = time.perf_counter() - t0
    loaded = str(next(model.parameters()).dtype).removeprefix("torch.")
    pad = int(model.config.pad_token_id or 0)
    out_len = int(job["output_len"])
    rule = dict(job.get("settle", {}))
    _generate(model, torch, [job["warmup"]], 2, pad)  # warm-up (allocator, lazy init); shares no token with the rest
    runs = []
    for run in job["runs"]:
        m: dict[str, float] = {}
        for key, prompt in (("cold", run["cold"]), ("prefix", run["prefix"]), ("shared", run["shared"])):
            m[f"settle_{key}_s"] = settle(**rule)
            m[f"ttft_{key}_ms"] = _generate(model, torch, prompt, 1, pad) * 1000.0
        for b, prompts in sorted(run["throughput"].items(), key=lambda kv: int(kv[0])):
            clock = _TokenClock() if int(b) == 1 else None  # streamers take batch 1 only
            dt = _generate(model, torch, prompts, out_len, pad, clock)
            m[f"tps_c{b}"] = len(prompts) * out_len / dt
            if clock is not None and len(clock.times) > 2:
                gaps = [b2 - a2 for a2, b2 in zip(clock.times[1:], clock.times[2:], strict=False)]
                m["decode_ms"] = statistics.median(gaps) * 1000.0
        runs.append(m)
        logger.info("transformers run: %s", m)
    return {"runs": runs, "load_s": load_s, "dtype": loaded, "transformers": __import__("transformers").__version__}


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if len(argv) != 2:
        print("usage: peers_transformers.py JOB.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        job = json.load(f)
    result = run_job(job)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
