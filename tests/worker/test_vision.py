"""Images through the worker (Qwen3.5 dense and MoE with a vision tower; tests/fixtures/vision_model.py)
against the transformers float32 model: every prompt position's logits within 1e-4 (one image, images of
different sizes between text), greedy decode after the prompt (rotary positions from rope_delta), a prefill
chunked inside an image, the encoder cache (an image seen again is not encoded again, same logits), TP=2
with the tower replicated; the multimodal RoPE table against transformers'; the batch's image checks."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from shared.images import make_image_input, rope_delta
from shared.messages import ImageInput, ReqSlice
from shared.model_config import VisionConfig
from tests.fixtures.vision_model import IMAGE_PAD, MERGE, VISION_END, VISION_START, image, make_vision_model, reference
from tests.model_driver import forward_all_logits, forward_logits
from tests.worker.util import GREEDY, batch, max_diff, runner, runner_at

TOL = 1e-4
KV = 200
SIZES = {"one": [(64, 96)], "three": [(64, 96), (100, 50), (32, 32)]}
TEXT = [[10, 11, 12, 13], [40, 41, 42], [70, 71, 72, 73, 74], [90, 91, 92, 93, 94, 95]]


@dataclasses.dataclass
class Case:
    path: str
    ref: Any
    ids: list[int]
    images: list[ImageInput]
    pixel_values: torch.Tensor
    grid: torch.Tensor

    def hf_logits(self, ids: list[int] | None = None) -> torch.Tensor:
        """The transformers model's logits at every position of `ids` (default: the prompt)."""
        t = torch.tensor([ids or self.ids])
        with torch.no_grad():
            out = self.ref(input_ids=t, pixel_values=self.pixel_values, image_grid_thw=self.grid,
                           mm_token_type_ids=(t == IMAGE_PAD).int())
        return out.logits[0].float()


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = make_vision_model(str(tmp_path_factory.mktemp(f"vision_{request.param}")), moe=request.param == "moe")
    return path, reference(path)


def make_case(path: str, ref: Any, sizes: list[tuple[int, int]], seed: int = 0) -> Case:
    """A prompt of text runs with each image between two of them, as the chat template places it."""
    from transformers import AutoImageProcessor

    out = AutoImageProcessor.from_pretrained(path)(images=[image(w, h, seed + i) for i, (w, h) in enumerate(sizes)],
                                                   return_tensors="pt")
    pv, grid = out["pixel_values"], out["image_grid_thw"]
    ids: list[int] = []
    images: list[ImageInput] = []
    at = 0
    for i, g in enumerate(grid.tolist()):
        ids += TEXT[i] + [VISION_START]
        n = math.prod(g)
        img = make_image_input(pv[at : at + n].numpy().astype(np.float32).tobytes(), tuple(g), len(ids), IMAGE_PAD,
                               merge=MERGE)
        at += n
        images.append(img)
        ids += [IMAGE_PAD] * img.length + [VISION_END]
    ids += TEXT[len(sizes)]
    return Case(path, ref, ids, images, pv, grid)


def image_slice(rid: str, case: Case, start: int, end: int, kv: list[int], state: int, **kw: Any) -> ReqSlice:
    """The slice of `case`'s prompt positions [start, end), with the images it overlaps."""
    imgs = [img for img in case.images if img.offset < end and img.end > start]
    return ReqSlice(rid=rid, input_ids=case.ids[start:end], start_pos=start, kv_slots=kv[:end], state_slot=state,
                    sample=True, sampling=GREEDY, images=imgs, rope_delta=rope_delta(case.images, start), **kw)


def prompt_logits(r: Any, case: Case, chunks: list[int] | None = None, rid: str = "a", state: int = 1,
                  step0: int = 0) -> torch.Tensor:
    """Every prompt row's logits through the runner, prefilled in `chunks` (default: one step)."""
    n = len(case.ids)
    kv = [3 + 2 * i for i in range(n)] if state == 1 else [4 + 2 * i for i in range(n)]
    rows, start = [], 0
    for step, c in enumerate(chunks or [n]):
        sl = image_slice(rid, case, start, start + c, kv, state)
        rows.append(forward_all_logits(r, batch(step0 + step, [sl], clears=[state] if start == 0 else []))[rid])
        start += c
    return torch.cat(rows)


@pytest.mark.parametrize("sizes", ["one", "three"])
def test_prompt_logits_match_transformers(model: tuple[str, Any], sizes: str) -> None:
    case = make_case(*model, SIZES[sizes])
    r = runner_at(case.path, kv_slots=KV, dtype="float32")
    assert max_diff(prompt_logits(r, case), case.hf_logits()) <= TOL
    assert r.model.encoder_cache.encoded == len(case.images)
    r.check_integrity()


