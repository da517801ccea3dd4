"""A prompt's images in its tokens (tokenizer_proc/requests/image_parts.py, prepare.py): the chat template
places each image's placeholder where its part is, each placeholder is expanded to the image's tokens at its
offset, and the GenerateReq the scheduler gets carries the images. Against the tiny seeing checkpoint."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from shared.config import ServerArgs
from shared.messages import GenerateReq
from shared.model_info import ModelInfo
from tests.fixtures.vision_model import IMAGE_PAD, VISION_END, VISION_START, image, png_bytes
from tests.tokenizer.conftest import FakeBackend
from tokenizer_proc import create_app
from tokenizer_proc.http.errors import ApiError
from tokenizer_proc.requests.image_fetch import ImageRef
from tokenizer_proc.requests.images import ImageLoader, PromptImages
from tokenizer_proc.requests.prepare import (
    PreparedRequest,
    prepare_batch,
    prepare_chat,
    prepare_completion,
    prepare_generate,
)
from tokenizer_proc.requests.schemas import ChatBody, CompletionBody, GenerateBody
from tokenizer_proc.requests.tokenizer import TextTokenizer
from tokenizer_proc.requests.validation import Limits

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def url_of(seed: int, w: int = 64, h: int = 48) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image(w, h, seed))).decode()


A, A_AGAIN, B = url_of(1), url_of(1), url_of(2, 96, 64)


@pytest.fixture(scope="module")
def vtok(vision_dir: str) -> TextTokenizer:
    return TextTokenizer.from_dir(vision_dir)


@pytest.fixture(scope="module")
def limits(vision_dir: str) -> Limits:
    info = ModelInfo.from_dir(vision_dir)
    return Limits.from_args(ServerArgs(model_path=vision_dir), info.max_position_embeddings, info.vocab_size,
                            info.vision)


@pytest.fixture(scope="module")
def loader(vision_dir: str) -> Iterator[ImageLoader]:
    made = ImageLoader.from_args(ServerArgs(model_path=vision_dir), vision_dir, ModelInfo.from_dir(vision_dir).vision)
    assert made is not None
    yield made
    made.close()


def loaded(loader: ImageLoader, *urls: str) -> PromptImages:
    return asyncio.run(loader.load([ImageRef(u, f"i{k}") for k, u in enumerate(urls)]))


def chat(*parts: Any, **extra: Any) -> ChatBody:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return msgspec.convert({"messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}, ChatBody)


def img(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def check_placed(req: PreparedRequest, n: int) -> None:
    """Every image's tokens are placeholders between vision_start and vision_end, and nothing else is one."""
    ids = req.input_ids
    assert len(req.images) == n
    for im in req.images:
        assert ids[im.offset - 1] == VISION_START and ids[im.end] == VISION_END
        assert ids[im.offset : im.end] == [IMAGE_PAD] * im.length and im.token_id == IMAGE_PAD
    assert ids.count(IMAGE_PAD) == sum(im.length for im in req.images)


def test_chat_places_images_between_text_parts(vtok, limits, loader) -> None:
    body = chat("look: ", img(A), " and ", {"type": "image_url", "image_url": B}, " ok")
    req = prepare_chat(body, vtok, limits, loaded(loader, A, B))[0]
    check_placed(req, 2)
    first, second = req.images
    assert first.length == 4 and first.grid == (1, 4, 4)  # 64 x 48 -> 64 x 64 pixels, 2 x 2 merged tokens
    assert second.grid == (1, 4, 6) and second.length == 6
    ids = req.input_ids
    assert vtok.decode(ids[: first.offset - 1]).endswith("look: ")
    assert vtok.decode(ids[first.end + 1 : second.offset - 1]) == " and "
    assert vtok.decode(ids[second.end + 1 :]).startswith(" ok")
    bare = vtok.encode(vtok.render_chat([{"role": "user", "content": "look: " + PLACEHOLDER + " and " + PLACEHOLDER
                                                                     + " ok"}]), add_special_tokens=False)
    assert len(ids) == len(bare) + first.length + second.length - 2


def test_digest_is_the_images_identity(vtok, limits, loader) -> None:
    req = prepare_chat(chat(img(A), img(A_AGAIN), img(B)), vtok, limits, loaded(loader, A, A_AGAIN, B))[0]
    a, again, b = req.images
    assert a.digest == again.digest and a.pixels == again.pixels and a.offset != again.offset
    assert b.digest != a.digest
    other = loaded(loader, url_of(3))  # same size, other pixels
    assert prepare_chat(chat(img(url_of(3))), vtok, limits, other)[0].images[0].digest != a.digest


