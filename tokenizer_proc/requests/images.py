"""A request's images, from references to what its prompt carries: fetched (image_fetch.py), decoded,
and processed by the checkpoint's own image processor (or ApiError 400 naming the reference's field).

Rules:
- a model without a vision tower (`ModelInfo.vision` None) has no `ImageLoader`: any image is a 400;
- a prompt carries at most `--limit-mm-per-prompt` images, checked before anything is fetched;
- decoding: Pillow, only PNG, JPEG, WEBP, GIF (its first frame) and BMP; the width x height Pillow reads
  from the header is checked against `--max-image-pixels` before the pixels are decoded; the image is
  converted to RGB;
- processing: transformers' `AutoImageProcessor` of the checkpoint (`preprocessor_config.json`), loaded
  once at start with `--mm-processor-kwargs` as overrides; its `pixel_values` (float32) and
  `image_grid_thw` are the image (`ProcessedImage`), the digest made when its offset is known
  (shared/images.py `make_image_input`);
- decoding and processing run on the loader's threads, never on the event loop, so the server keeps
  serving while large images are processed; a request's images are fetched concurrently;
- an image whose encoded bytes were processed before is taken from the processor cache (by the bytes' sha256,
  least recently used dropped beyond `--mm-processor-cache-gb`; 0 = none), so a conversation that sends its
  image again on every turn decodes and processes it once.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.config import ServerArgs
from shared.errors import ModelLoadError
from shared.model_info import VisionInfo
from tokenizer_proc.http.errors import ApiError, bad_request
from tokenizer_proc.requests.image_fetch import Fetcher, FetchLimits, ImageRef

logger = logging.getLogger(__name__)

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
PROCESSING_THREADS = 2  # images decoded and processed at once (each a core while it runs)


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the image processor made it: `pixels` float32 [t * h * w, patch_dim] bytes, `grid` (t, h, w)
    in patches."""

    pixels: bytes
    grid: tuple[int, int, int]


class ProcessedCache:
    """Processed images by the sha256 of their encoded bytes, LRU, at most `max_bytes` of pixels; thread-safe (the
    loader's threads share it)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._items: OrderedDict[bytes, ProcessedImage] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, key: bytes) -> ProcessedImage | None:
        with self._lock:
            img = self._items.get(key)
            if img is not None:
                self._items.move_to_end(key)
                self.hits += 1
            return img

    def put(self, key: bytes, img: ProcessedImage) -> None:
        size = len(img.pixels)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = img
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= len(old.pixels)

    def check_integrity(self) -> None:
        with self._lock:
            assert self.bytes == sum(len(i.pixels) for i in self._items.values()) <= self.max_bytes, self.bytes


@dataclass(frozen=True)
class PromptImages:
    """The processed images of one prompt, in the order their placeholders appear (image_parts.py places them)."""

    images: tuple[ProcessedImage, ...]


def open_image(data: bytes, max_pixels: int, param: str) -> Any:
    """The decoded RGB PIL image of encoded `data` (module doc), or ApiError 400 naming `param`."""
    from PIL import Image, UnidentifiedImageError

    buf = io.BytesIO(data)
    try:
        img = Image.open(buf, formats=FORMATS)
    except UnidentifiedImageError:
        raise bad_request(f"image format {_format_of(data)} is not supported ({', '.join(FORMATS)})"
                          if _format_of(data) else "image cannot be decoded (not a PNG, JPEG, WEBP, GIF or BMP "
                          "image)", param) from None  # fmt: skip
    except Image.DecompressionBombError:  # Pillow's own bound, far above any sane --max-image-pixels
        raise bad_request(f"image has more pixels than the limit of {max_pixels} (--max-image-pixels)", param) from None
    except (OSError, ValueError, SyntaxError) as e:
        raise bad_request(f"image cannot be decoded: {e}", param) from None
    with img:
        w, h = img.size
        if w * h > max_pixels:
            raise bad_request(f"image of {w} x {h} pixels is larger than the limit of {max_pixels} pixels "
                              "(--max-image-pixels)", param)  # fmt: skip
        try:
            img.seek(0)
            return img.convert("RGB")
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise bad_request(f"image cannot be decoded ({img.format}): {e}", param) from None


def _format_of(data: bytes) -> str:
    """The name of a format Pillow reads but this server does not take ("" when Pillow reads none)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            return str(img.format or "")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return ""