def test_chunk_boundaries_inside_images(model: tuple[str, Any]) -> None:
    """A prefill chunked so that boundaries fall inside images (and a one-token chunk on an image token,
    which takes the decode path) gives the unchunked logits; each image is encoded once."""
    case = make_case(*model, SIZES["three"])
    first, second = case.images[0], case.images[1]
    cuts = [first.offset + 2, first.offset + 3, second.offset + 1, second.end - 1]
    chunks = [b - a for a, b in zip([0, *cuts], [*cuts, len(case.ids)], strict=True)]
    r = runner_at(case.path, kv_slots=KV, dtype="float32")
    whole = prompt_logits(r, case)
    chunked = prompt_logits(r, case, chunks, rid="b", state=2, step0=1)
    assert max_diff(chunked, whole) <= TOL and max_diff(chunked, case.hf_logits()) <= TOL
    r.check_integrity()


def test_greedy_decode_after_images(model: tuple[str, Any]) -> None:
    """Eight greedy tokens after the prompt, each decode row at its rotary position (rope_delta), equal
    the transformers model's on the whole sequence."""
    case = make_case(*model, SIZES["three"])
    r = runner_at(case.path, kv_slots=KV, dtype="float32")
    n = len(case.ids)
    kv = list(range(1, n + 9))
    tok = int(forward_logits(r, batch(0, [image_slice("a", case, 0, n, kv, 1)], clears=[1]))["a"].argmax())
    seq = case.ids + [tok]
    for step in range(1, 8):
        pos = len(seq) - 1
        sl = ReqSlice(rid="a", input_ids=[seq[-1]], start_pos=pos, kv_slots=kv[: pos + 1], state_slot=1, sample=True,
                      sampling=GREEDY, output_len=step, rope_delta=rope_delta(case.images, pos))
        logits = forward_logits(r, batch(step, [sl]))["a"]
        hf = case.hf_logits(seq)[-1]
        assert max_diff(logits, hf) <= TOL, step
        seq.append(int(logits.argmax()))
    hf_greedy = case.ids[:]
    for _ in range(8):
        hf_greedy.append(int(case.hf_logits(hf_greedy)[-1].argmax()))
    assert seq == hf_greedy


def test_encoder_cache_encodes_an_image_once(model: tuple[str, Any]) -> None:
    """A second request with the same images finds them in the cache (no tower call) and gets the very
    same logits; a budget smaller than one encoding keeps nothing and encodes every time."""
    case = make_case(*model, SIZES["three"])
    r = runner_at(case.path, kv_slots=KV, dtype="float32")
    cache = r.model.encoder_cache
    first = prompt_logits(r, case)
    assert (cache.encoded, cache.hits, len(cache)) == (3, 0, 3)
    second = prompt_logits(r, case, rid="b", state=2, step0=1)
    assert (cache.encoded, cache.hits) == (3, 3)
    assert torch.equal(first, second)
    r.check_integrity()
    tiny = runner_at(case.path, kv_slots=KV, dtype="float32", encoder_cache_bytes=64)
    prompt_logits(tiny, case)
    prompt_logits(tiny, case, rid="b", state=2, step0=1)
    assert (tiny.model.encoder_cache.encoded, tiny.model.encoder_cache.hits, len(tiny.model.encoder_cache)) == (6, 0, 0)


