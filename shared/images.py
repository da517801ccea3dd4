"""The torch-free rules every process shares about a prompt's images (shared/messages/images.py).

- Cache keys: the scheduler's radix tree and the state store key an image's prompt positions by
  `key_token(digest)`, a negative id no vocabulary holds, instead of the placeholder token the model
  reads: the same image after the same text matches (its KV and the recurrent state after it are
  reused), and a different image stops a match at its first token.
- Rotary positions (the multimodal RoPE of Qwen3.5's text model): a text token at prompt position p
  has position p + `rope_delta(images, p)` on each of the (t, h, w) axes; the tokens of an image that
  starts at prompt position o take base = o + rope_delta(images, o) plus their (t, row, column) on the
  merged grid (`image_rope_positions`), and the text after the image continues at base + `rope_span`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from shared.messages.images import ImageInput

KEY_BITS = 60


def key_token(digest: str) -> int:
    """The cache-key id of every prompt position of an image with this digest (< 0: never a vocabulary id)."""
    return -1 - (int(digest[: KEY_BITS // 4], 16))


def key_tokens(input_ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
    """`input_ids` with each image's positions replaced by its key token."""
    out = list(input_ids)
    for img in images:
        out[img.offset : img.end] = [key_token(img.digest)] * img.length
    return out


def rope_delta(images: Sequence[ImageInput], pos: int) -> int:
    """How far the rotary position of a text token at prompt position `pos` is from `pos`: every image that
    ends at or before `pos` moved the positions after it by rope_span - length."""
    return sum(img.rope_span - img.length for img in images if img.end <= pos)


def make_image_input(pixels: bytes, grid: tuple[int, int, int], offset: int, token_id: int,
                     merge: int) -> ImageInput:  # fmt: skip
    """The ImageInput of processed `pixels` (float32 [t * h * w, patch_dim] bytes) of patch grid `grid`
    whose tokens start at prompt position `offset`; its digest covers the grid and every pixel value."""
    t, h, w = (int(x) for x in grid)
    digest = hashlib.sha256(f"{t}x{h}x{w}:".encode() + pixels).hexdigest()
    gh, gw = h // merge, w // merge
    return ImageInput(digest=digest, offset=offset, length=t * gh * gw, grid=(t, h, w), pixels=pixels,
                      token_id=token_id, rope_span=max(gh, gw))


def merged_grid(img: ImageInput, merge: int) -> tuple[int, int, int]:
    """(t, h, w) of the image's tokens: the patch grid with h and w merged `merge` x `merge`."""
    t, h, w = img.grid
    return t, h // merge, w // merge


def check_image(img: ImageInput, merge: int, patch_dim: int) -> str:
    """What is wrong with an image's fields for a tower of this merge size and patch size (empty: nothing)."""
    t, h, w = img.grid
    if min(t, h, w) <= 0 or h % merge or w % merge:
        return f"image grid {img.grid} is not a positive grid of {merge} x {merge} merged patches"
    gt, gh, gw = merged_grid(img, merge)
    if img.length != gt * gh * gw:
        return f"image of grid {img.grid} has {img.length} tokens, not {gt * gh * gw}"
    if img.rope_span != max(gh, gw):
        return f"image rope_span {img.rope_span} is not its largest merged side {max(gh, gw)}"
    if len(img.pixels) != 4 * t * h * w * patch_dim:
        return f"image pixels hold {len(img.pixels)} bytes, not float32 [{t * h * w}, {patch_dim}]"
    return ""


def rope_positions(start: int, n: int, images: Sequence[ImageInput], delta: int,
                   merge: int) -> tuple[list[int], list[int], list[int]]:  # fmt: skip
    """The (t, h, w) rotary positions of prompt positions [start, start + n), given the images whose tokens
    overlap them (by offset) and `delta` = rope_delta(every image, start)."""
    axes: tuple[list[int], list[int], list[int]] = ([], [], [])
    end, p = start + n, start

    def text(a: int, b: int) -> None:
        for ax in axes:
            ax.extend(range(a + delta, b + delta))

    for img in sorted(images, key=lambda i: i.offset):
        if img.end <= start or img.offset >= end:
            continue
        text(p, max(p, img.offset))
        base = img.offset + delta
        _, gh, gw = merged_grid(img, merge)
        for j in range(max(img.offset, start) - img.offset, min(img.end, end) - img.offset):
            axes[0].append(base + j // (gh * gw))
            axes[1].append(base + (j // gw) % gh)
            axes[2].append(base + j % gw)
        if img.end <= end:
            delta += img.rope_span - img.length
        p = min(img.end, end)
    text(p, end)
    return axes
