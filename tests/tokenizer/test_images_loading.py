"""Image loading (tokenizer_proc/requests/images.py, image_fetch.py): references of every kind to the
checkpoint's processed pixels, and each bad image a 400 naming the problem and the field. URLs are served
by a real HTTP server on a thread of this process."""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from shared.config import ConfigError, ServerArgs
from shared.model_info import ModelInfo
from tests.fixtures.vision_model import image, png_bytes
from tests.tokenizer.media_server import PNG, data_url, encoded, media_server
from tokenizer_proc.http.errors import ApiError
from tokenizer_proc.requests.image_fetch import ImageRef
from tokenizer_proc.requests.images import ImageLoader, PromptImages, load_images

TIMEOUT_S = 0.5
MAX_BYTES = 64 * 1024
MAX_PIXELS = 400 * 400


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with media_server(MAX_BYTES) as base:
        yield base


@pytest.fixture(scope="module")
def loader(vision_dir: str) -> Iterator[ImageLoader]:
    args = ServerArgs(model_path=vision_dir, media_fetch_timeout=TIMEOUT_S, max_image_bytes=MAX_BYTES,
                      max_image_pixels=MAX_PIXELS, limit_mm_per_prompt='{"image": 3}')
    made = ImageLoader.from_args(args, vision_dir, ModelInfo.from_dir(vision_dir).vision)
    assert made is not None
    yield made
    made.close()


def load(loader: ImageLoader, *refs: ImageRef) -> PromptImages:
    return asyncio.run(loader.load(refs))


def refused(loader: ImageLoader, ref: ImageRef) -> ApiError:
    with pytest.raises(ApiError) as e:
        load(loader, ref)
    assert e.value.status == 400 and e.value.param == ref.param
    return e.value


def test_data_url_raw_base64_and_url_give_the_processors_pixels(loader: ImageLoader, url: str) -> None:
    got = load(loader, ImageRef(data_url(PNG), "a"), ImageRef(base64.b64encode(PNG).decode(), "b", raw_ok=True),
               ImageRef(f"{url}/a.png", "c")).images
    direct = loader.processor(images=[image(64, 48, seed=1)], return_tensors="np")
    want = np.asarray(direct["pixel_values"], dtype=np.float32)
    assert got[0].grid == tuple(int(x) for x in direct["image_grid_thw"][0])
    assert got[0].pixels == want.tobytes()
    assert got[1] == got[0] and got[2] == got[0]


def test_jpeg_gif_and_rgba_images_load(loader: ImageLoader, url: str) -> None:
    frames = [image(40, 40, seed=s).convert("P") for s in (2, 3)]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    rgba = encoded(image(40, 40, seed=4).convert("RGBA"), "PNG")
    webp = encoded(image(40, 40, seed=5), "WEBP")
    bmp = encoded(image(40, 40, seed=6), "BMP")
    got = load(loader, ImageRef(f"{url}/a.jpg", "j"), ImageRef(data_url(gif, "image/gif"), "g"),
               ImageRef(data_url(rgba), "r")).images
    assert len(got) == 3 and all(g.grid[0] == 1 for g in got)
    first = load(loader, ImageRef(data_url(encoded(frames[0], "GIF"), "image/gif"), "g")).images[0]
    assert got[1] == first  # a GIF is its first frame
    assert len(load(loader, ImageRef(data_url(webp, "image/webp"), "w"), ImageRef(data_url(bmp), "b")).images) == 2


def test_a_url_that_never_answers_times_out(loader: ImageLoader, url: str) -> None:
    start = time.monotonic()
    err = refused(loader, ImageRef(f"{url}/never", "messages[0].content[0].image_url"))
    assert "--media-fetch-timeout" in err.message and time.monotonic() - start < TIMEOUT_S + 5


def test_non_2xx_and_unreachable_urls(loader: ImageLoader, url: str) -> None:
    assert "HTTP 404" in refused(loader, ImageRef(f"{url}/missing.png", "p")).message
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/a.png"
    assert "cannot be fetched" in refused(loader, ImageRef(closed, "p")).message


@pytest.mark.parametrize("path", ["/big-declared", "/big-chunked"])
def test_a_body_over_the_byte_limit_is_refused(loader: ImageLoader, url: str, path: str) -> None:
    assert "--max-image-bytes" in refused(loader, ImageRef(url + path, "p")).message


def test_base64_over_the_byte_limit_is_refused_before_decoding(loader: ImageLoader) -> None:
    big = base64.b64encode(b"\0" * (MAX_BYTES + 10)).decode()
    assert "--max-image-bytes" in refused(loader, ImageRef(f"data:image/png;base64,{big}", "p")).message
    assert "--max-image-bytes" in refused(loader, ImageRef(big, "p", raw_ok=True)).message


@pytest.mark.parametrize(("source", "raw_ok", "says"), [
    ("file:///etc/passwd", False, "scheme 'file' is not supported"),
    ("ftp://example.com/a.png", True, "scheme 'ftp' is not supported"),
    (base64.b64encode(PNG).decode(), False, "reference is not supported"),
    ("data:text/plain;base64,aGk=", False, "not an image"),
    ("data:image/png,rawbytes", False, "must be base64"),
    ("data:image/png;base64,@@@", False, "not valid base64"),
    ("!!not base64!!", True, "not valid base64"),
])  # fmt: skip
def test_references_that_are_not_images(loader: ImageLoader, source: str, raw_ok: bool, says: str) -> None:
    assert says in refused(loader, ImageRef(source, "image_data", raw_ok=raw_ok)).message