def test_mrope_table_matches_transformers() -> None:
    """The multimodal rotary table of [3, T] positions equals Qwen3_5TextRotaryEmbedding's, and a row with
    one position on every axis gets exactly the one-axis table."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from shared.model_config import AttentionConfig
    from worker_proc.model.attention import rope_cos_sin

    section = [3, 3, 2]
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": section,
              "mrope_interleaved": True}
    cfg = Qwen3_5TextConfig(head_dim=64, hidden_size=128, num_attention_heads=2, rope_parameters=params)
    theirs = Qwen3_5TextRotaryEmbedding(cfg)
    attn = AttentionConfig(num_heads=2, num_kv_heads=2, head_dim=64, rope_theta=10000.0, rotary_dim=16,
                           mrope_section=tuple(section))
    axes = torch.tensor(attn.rope_axes())
    pos = torch.randint(0, 3000, (3, 50), generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(pos, 16, 10000.0, torch.float32, axes)
    ref_cos, ref_sin = theirs(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
    assert max_diff(cos[:, 0], ref_cos[0]) <= 2e-6 and max_diff(sin[:, 0], ref_sin[0]) <= 2e-6
    text = torch.arange(100, 160)
    one = rope_cos_sin(text, 16, 10000.0, torch.float32)
    three = rope_cos_sin(text.expand(3, -1), 16, 10000.0, torch.float32, axes)
    assert torch.equal(one[0], three[0]) and torch.equal(one[1], three[1])


def test_image_checks(model: tuple[str, Any]) -> None:
    """Malformed images are ValueErrors naming the problem; images for a model without a tower too."""
    case = make_case(*model, SIZES["one"])
    r = runner_at(case.path, kv_slots=KV, dtype="float32")
    n, img = len(case.ids), case.images[0]
    kv = list(range(1, n + 1))

    def run(images: list[ImageInput], ids: list[int] | None = None) -> None:
        sl = image_slice("a", case, 0, n, kv, 1)
        sl.images, sl.input_ids = images, ids or sl.input_ids
        forward_logits(r, batch(0, [sl], clears=[1]))

    with pytest.raises(ValueError, match="pixels hold"):
        run([msgspec.structs.replace(img, pixels=img.pixels[:-4])])
    with pytest.raises(ValueError, match="tokens, not"):
        run([msgspec.structs.replace(img, length=img.length - 1)])
    with pytest.raises(ValueError, match="placeholder"):
        run([img], [1 if p == img.offset else t for p, t in enumerate(case.ids)])
    with pytest.raises(ValueError, match="outside the slice"):
        run([msgspec.structs.replace(img, offset=n + 5)])
    text_only = runner("qwen3_5_dense", kv_slots=KV)
    sl = ReqSlice(rid="a", input_ids=[5] * 20, start_pos=0, kv_slots=list(range(1, 21)), state_slot=1, sample=True,
                  sampling=GREEDY, images=[msgspec.structs.replace(img, offset=2, token_id=5)])
    with pytest.raises(ValueError, match="no vision tower"):
        forward_logits(text_only, batch(0, [sl], clears=[1]))


def test_vision_config_refuses_bad_fields() -> None:
    VisionConfig()  # depth 0: no tower, nothing checked
    good = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=8, out_hidden_size=64,
                num_position_embeddings=16, image_token_id=3)
    VisionConfig(**good)
    bad = ((dict(num_heads=3), "num_heads"), (dict(num_position_embeddings=15), "num_position_embeddings"),
           (dict(hidden_act="relu"), "hidden_act"), (dict(patch_size=0), "patch_size"))
    for change, field in bad:
        with pytest.raises(ValueError, match=field):
            VisionConfig(**{**good, **change})


def test_parse_fills_the_tower_and_the_rotary_sections(model: tuple[str, Any]) -> None:
    """The wrapper's vision_config becomes HybridConfig.vision and its tensors `visual.*` are loaded; the text
    model's rope_parameters.mrope_section its rotary axes; a layout the worker does not compute is refused."""
    import json
    import os

    from shared.errors import ModelLoadError
    from shared.families.registry import parse_config

    with open(os.path.join(model[0], "config.json")) as f:
        raw = json.load(f)
    cfg = parse_config(raw)
    assert cfg.vision.depth == 2 and cfg.vision.image_token_id == IMAGE_PAD and cfg.vision.patch_dim == 3 * 2 * 16 * 16
    assert cfg.attn.mrope_section == tuple(raw["text_config"]["rope_parameters"]["mrope_section"])
    assert "visual." not in cfg.ignored_prefixes and ("^model\\.visual\\.", "visual.") in cfg.renames
    rope = raw["text_config"]["rope_parameters"]
    bad_rope = (({"mrope_interleaved": False}, "mrope_interleaved"), ({"mrope_section": None}, "mrope_section"),
                ({"mrope_section": [1, 1]}, "mrope_section"))
    for change, problem in bad_rope:
        bad = {**raw, "text_config": {**raw["text_config"], "rope_parameters": {**rope, **change}}}
        with pytest.raises(ModelLoadError, match=problem):
            parse_config(bad)
    with pytest.raises(ModelLoadError, match="out_hidden_size"):
        parse_config({**raw, "vision_config": {**raw["vision_config"], "out_hidden_size": 32}})


def test_text_rows_are_bit_identical_under_mrope(model: tuple[str, Any]) -> None:
    """A text-only prompt of the seeing model gives exactly the logits of the one-axis rotary tables."""
    path = model[0]
    ids = TEXT[0] + TEXT[1] + TEXT[2] + TEXT[3]
    sl = ReqSlice(rid="a", input_ids=ids, start_pos=0, kv_slots=list(range(1, len(ids) + 1)), state_slot=1,
                  sample=True, sampling=GREEDY)
    r = runner_at(path, kv_slots=KV, dtype="float32")
    three = forward_all_logits(r, batch(0, [sl], clears=[1]))["a"]
    assert r.model.rope_axes is not None
    r.model.rope_axes = None  # the tables of one position axis, as a model without mrope_section makes them
    one = forward_all_logits(r, batch(1, [sl], clears=[1]))["a"]
    assert torch.equal(three, one)
