"""What quantized weights and smaller recurrent states cost in accuracy: perplexity on a held-out text and
greedy agreement with the unquantized model, for every mode.

    python benchmarks/bench_quality.py [--model-path DIR] [--text FILE] [--tokens 4096] [--chunk 512]
        [--greedy-tokens 256] [--modes int8,int4,fp8,state:bfloat16,state:int8] [--roundtrip-tokens 4096]
        [--store-every 64] [--window 512] [--state-dtypes float32,bfloat16,int8] [--small] [--output-json FILE]

In process, one runner per mode (`--quantization` for `int8` / `int4` / `fp8`, `--mamba-ssm-dtype` for
`state:DTYPE`), each against the baseline (the model dtype's weights, float32 state):
- perplexity: the first `--tokens` tokens of `--text` (default: benchmarks/data/heldout.txt, plain prose
  in the style of the built-in model's training text but not part of it), teacher-forced in
  `--chunk`-token prefill steps as a server prefills a long prompt (the state is stored between
  chunks); exp(mean NLL) overall and per chunk (where the drift by position shows), and the change
  against the baseline in percent;
- greedy agreement: the baseline's `--greedy-tokens` greedy tokens after the text's first 64 tokens,
  the mode free-running from the same prompt (its first divergence) and teacher-forced on the
  baseline's tokens (the share of positions whose next token it picks the same);
- state round trip (quality_roundtrip.py), for every state dtype (`--state-dtypes`, default all of
  `--mamba-ssm-dtype`'s): `--roundtrip-tokens` greedy tokens after the text's first 64 tokens whose
  recurrent state is stored and resumed from its stored bytes every `--store-every` positions, against
  the uninterrupted float32 run: max/mean |logit difference| and top-1 agreement teacher-forced, token
  agreement free-running, per `--window` positions (0 round-trip tokens: skipped).
`--small`: a few hundred tokens of each (what the tests run); explicit flags win.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.quality_roundtrip import DEFAULT_STORE_EVERY, STATE_DTYPES, print_roundtrip, run_roundtrip
from shared.config import builtin_model_dir
from shared.messages import ReqSlice, SamplingParams
from worker_proc.host.numerics import flush_denormals
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

HELD_OUT = Path(__file__).resolve().parent / "data" / "heldout.txt"
GREEDY = SamplingParams(temperature=0.0)
PROMPT_TOKENS = 64
DEFAULT_MODES = "int8,int4,fp8,state:bfloat16,state:int8"
SIZES = {"tokens": 4096, "chunk": 512, "greedy_tokens": 256, "roundtrip_tokens": 4096, "window": 512}
SMALL = {"tokens": 256, "chunk": 64, "greedy_tokens": 16, "roundtrip_tokens": 192, "window": 64}


@dataclass(frozen=True)
class Mode:
    """One configuration measured against the baseline."""

    name: str
    quantization: str = ""
    state_dtype: str = "float32"

    @classmethod
    def parse(cls, text: str) -> Mode:
        if text.startswith("state:"):
            return cls(text, state_dtype=text.removeprefix("state:"))
        if text in ("int8", "int4", "fp8"):
            return cls(text, quantization=text)
        raise ValueError(f"unknown mode {text!r} (int8, int4, fp8 or state:float32|bfloat16|int8)")


def text_ids(model_dir: str, path: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(Path(path).read_text()).ids


def all_logits(runner: ModelRunner, ids: list[int], chunk: int, slot: int = 1) -> torch.Tensor:
    """Logits [len(ids), V] (float32) of every position, prefilled `chunk` tokens per step."""
    out = []
    with torch.inference_mode():
        runner.pools.clear_state(slot)
        for step, start in enumerate(range(0, len(ids), chunk)):
            part = ids[start : start + chunk]
            sl = ReqSlice(rid="q", input_ids=part, start_pos=start, kv_slots=list(range(1, start + len(part) + 1)),
                          state_slot=slot, sample=True, sampling=GREEDY)  # fmt: skip
            sb = runner.build_batch([sl], step, all_rows=True)
            out.append(runner.model.forward_step(sb, runner.pools, runner.ops).float())
    return torch.cat(out)


def greedy(runner: ModelRunner, prompt: list[int], tokens: int) -> list[int]:
    """`tokens` greedy tokens after `prompt` (one token per step)."""
    ids = list(prompt)
    with torch.inference_mode():
        runner.pools.clear_state(2)
        start, feed = 0, list(prompt)
        for step in range(tokens):
            sl = ReqSlice(rid="g", input_ids=feed, start_pos=start, kv_slots=list(range(1, start + len(feed) + 1)),
                          state_slot=2, sample=True, sampling=GREEDY)  # fmt: skip
            logits = runner.model.forward_step(runner.build_batch([sl], step, all_rows=False), runner.pools,
                                               runner.ops)  # fmt: skip
            start += len(feed)
            feed = [int(logits[0].argmax())]
            ids.extend(feed)
    return ids[len(prompt):]


def nll(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Per-position negative log-likelihood of ids[1:] given the logits of ids[:-1]."""
    target = torch.tensor(ids[1:])
    return -torch.log_softmax(logits[:-1], -1).gather(1, target[:, None])[:, 0]


