"""A prompt's images in the scheduler: the radix tree keys an image's positions by its digest (the same
image after the same text hits past it, a different image never matches past where it starts), every
slice carries the images whose tokens it computes, the placeholder token in place of the key and the
rotary offset of its first position; malformed images are rejected."""

from __future__ import annotations

import hashlib

from shared.images import rope_delta
from shared.messages import GenerateReq, ImageInput
from tests.scheduler import harness
from tests.scheduler.util import greq, make

PAD = 40
SYSTEM = list(range(1, 31))


def image(seed: int, offset: int, side: int = 4) -> ImageInput:
    """A (1, 2*side, 2*side)-patch image: side * side tokens spanning `side` rotary positions."""
    digest = hashlib.sha256(str(seed).encode()).hexdigest()
    return ImageInput(digest=digest, offset=offset, length=side * side, grid=(1, 2 * side, 2 * side), pixels=b"",
                      token_id=PAD, rope_span=side)  # fmt: skip


def with_images(rid: str, images: list[ImageInput], tail: list[int]) -> GenerateReq:
    """SYSTEM, then each image (its placeholder tokens between two text tokens), then `tail`."""
    ids = list(SYSTEM)
    placed = []
    for img in images:
        ids.append(45)
        placed.append(ImageInput(**{f: getattr(img, f) for f in img.__struct_fields__} | {"offset": len(ids)}))
        ids.extend([PAD] * img.length)
        ids.append(46)
    req = greq(rid, ids + tail, 4)
    req.images = placed
    return req


def test_the_same_image_hits_past_it_and_another_image_never_does() -> None:
    sched, worker = make(kv=1024, states=16, chunked_prefill_size=64, disable_prompt_checkpoint=True)
    same = [with_images(f"same{i}", [image(1, 0)], [10 + i, 11, 12]) for i in range(3)]
    other = with_images("other", [image(2, 0)], [13, 11, 12])
    cached = {}
    for r in [*same, other]:
        log = harness.run(sched, worker, {0: [r]})
        cached[r.rid] = log.finals[r.rid].cached_tokens
    first = same[0].images[0]
    # the second request checkpointed the branch point after the image; the third resumes there
    assert cached["same0"] == cached["same1"] == 0
    assert cached["same2"] >= first.end + 1, cached
    assert cached["other"] <= first.offset, cached  # same text, same placeholder ids, another image


def test_slices_carry_the_placeholder_their_images_and_the_rotary_offset() -> None:
    sched, worker = make(kv=1024, states=16, chunked_prefill_size=24)
    req = with_images("r", [image(1, 0, side=3), image(2, 0, side=4)], [10, 11])
    images = req.images
    log = harness.run(sched, worker, {0: [req]}, keep_batches=True)
    assert log.finals["r"].finish_reason == "length"
    slices = [s for b in log.batches for s in b.reqs]
    for s in slices:
        end = s.start_pos + len(s.input_ids)
        assert all(t >= 0 for t in s.input_ids)
        prompt_part = req.input_ids[s.start_pos : min(end, len(req.input_ids))]
        assert s.input_ids[: len(prompt_part)] == prompt_part
        assert s.images == [img for img in images if img.offset < end and img.end > s.start_pos]
        assert s.rope_delta == rope_delta(images, s.start_pos)
    # the 24-token chunks cut the second image apart: both chunks over it carry it
    second = images[1]
    over = [s for s in slices if s.images and s.images[-1] == second]
    assert len(over) >= 2
    decode = slices[-1]
    assert decode.images == [] and decode.rope_delta == sum(i.rope_span - i.length for i in images)


def test_malformed_images_are_rejected() -> None:
    sched, _ = make()
    good = with_images("good", [image(1, 0)], [10])
    bad_offset = with_images("offset", [image(1, 0)], [10])
    bad_offset.images = [ImageInput(**{f: getattr(good.images[0], f) for f in good.images[0].__struct_fields__}
                                    | {"offset": len(good.input_ids) - 3})]  # fmt: skip
    bad_token = with_images("token", [image(1, 0)], [10])
    bad_token.input_ids[good.images[0].offset] = 7
    for req, needle in ((bad_offset, "leaves the prompt"), (bad_token, "image token")):
        (out,) = sched.add_request(req)
        assert out.finished and out.rejected and needle in (out.error or ""), out
    assert sched.add_request(good) == []
