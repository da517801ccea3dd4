"""Bad image input against real servers (launch.py): the tiny seeing checkpoint, and the built-in text-only
model. Every bad body is a 400 whose JSON error names the problem, and the server keeps serving (a text
request after them answers 200). Image URLs are served by an HTTP server on a thread of this process."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.server import Server, running_server
from tests.fixtures.vision_model import image
from tests.tokenizer.media_server import PNG, data_url, encoded, media_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MAX_BYTES = 32 * 1024
MAX_PIXELS = 300 * 300
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def media() -> Iterator[str]:
    with media_server(MAX_BYTES) as base:
        yield base


@pytest.fixture(scope="module")
def seeing(vision_dir: str) -> Iterator[Server]:
    flags = ["--model-path", vision_dir, "--media-fetch-timeout", "1", "--max-image-bytes", str(MAX_BYTES),
             "--max-image-pixels", str(MAX_PIXELS), "--limit-mm-per-prompt", '{"image": 2}']
    with running_server(flags) as srv:
        yield srv


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}],
            "max_tokens": 2}


def img(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def bad_bodies(media: str) -> list[tuple[str, str, dict[str, Any], str]]:
    from PIL import Image

    wide = encoded(Image.new("RGB", (MAX_PIXELS // 100 + 1, 100)), "PNG")
    tiff = encoded(image(16, 16), "TIFF")
    return [
        ("undecodable", CHAT, user(img(data_url(b"not an image at all"))), "cannot be decoded"),
        ("tiff", CHAT, user(img(data_url(tiff, "image/tiff"))), "format TIFF is not supported"),
        ("svg", CHAT, user(img(data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"))),
         "cannot be decoded"),
        ("timeout", CHAT, user(img(f"{media}/never")), "--media-fetch-timeout"),
        ("404", CHAT, user(img(f"{media}/missing.png")), "HTTP 404"),
        ("too many bytes", CHAT, user(img(f"{media}/big-chunked")), "--max-image-bytes"),
        ("file scheme", CHAT, user(img("file:///etc/passwd")), "scheme 'file' is not supported"),
        ("ftp scheme", CHAT, user(img("ftp://example.com/a.png")), "scheme 'ftp' is not supported"),
        ("too many images", CHAT, user(*[img(data_url(PNG))] * 3), "--limit-mm-per-prompt"),
        ("too many pixels", CHAT, user(img(data_url(wide))), "--max-image-pixels"),
        ("video part", CHAT, user({"type": "video_url", "video_url": {"url": f"{media}/v.mp4"}}),
         "video input is not supported"),
        ("responses video", "/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_video"}]}]},
         "video input is not supported"),
        ("responses file_id", "/v1/responses",
         {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, "file_id"),
        ("generate placeholder count", "/generate", {"text": "no placeholder", "image_data": data_url(PNG)},
         "placeholder"),
        ("generate undecodable", "/generate", {"text": "<|vision_start|><|image_pad|><|vision_end|>",
                                              "image_data": base64.b64encode(b"garbage!").decode()},
         "cannot be decoded"),
    ]  # fmt: skip


def test_bad_images_are_400s_and_the_server_keeps_serving(seeing: Server, media: str) -> None:
    with seeing.client(timeout=30) as c:
        for name, path, body, says in bad_bodies(media):
            r = c.post(path, json=body)
            assert r.status_code == 400, (name, r.text)
            err = r.json()["error"]
            assert says in err["message"] and err["code"] == 400, (name, err)
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_an_image_to_the_text_only_model_is_a_400() -> None:
    with running_server([]) as srv, srv.client(timeout=30) as c:
        r = c.post(CHAT, json=user(img(data_url(PNG))))
        assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"], r.text
        r = c.post("/generate", json={"text": "a", "image_data": data_url(PNG)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "image_data", r.text
        assert c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