def measure(runner: ModelRunner, ids: list[int], chunk: int, gen_tokens: int,
            reference: dict | None) -> dict:  # fmt: skip
    """One mode's figures; with `reference` (the baseline's), the comparison with it."""
    logits = all_logits(runner, ids, chunk)
    losses = nll(logits, ids)
    per_chunk = [math.exp(float(losses[i : i + chunk].mean())) for i in range(0, len(losses), chunk)]
    out: dict = {"perplexity": math.exp(float(losses.mean())), "perplexity_by_chunk": per_chunk,
                 "_losses": losses}  # fmt: skip
    prompt = ids[:PROMPT_TOKENS]
    if reference is None:
        out["_greedy"] = greedy(runner, prompt, gen_tokens)
        return out
    base_gen = reference["_greedy"]
    own = greedy(runner, prompt, gen_tokens)
    first = next((i for i, (a, b) in enumerate(zip(own, base_gen, strict=True)) if a != b), None)
    forced = all_logits(runner, prompt + base_gen, chunk).argmax(-1)[len(prompt) - 1 : -1]
    out["perplexity_change_pct"] = 100.0 * (out["perplexity"] / reference["perplexity"] - 1.0)
    out["perplexity_change_pct_by_chunk"] = [100.0 * (a / b - 1.0) for a, b in
                                             zip(per_chunk, reference["perplexity_by_chunk"], strict=True)]
    out["greedy_first_divergence"] = first
    out["greedy_forced_agreement"] = float((forced == torch.tensor(base_gen)).float().mean())
    return out


def run(model_path: str, text: str, tokens: int, chunk: int, gen_tokens: int, modes: list[Mode],
        dtype: str = "float32") -> dict[str, dict]:  # fmt: skip
    """Every mode's figures, the baseline's under "baseline" (private keys start with "_")."""
    ids = text_ids(model_path, text)[:tokens]
    if len(ids) < PROMPT_TOKENS + 2:
        raise ValueError(f"{text}: {len(ids)} tokens, at least {PROMPT_TOKENS + 2} are needed")
    kv = max(len(ids), PROMPT_TOKENS + gen_tokens) + 1

    def runner(mode: Mode) -> ModelRunner:
        return ModelRunner(
            model_path,
            WorkerConfig(
                dtype=dtype, kv_slots=kv, state_slots=2, quantization=mode.quantization, state_dtype=mode.state_dtype
            ),
        )

    results = {"baseline": measure(runner(Mode("baseline")), ids, chunk, gen_tokens, None)}
    for mode in modes:
        results[mode.name] = measure(runner(mode), ids, chunk, gen_tokens, results["baseline"])
    for r in results.values():
        r["tokens"] = len(ids)
    return results


