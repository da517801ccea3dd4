"""TP=2 with images (the dense seeing Qwen3.5 of tests/fixtures/vision_model.py) on CPU with gloo: the
vision tower is replicated (every rank holds all of it and encodes every image itself), the text model
sharded; every rank's prompt logits (whole and chunked inside images) match the transformers model within
1e-4 and each other exactly, and greedy decode after the images gives the same tokens on every rank."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shared.images import rope_delta
from shared.messages import ReqSlice
from tests.fixtures.vision_model import make_vision_model, reference
from tests.model_driver import forward_logits
from tests.tp.harness import run_ranks
from tests.worker.test_vision import SIZES, make_case, prompt_logits
from tests.worker.util import GREEDY, batch
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

pytestmark = pytest.mark.timeout(180)

TOL = 1e-4
KV = 200
N_NEW = 4


def vision_traces(rank: int, size: int, group: Any, path: str) -> dict[str, Any]:
    """One rank's prompt logits (whole, then chunked inside images), greedy tokens and tower size."""
    case = make_case(path, None, SIZES["three"])
    r = ModelRunner(path, WorkerConfig(dtype="float32", kv_slots=KV, state_slots=8, tp_rank=rank, tp_size=size,
                                       deterministic=True), tp_group=group)
    whole = prompt_logits(r, case)
    first = case.images[0]
    cuts = [first.offset + 3, case.images[1].offset + 1]
    chunks = [cuts[0], cuts[1] - cuts[0], len(case.ids) - cuts[1]]
    chunked = prompt_logits(r, case, chunks, rid="b", state=2, step0=1)
    n = len(case.ids)
    kv = [3 + 2 * i for i in range(n + N_NEW)]
    seq = case.ids + [int(whole[-1].argmax())]
    for step in range(N_NEW):
        pos = len(seq) - 1
        sl = ReqSlice(rid="a", input_ids=[seq[-1]], start_pos=pos, kv_slots=kv[: pos + 1], state_slot=1, sample=True,
                      sampling=GREEDY, output_len=step + 1, rope_delta=rope_delta(case.images, pos))
        seq.append(int(forward_logits(r, batch(4 + step, [sl]))["a"].argmax()))
    r.check_integrity()
    cache = r.model.encoder_cache
    return {"whole": whole.numpy(), "chunked": chunked.numpy(), "tokens": seq[n:], "encoded": cache.encoded,
            "hits": cache.hits, "tower": sum(p.numel() for p in r.model.visual.parameters()),
            "text": sum(p.numel() for p in r.model.model.parameters())}


def test_tp2_vision_matches_transformers_with_a_replicated_tower(tmp_path) -> None:
    path = make_vision_model(str(tmp_path / "vision_dense"))
    one = vision_traces(0, 1, None, path)
    ranks = run_ranks(vision_traces, 2, (path,), timeout=150)
    case = make_case(path, reference(path), SIZES["three"])
    hf = case.hf_logits().numpy()
    for res in ranks:
        assert float(np.abs(res["whole"] - hf).max()) <= TOL
        assert float(np.abs(res["chunked"] - hf).max()) <= TOL
        assert res["tokens"] == one["tokens"]
        assert res["tower"] == one["tower"]  # replicated: every rank holds the whole tower
        assert res["text"] < one["text"]  # the text model is sharded
        # the whole prefill encodes the three images; the chunked one finds them: chunk 1 image 0, chunk 2
        # images 0 and 1, chunk 3 images 1 and 2
        assert (res["encoded"], res["hits"]) == (3, 5)
    assert np.array_equal(ranks[0]["whole"], ranks[1]["whole"])
    assert np.array_equal(ranks[0]["chunked"], ranks[1]["chunked"])