def test_undecodable_and_unsupported_formats(loader: ImageLoader) -> None:
    garbage = data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
    assert "cannot be decoded" in refused(loader, ImageRef(garbage, "p")).message
    tiff = encoded(image(16, 16), "TIFF")
    assert "format TIFF is not supported" in refused(loader, ImageRef(data_url(tiff, "image/tiff"), "p")).message
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'
    assert "cannot be decoded" in refused(loader, ImageRef(data_url(svg, "image/svg+xml"), "p")).message
    truncated = PNG[: len(PNG) // 2]
    assert "cannot be decoded" in refused(loader, ImageRef(data_url(truncated), "p")).message


def test_an_image_over_the_pixel_limit_is_refused(loader: ImageLoader) -> None:
    from PIL import Image

    wide = encoded(Image.new("RGB", (MAX_PIXELS // 100 + 1, 100)), "PNG")  # compresses far below the byte limit
    assert len(wide) < MAX_BYTES
    err = refused(loader, ImageRef(data_url(wide), "p"))
    assert "--max-image-pixels" in err.message and f"{MAX_PIXELS // 100 + 1} x 100" in err.message


def test_more_images_than_the_limit_and_a_text_only_model(loader: ImageLoader) -> None:
    refs = [ImageRef(data_url(PNG), f"p{i}") for i in range(4)]
    with pytest.raises(ApiError) as e:
        asyncio.run(loader.load(refs))
    assert "--limit-mm-per-prompt" in e.value.message and "4 images" in e.value.message
    with pytest.raises(ApiError) as e:
        asyncio.run(load_images(None, refs[:1]))
    assert e.value.status == 400 and "takes no images" in e.value.message and e.value.param == "p0"
    assert asyncio.run(load_images(None, [])) is None


def test_processing_runs_off_the_event_loop(loader: ImageLoader) -> None:
    """The processor is called on the loader's threads, and the loop runs other work meanwhile."""
    seen: list[str] = []
    real = loader.processor

    def recording(**kw: object) -> object:
        seen.append(threading.current_thread().name)
        return real(**kw)

    async def main() -> None:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        from PIL import Image

        smooth = Image.linear_gradient("L").resize((380, 380)).convert("RGB")  # compresses below the byte limit
        await loader.load([ImageRef(data_url(encoded(smooth, "PNG")), "p")])
        ticker.cancel()
        assert ticks > 1

    loader.processor = recording
    try:
        asyncio.run(main())
    finally:
        loader.processor = real
    assert seen and all(name.startswith("image") for name in seen)


def test_allowed_media_domains_hold_for_the_url_and_every_redirect(vision_dir: str, url: str) -> None:
    args = ServerArgs(model_path=vision_dir, allowed_media_domains="localhost, Example.org")
    assert args.media_domains() == {"localhost", "example.org"}
    loader = ImageLoader.from_args(args, vision_dir, ModelInfo.from_dir(vision_dir).vision)
    assert loader is not None
    try:
        png_pixels = load(loader, ImageRef(data_url(PNG), "a")).images[0].pixels
        by_name = url.replace("127.0.0.1", "localhost")
        assert load(loader, ImageRef(f"{by_name}/a.png", "a")).images[0].pixels == png_pixels
        for bad in (f"{url}/a.png", f"{by_name}/to-ip"):  # by address; by name, then redirected to the address
            e = refused(loader, ImageRef(bad, "b"))
            assert "'127.0.0.1' is not one of --allowed-media-domains" in e.message, e.message
    finally:
        loader.close()
    with pytest.raises(ConfigError):
        ServerArgs(model_path=vision_dir, allowed_media_domains="example.org/path")


def test_an_image_sent_again_is_processed_once(loader: ImageLoader) -> None:
    img = png_bytes(image(48, 80, seed=9))
    hits = loader.cache.hits
    first = load(loader, ImageRef(data_url(img), "a")).images[0]
    again = load(loader, ImageRef(data_url(img), "b")).images[0]
    assert again is first and loader.cache.hits == hits + 1
    other = load(loader, ImageRef(data_url(png_bytes(image(48, 80, seed=10))), "c")).images[0]
    assert other.pixels != first.pixels and loader.cache.hits == hits + 1
    loader.cache.check_integrity()


def test_the_processor_cache_keeps_no_more_than_its_bytes() -> None:
    from tokenizer_proc.requests.images import ProcessedCache, ProcessedImage

    cache = ProcessedCache(max_bytes=100)
    for i in range(5):
        cache.put(bytes([i]), ProcessedImage(pixels=b"x" * 40, grid=(1, 2, 2)))
        cache.check_integrity()
    assert cache.bytes == 80 and cache.get(bytes([0])) is None and cache.get(bytes([4])) is not None
    cache.put(b"big", ProcessedImage(pixels=b"x" * 101, grid=(1, 2, 2)))
    assert cache.get(b"big") is None


@pytest.mark.parametrize(("flag", "field", "method"), [
    ("--limit-mm-per-prompt", "limit_mm_per_prompt", "image_limit"),
    ("--mm-processor-kwargs", "mm_processor_kwargs", "image_processor_kwargs"),
    ("--hicache-storage-backend-extra-config", "hicache_storage_backend_extra_config", "store_extra_config"),
])  # fmt: skip
def test_json_flags_that_are_not_json_objects_name_the_flag(flag: str, field: str, method: str) -> None:
    for bad, says in (("{image: 4", "is not JSON"), ("[4]", "must be a JSON object")):
        with pytest.raises(ConfigError, match=f"^{flag} {says}"):
            getattr(ServerArgs(**{field: bad}), method)()
    assert getattr(ServerArgs(**{field: ""}), method)() is not None
