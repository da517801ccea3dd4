"""What a prompt's images are, carried on two channels: tokenizer -> scheduler (GenerateReq.images,
every image of the prompt) and scheduler -> workers (ReqSlice.images, the images whose tokens the slice
computes). The tokenizer process decodes each image and runs the checkpoint's own image processor; the
worker runs the vision tower over `pixels` (or takes the encoding its encoder cache holds for `digest`)
and puts the result in place of the image's token embeddings. The scheduler never reads pixels: it keys
its caches by `digest` (shared/images.py)."""

from __future__ import annotations

import msgspec


class ImageInput(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One image of a prompt. Its `length` tokens are prompt positions [offset, offset + length), each
    the placeholder `token_id`, one per merged patch (row-major over the merged (h, w) grid).
    `digest`: sha256 (hex) of the processed pixels and the grid, the image's identity in every cache
    (two images with the same digest are the same input to the model). `grid`: (t, h, w) in patches,
    before merging. `pixels`: the image processor's `pixel_values`, float32, [t * h * w, patch_dim]
    row-major. `rope_span`: the rotary positions the image occupies (its largest merged side); the text
    after it continues from there (shared/images.py)."""

    digest: str
    offset: int
    length: int
    grid: tuple[int, int, int]
    pixels: bytes
    token_id: int
    rope_span: int

    @property
    def end(self) -> int:
        return self.offset + self.length