class ImageLoader:
    """Owns the checkpoint's image processor, the fetcher and the threads that decode and process images.
    Built once per tokenizer process for a checkpoint that sees (`from_args`)."""

    def __init__(self, processor: Any, vision: VisionInfo, limits: FetchLimits, max_pixels: int, max_images: int,
                 cache_bytes: int = 0) -> None:  # fmt: skip
        self.processor, self.vision, self.max_pixels, self.max_images = processor, vision, max_pixels, max_images
        self.fetcher = Fetcher(limits)
        self.cache = ProcessedCache(cache_bytes)
        self._pool = ThreadPoolExecutor(PROCESSING_THREADS, thread_name_prefix="image")

    @staticmethod
    def from_args(args: ServerArgs, model_dir: str, vision: VisionInfo | None) -> ImageLoader | None:
        """The loader of a checkpoint that sees (None for a text-only one); ModelLoadError when its image
        processor cannot be loaded."""
        if vision is None:
            return None
        from transformers import AutoImageProcessor

        kwargs = args.image_processor_kwargs()
        try:
            processor = AutoImageProcessor.from_pretrained(model_dir, **kwargs)
        except (OSError, ValueError, TypeError) as e:
            raise ModelLoadError(f"{model_dir}: the image processor cannot be loaded (preprocessor_config.json, "
                                 f"--mm-processor-kwargs {kwargs}): {e}") from None  # fmt: skip
        logger.info("images: %s, at most %d per prompt", type(processor).__name__, args.image_limit())
        limits = FetchLimits(args.media_fetch_timeout, args.max_image_bytes, args.media_domains())
        return ImageLoader(processor, vision, limits, args.max_image_pixels, args.image_limit(),
                           int(args.mm_processor_cache_gb * (1 << 30)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def process(self, data: bytes, param: str) -> ProcessedImage:
        """Decode and process one image's encoded bytes, or take them from the cache (blocking: the loader's
        threads call it)."""
        key = hashlib.sha256(data).digest()
        done = self.cache.get(key)
        if done is not None:
            return done
        done = self._process(data, param)
        self.cache.put(key, done)
        return done

    def _process(self, data: bytes, param: str) -> ProcessedImage:
        img = open_image(data, self.max_pixels, param)
        try:
            out = self.processor(images=[img], return_tensors="np")
        except (ValueError, TypeError, OSError) as e:
            raise bad_request(f"image cannot be processed: {e}", param) from None
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grid = tuple(int(x) for x in np.asarray(out["image_grid_thw"]).reshape(-1)[:3])
        return ProcessedImage(pixels=pixels.tobytes(), grid=grid)  # type: ignore[arg-type]

    async def _one(self, ref: ImageRef) -> ProcessedImage:
        data = await self.fetcher.fetch(ref)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.process, data, ref.param)

    async def load(self, refs: Sequence[ImageRef]) -> PromptImages:
        """Every image of one prompt, in order (ApiError 400 naming the first reference that failed)."""
        check_count(len(refs), self.max_images, refs[-1].param if refs else "")
        tasks = [asyncio.ensure_future(self._one(ref)) for ref in refs]
        try:
            images = await asyncio.gather(*tasks)
        finally:  # the first failure ends the request: the others stop, their failures are not reported
            for t in tasks:
                if t.done() and not t.cancelled():
                    t.exception()
                t.cancel()
        return PromptImages(tuple(images))


def check_count(n: int, limit: int, param: str) -> None:
    if n > limit:
        raise bad_request(f"the prompt has {n} images, more than the limit of {limit} (--limit-mm-per-prompt)",
                          param)


async def load_images(loader: ImageLoader | None, refs: Sequence[ImageRef]) -> PromptImages | None:
    """The images of one prompt (None when it has none); a 400 when the served model takes no images."""
    if not refs:
        return None
    if loader is None:
        raise ApiError(400, f"{refs[0].param} is not supported by this server: the model takes no images (a "
                       "text-only checkpoint, no vision tower)", refs[0].param)  # fmt: skip
    return await loader.load(refs)
