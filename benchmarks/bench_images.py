"""Image requests against one server: TTFT and throughput for 1 and 4 images per request, at concurrency 1
and 8, cold (images never seen) and cached (the same images after the same text again: the encoder cache and
the prefix cache both hit).

    python -m benchmarks.bench_images --shape tiny --out images_tiny.json
    python -m benchmarks.bench_images --shape qwen3.5-tower --image-side 448 --out images_tower.json

Checkpoints (random weights, written once under ``--model-dir``, default
``$XDG_CACHE_HOME/hyssm/bench-models/vision-SHAPE``): ``tiny`` is the test fixture's tower (2 blocks of 32
channels) before a tiny Gated DeltaNet hybrid; ``qwen3.5-tower`` has the vision tower of the released Qwen3.5
checkpoints (27 blocks, 1152 channels, 16 heads, MLP 4304, patch 16, merge 2, a 48 x 48 learned position grid)
before a small text model (4 layers of 1024: the tower is what is measured). Images are RGB noise PNGs of
``--image-side`` pixels sent as ``data:`` URLs in OpenAI chat content parts; the image processor's
``max_pixels`` is raised so that they are not shrunk.

The server: ``launch.py --dtype float32 --max-running-requests 8`` on a free loopback port in its own process
group (stopped, that group only, at the end and on error), warmed up with one text and one image request.
TTFT = seconds from sending a non-streaming chat completion of ``max_tokens=1`` to its answer; throughput =
completion tokens per second of a wave of ``--concurrency``-many requests of ``--max-tokens`` each (every
request its own images when cold; one request's images and text repeated when cached, after one unmeasured
request warmed the caches). Each cell is the median of ``--runs`` waves; the table's last column is
cached TTFT / cold TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.peers_procs import ManagedProcess, free_port

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
QWEN35_TOWER = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, num_position_embeddings=2304)
SMALL_TEXT = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                  intermediate_size=3072, linear_num_key_heads=8, linear_num_value_heads=16,
                  linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=4096,
                  layer_types=["linear_attention"] * 3 + ["full_attention"])  # fmt: skip
SHAPES: dict[str, tuple[dict, dict]] = {"tiny": ({}, {}), "qwen3.5-tower": (QWEN35_TOWER, SMALL_TEXT)}


@dataclass(frozen=True)
class Config:
    shape: str
    model_dir: str
    image_side: int
    runs: int
    max_tokens: int
    concurrency: tuple[int, ...]
    images: tuple[int, ...]
    out: str | None
    log_dir: str


def ensure_model(cfg: Config) -> str:
    if os.path.isfile(os.path.join(cfg.model_dir, "config.json")):
        return cfg.model_dir
    from tests.fixtures.vision_model import make_vision_model

    vision, text = SHAPES[cfg.shape]
    logger.info("writing the %s checkpoint to %s", cfg.shape, cfg.model_dir)
    make_vision_model(cfg.model_dir, vision=vision, text=text, max_pixels=max(cfg.image_side**2 * 2, 256 * 256))
    return cfg.model_dir


class ImageSource:
    """Distinct noise images as data URLs (seed -> URL, made once)."""

    def __init__(self, side: int) -> None:
        self.side, self.urls, self.next_seed = side, {}, 1

    def url(self, seed: int) -> str:
        if seed not in self.urls:
            from tests.fixtures.vision_model import image, png_bytes

            self.urls[seed] = "data:image/png;base64," + base64.b64encode(png_bytes(image(self.side, self.side,
                                                                                          seed))).decode()
        return self.urls[seed]

    def fresh(self, n: int) -> list[str]:
        seeds = range(self.next_seed, self.next_seed + n)
        self.next_seed += n
        return [self.url(s) for s in seeds]


def chat_body(urls: list[str], text: str, max_tokens: int) -> dict:
    parts: list[dict] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": "Describe them."})
    return {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip


async def timed(client: httpx.AsyncClient, body: dict) -> tuple[float, int]:
    """(seconds to the answer, completion tokens) of one chat completion."""
    t0 = time.perf_counter()
    resp = await client.post("/v1/chat/completions", json=body)
    took = time.perf_counter() - t0
    if resp.status_code != 200:
        raise RuntimeError(f"chat completion answered {resp.status_code}: {resp.text[:300]}")
    return took, int(resp.json()["usage"]["completion_tokens"])


async def wave(client: httpx.AsyncClient, bodies: list[dict]) -> dict[str, float]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(timed(client, b) for b in bodies))
    seconds = time.perf_counter() - t0
    return {"ttft_s": statistics.median(r[0] for r in results), "tok_s": sum(r[1] for r in results) / seconds}


async def cell(client: httpx.AsyncClient, src: ImageSource, n_images: int, conc: int, cached: bool,
               cfg: Config, nonce: list[int]) -> dict[str, float]:  # fmt: skip
    """Median over runs of TTFT (max_tokens 1) and throughput (max_tokens cfg.max_tokens) waves."""
    ttfts, tputs = [], []
    for _ in range(cfg.runs):
        nonce[0] += 1
        if cached:
            urls, text = src.fresh(n_images), f"request {nonce[0]}:"
            await timed(client, chat_body(urls, text, 1))  # warms the encoder and prefix caches
            first = [chat_body(urls, text, 1)] * conc
            second = [chat_body(urls, text, cfg.max_tokens)] * conc
        else:
            first = [chat_body(src.fresh(n_images), f"request {nonce[0]}.{i}:", 1) for i in range(conc)]
            second = [chat_body(src.fresh(n_images), f"request {nonce[0]}.{i}b:", cfg.max_tokens) for i in range(conc)]
        ttfts.append((await wave(client, first))["ttft_s"])
        tputs.append((await wave(client, second))["tok_s"])
    return {"ttft_s": statistics.median(ttfts), "tok_s": statistics.median(tputs)}


async def measure(url: str, cfg: Config) -> list[dict]:
    src = ImageSource(cfg.image_side)
    rows, nonce = [], [0]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        await timed(client, {"model": "m", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4})
        await timed(client, chat_body(src.fresh(1), "warm up:", 4))
        for n_images in cfg.images:
            for conc in cfg.concurrency:
                cold = await cell(client, src, n_images, conc, False, cfg, nonce)
                hot = await cell(client, src, n_images, conc, True, cfg, nonce)
                row = {"images": n_images, "concurrency": conc, "cold": cold, "cached": hot,
                       "cached_over_cold_ttft": hot["ttft_s"] / cold["ttft_s"]}  # fmt: skip
                logger.info("%s", json.dumps(row))
                rows.append(row)
    return rows


def table(rows: list[dict], cfg: Config) -> str:
    lines = [f"shape {cfg.shape}, {cfg.image_side}x{cfg.image_side} images, median of {cfg.runs} waves",
             "| images | conc | cold TTFT s | cached TTFT s | cold tok/s | cached tok/s | cached/cold TTFT |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['images']} | {r['concurrency']} | {r['cold']['ttft_s']:.3f} | {r['cached']['ttft_s']:.3f}"
                     f" | {r['cold']['tok_s']:.1f} | {r['cached']['tok_s']:.1f} | {r['cached_over_cold_ttft']:.2f} |")
    return "\n".join(lines)


def run(cfg: Config) -> list[dict]:
    model = ensure_model(cfg)
    port = free_port()
    cmd = [sys.executable, str(REPO / "launch.py"), "--model-path", model, "--dtype", "float32", "--host",
           "127.0.0.1", "--port", str(port), "--max-running-requests", "8", "--served-model-name", "m"]  # fmt: skip
    os.makedirs(cfg.log_dir, exist_ok=True)
    proc = ManagedProcess("hyssm", cmd, Path(cfg.log_dir) / "hyssm.log", cwd=str(REPO))
    try:
        proc.wait_ready(f"http://127.0.0.1:{port}/health", 600)
        return asyncio.run(measure(f"http://127.0.0.1:{port}", cfg))
    finally:
        proc.stop()


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--image-side", type=int, default=224)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--images", default="1,4")
    p.add_argument("--out", default=None)
    p.add_argument("--log-dir", default="bench-logs")
    a = p.parse_args(argv)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    model_dir = a.model_dir or os.path.join(cache, "hyssm", "bench-models", f"vision-{a.shape}")
    return Config(a.shape, model_dir, a.image_side, a.runs, a.max_tokens,
                  tuple(int(x) for x in a.concurrency.split(",")), tuple(int(x) for x in a.images.split(",")),
                  a.out, a.log_dir)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = parse_args(argv)
    rows = run(cfg)
    text = table(rows, cfg)
    print(text)
    if cfg.out:
        with open(cfg.out, "w", encoding="utf-8") as f:
            json.dump({"config": cfg.__dict__, "rows": rows, "table": text}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
