"""Memory of serving one long prompt at default flags: hyssm against llama.cpp's llama-server.

    python -m benchmarks.bench_long_prompt_memory --model ~/.cache/hyssm/bench-models/granite-4.0-h-350m-...
    python -m benchmarks.bench_long_prompt_memory --model M --prompt-tokens 16384 --runs 3 --output-json out.json

One server at a time (the other is not running while it is measured): it starts with its default flags
(hyssm: ``launch.py --model-path M --dtype D``; llama-server: ``-m M.D.gguf -c PROMPT+OUTPUT+512 --threads
$(nproc)``, its other settings its own defaults), answers `/health`, is sampled idle, then serves one prompt
of ``--prompt-tokens`` token ids (the same ids for both, a fixed pattern over the vocabulary) with
``--output-tokens`` greedy tokens; the peak RSS of its whole process tree (every process: hyssm's launcher,
tokenizer, scheduler and worker) is sampled every 50 ms from the start to the answer. Each run is a fresh
server. The table gives medians of the runs: idle and peak MiB, the seconds the request took, and the
ratio of the peaks. The configurations are printed with the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peers_commands import default_llama_server  # noqa: E402
from benchmarks.peers_gguf import gguf_for  # noqa: E402
from benchmarks.peers_procs import ManagedProcess, PeerError, RssSampler, free_port, tree_rss_bytes  # noqa: E402

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
PEERS_SCRIPT = str(REPO.parent / "shared" / "peers" / "llama-server.sh")
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32"}
CONTEXT_ROOM = 512
"""Tokens llama-server's context holds beyond the prompt and the output."""


def prompt_ids(tokens: int, vocab: int) -> list[int]:
    """A fixed prompt of `tokens` ids spread over the vocabulary (no special tokens: ids from 100)."""
    return [(i * 7919) % (vocab - 200) + 100 for i in range(tokens)]


def post(url: str, body: dict[str, object], timeout_s: float) -> dict[str, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def measure(name: str, cmd: Sequence[str], port: int, request: tuple[str, dict[str, object]], log_dir: Path,
            ready_s: float, request_s: float) -> dict[str, float]:
    """One fresh server: idle tree RSS once ready, peak tree RSS up to the answer, the request's seconds."""
    server = ManagedProcess(name, cmd, log_dir / f"{name}-{port}.log", cwd=str(REPO))
    sampler = RssSampler(server.proc.pid, interval_s=0.05)
    try:
        server.wait_ready(f"http://127.0.0.1:{port}/health", ready_s)
        idle = tree_rss_bytes(server.proc.pid)
        t0 = time.monotonic()
        post(f"http://127.0.0.1:{port}{request[0]}", request[1], request_s)
        seconds = time.monotonic() - t0
        peak = sampler.stop()
    finally:
        sampler.stop()
        server.stop()
    return {"idle_mib": idle / 2**20, "peak_mib": peak / 2**20, "seconds": seconds}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (e.g. from make_bench_model.py)")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(GGUF_TYPES), help="hyssm --dtype and the GGUF's")
    ap.add_argument("--prompt-tokens", type=int, default=16384)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3, help="fresh servers per system; the table shows medians")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--llama-server", default="", help="llama-server binary (default: llama-server.sh's)")
    ap.add_argument("--hyssm-args", default="", help="extra launch.py flags, one string")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds for a server to start")
    ap.add_argument("--request-timeout", type=float, default=1800.0, help="seconds for the long prompt's answer")
    ap.add_argument("--output-json", default="")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    ids = prompt_ids(args.prompt_tokens, vocab)
    ctx = args.prompt_tokens + args.output_tokens + CONTEXT_ROOM
    results: dict[str, list[dict[str, float]]] = {"hyssm": [], "llama.cpp": []}
    configs: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-long-prompt-") as tmp:
        log_dir = Path(tmp)
        llama = None
        if not args.skip_llama:
            binary = args.llama_server or str(default_llama_server(PEERS_SCRIPT) or "")
            if not binary or not Path(binary).is_file():
                raise PeerError(f"no llama-server binary ({binary or 'none found'}): run llama-server.sh build")
            gguf = gguf_for(args.model, PEERS_SCRIPT, log_dir, GGUF_TYPES[args.dtype])
            llama = (binary, gguf)
        for _ in range(args.runs):
            port = free_port()
            cmd = [sys.executable, "launch.py", "--model-path", args.model, "--dtype", args.dtype, "--host",
                   "127.0.0.1", "--port", str(port), *args.hyssm_args.split()]
            configs["hyssm"] = " ".join(cmd[1:])
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": args.output_tokens, "temperature": 0,
                                                          "ignore_eos": True}}
            results["hyssm"].append(measure("hyssm", cmd, port, ("/generate", body), log_dir, args.ready_timeout,
                                            args.request_timeout))
            if llama is not None:
                port = free_port()
                cmd = [llama[0], "-m", str(llama[1]), "-c", str(ctx), "--threads", str(os.cpu_count() or 1),
                       "--host", "127.0.0.1", "--port", str(port)]
                configs["llama.cpp"] = " ".join(cmd)
                body = {"prompt": ids, "n_predict": args.output_tokens, "temperature": 0, "ignore_eos": True}
                results["llama.cpp"].append(measure("llama.cpp", cmd, port, ("/completion", body), log_dir,
                                                    args.ready_timeout, args.request_timeout))
    print(report(results, configs, args.prompt_tokens))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"runs": results, "configs": configs}, indent=1))
    return 0


def report(results: dict[str, list[dict[str, float]]], configs: dict[str, str], prompt_tokens: int) -> str:
    """The table of medians (see the module doc), the configurations below it."""
    lines = [f"one prompt of {prompt_tokens} tokens, medians of {max(len(r) for r in results.values())} fresh servers",
             f"{'system':<10} {'idle MiB':>9} {'peak MiB':>9} {'seconds':>8}"]
    medians = {}
    for name, runs in results.items():
        if not runs:
            continue
        medians[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        m = medians[name]
        lines.append(f"{name:<10} {m['idle_mib']:>9.0f} {m['peak_mib']:>9.0f} {m['seconds']:>8.1f}")
    if len(medians) == 2:
        ratio = medians["hyssm"]["peak_mib"] / medians["llama.cpp"]["peak_mib"]
        lines.append(f"peak ratio hyssm / llama.cpp: {ratio:.2f}x")
    lines += [f"{name}: {cmd}" for name, cmd in configs.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