def test_placeholder_count_must_match_the_images(vtok, limits, loader) -> None:
    with pytest.raises(ApiError) as e:  # the text brings a placeholder of its own
        prepare_chat(chat("<|image_pad|>", img(A)), vtok, limits, loaded(loader, A))
    assert e.value.status == 400 and "2 image placeholder(s)" in e.value.message and "1 image(s)" in e.value.message
    with pytest.raises(ApiError) as e:
        prepare_generate(GenerateBody(text="no placeholder"), vtok, limits, loaded(loader, A))
    assert "0 image placeholder(s)" in e.value.message and e.value.param == "text"
    with pytest.raises(ApiError) as e:
        prepare_generate(GenerateBody(input_ids=[5, IMAGE_PAD, 6]), vtok, limits, None)
    assert "1 image placeholder(s)" in e.value.message and e.value.param == "input_ids"
    with pytest.raises(ApiError) as e:
        prepare_completion(CompletionBody(prompt="a" + PLACEHOLDER), vtok, limits)
    assert "placeholder" in e.value.message


def test_generate_text_and_input_ids_place_the_same_images(vtok, limits, loader) -> None:
    images = loaded(loader, A, B)
    text = "x" + PLACEHOLDER + "y" + PLACEHOLDER + "z"
    by_text = prepare_generate(GenerateBody(text=text), vtok, limits, images)
    by_ids = prepare_generate(GenerateBody(input_ids=vtok.encode(text)), vtok, limits, images)  # type: ignore[arg-type]
    check_placed(by_text, 2)
    assert by_ids.input_ids == by_text.input_ids and by_ids.images == by_text.images
    batch = prepare_batch(GenerateBody(text=[text, "plain", "one" + PLACEHOLDER]), vtok, limits,
                          [images, None, loaded(loader, B)])  # fmt: skip
    assert [len(r.images) for r in batch] == [2, 0, 1] and batch[0].images == by_text.images
    assert batch[2].images[0].digest == by_text.images[1].digest


def test_truncating_a_prompt_with_images_is_refused(vtok, limits, loader) -> None:
    with pytest.raises(ApiError) as e:
        prepare_chat(chat("long text " * 5, img(A), truncate_prompt_tokens=8), vtok, limits, loaded(loader, A))
    assert e.value.param == "truncate_prompt_tokens"


# ---- over HTTP, the scheduler a FakeBackend: what a valid request submits -----------------------------------

def serve(vision_dir: str, vtok: TextTokenizer, posts: list[tuple[str, dict[str, Any]]]) -> tuple[
        list[httpx.Response], FakeBackend]:  # fmt: skip
    backend = FakeBackend()
    app = create_app(ServerArgs(model_path=vision_dir, limit_mm_per_prompt='{"image": 2}'), backend, vtok)  # type: ignore[arg-type]

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.post(path, json=body) for path, body in posts]

    try:
        return asyncio.run(main()), backend
    finally:
        app.state.ctx.images.close()


MSG = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, img(A)]}]


def test_valid_image_requests_submit_their_images(vision_dir, vtok) -> None:
    rs, backend = serve(vision_dir, vtok, [
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}),
        ("/v1/responses", {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "what is it?"}, {"type": "input_image", "image_url": A}]}],
            "max_output_tokens": 2}),
        ("/generate", {"text": "q" + PLACEHOLDER, "image_data": A.split(",", 1)[1],
                       "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": ["q" + PLACEHOLDER * 2, "plain"], "image_data": [[A, B], None],
                       "sampling_params": {"max_new_tokens": 2}}),
        ("/tokenize", {"messages": MSG}),
    ])  # fmt: skip
    assert [r.status_code for r in rs] == [200] * 5, [r.text for r in rs]
    subs: list[GenerateReq] = backend.submitted
    assert [len(s.images) for s in subs] == [1, 1, 1, 2, 0]
    assert subs[0].input_ids == subs[1].input_ids and subs[0].images == subs[1].images  # chat = responses
    assert subs[2].images[0].digest == subs[0].images[0].digest
    assert rs[4].json()["tokens"] == subs[0].input_ids  # /tokenize counts each image's tokens as chat does
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(subs[3]), type=GenerateReq)
    assert decoded.images == subs[3].images


BAD = [
    ("video part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "v.mp4"}}]}]},
     "video input is not supported"),
    ("input_video", "/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_video"}]}]},
     "video input is not supported"),
    ("file_id", "/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "file_id"),
    ("too many images", "/v1/chat/completions", {"messages": [{"role": "user", "content": [img(A)] * 3}]},
     "--limit-mm-per-prompt"),
    ("batch image_data not per prompt", "/generate", {"text": ["a" + PLACEHOLDER, "b"], "image_data": [A]},
     "one entry per prompt"),
    ("raw base64 on chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [img(A.split(",", 1)[1])]}]}, "not supported"),
    ("placeholder without image", "/generate", {"text": "a" + PLACEHOLDER}, "placeholder"),
]  # fmt: skip


def test_bad_image_requests_are_400s_and_nothing_is_submitted(vision_dir, vtok) -> None:
    rs, backend = serve(vision_dir, vtok, [(path, body) for _, path, body, _ in BAD]
                        + [("/generate", {"text": "still here", "sampling_params": {"max_new_tokens": 2}})])
    for (name, _, _, says), r in zip(BAD, rs, strict=False):
        assert r.status_code == 400 and says in r.json()["error"]["message"], (name, r.text)
    assert rs[-1].status_code == 200 and len(backend.submitted) == 1