def print_report(results: dict[str, dict], header: str) -> None:
    print(header)
    print(
        f"{'mode':>15} | {'perplexity':>10} | {'change':>8} | {'worst chunk':>11} | {'greedy same until':>17} | "
        f"{'next token agrees':>17}"
    )
    for name, r in results.items():
        change = r.get("perplexity_change_pct")
        worst = max(r.get("perplexity_change_pct_by_chunk", [0.0]))
        first = r.get("greedy_first_divergence", "")
        agree = r.get("greedy_forced_agreement")
        print(
            f"{name:>15} | {r['perplexity']:>10.4f} | "
            f"{'' if change is None else f'{change:+.2f}%':>8} | {'' if change is None else f'{worst:+.2f}%':>11} | "
            f"{'all' if first is None else str(first):>17} | {'' if agree is None else f'{agree:.3f}':>17}"
        )


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=builtin_model_dir())
    ap.add_argument("--text", default=str(HELD_OUT), help="held-out text (the model was not trained on it)")
    ap.add_argument("--tokens", type=int, help="tokens of the text scored (default 4096; --small 256)")
    ap.add_argument("--chunk", type=int, help="tokens per prefill step (and per reported chunk; default 512)")
    ap.add_argument("--greedy-tokens", type=int, help="default 256; --small 16")
    ap.add_argument("--modes", default=DEFAULT_MODES)
    ap.add_argument("--roundtrip-tokens", type=int, help="state round trip: greedy tokens (default 4096; 0: skip)")
    ap.add_argument("--store-every", type=int, default=DEFAULT_STORE_EVERY,
                    help="state round trip: positions between a store and resume (--state-cache-block-tokens)")
    ap.add_argument("--window", type=int, help="state round trip: positions per reported window (default 512)")
    ap.add_argument("--state-dtypes", default="", help="state round trip: comma-separated (default: every one)")
    ap.add_argument("--small", action="store_true", help="a few hundred tokens of everything: " + str(SMALL))
    ap.add_argument("--dtype", default="float32", help="the model dtype (--dtype)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--output-json", default="")
    args = ap.parse_args(argv)
    for key, value in (SMALL if args.small else SIZES).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.tokens, args.chunk, args.greedy_tokens, args.window, args.store_every) < 1 or args.roundtrip_tokens < 0:
        ap.error("--tokens, --chunk, --greedy-tokens, --window and --store-every must be positive, "
                 "--roundtrip-tokens >= 0")  # fmt: skip
    try:
        modes = [Mode.parse(m) for m in args.modes.split(",") if m]
    except ValueError as e:
        ap.error(str(e))
    dtypes = [d for d in args.state_dtypes.split(",") if d] or list(STATE_DTYPES)
    if unknown := [d for d in dtypes if d not in STATE_DTYPES]:
        ap.error(f"unknown state dtype(s) {', '.join(unknown)} for --state-dtypes (known: {', '.join(STATE_DTYPES)})")
    flush_denormals()  # as a worker process does, before its first parallel region
    torch.set_num_threads(args.threads)
    results = run(args.model_path, args.text, args.tokens, args.chunk, args.greedy_tokens, modes, args.dtype)
    n = results["baseline"]["tokens"]
    print_report(
        results,
        f"{args.model_path}: perplexity over {n} tokens of {args.text} in {args.chunk}-token "
        f"steps; greedy: {args.greedy_tokens} tokens after its first {PROMPT_TOKENS}",
    )
    public = {name: {k: v for k, v in r.items() if not k.startswith("_")} for name, r in results.items()}
    doc = {"model": args.model_path, "text": args.text, "results": public}
    if args.roundtrip_tokens:
        prompt = text_ids(args.model_path, args.text)[:PROMPT_TOKENS]
        doc["state_roundtrip"] = results["state_roundtrip"] = run_roundtrip(
            args.model_path, args.dtype, prompt, args.roundtrip_tokens, args.store_every, args.window, dtypes)
        print_roundtrip(doc["state_roundtrip"])
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(doc, indent=1))
    return results


if __name__ == "__main__":
    main()
