"""Images through a real launch.py serving a tiny seeing Qwen3.5 checkpoint (tests/fixtures/vision_model.py):
the answer equals transformers' greedy generation over the same images; the prefix cache is right about
images (the same image after the same text hits past it, a different image never matches past where it
starts, a conversation's next turn after an image hits); the openai SDK, langchain-openai and litellm send
images as their users do, the Responses API's `input_image` and SGLang's `image_data` are served."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.server import DETERMINISTIC, Server, running_server
from tests.fixtures.vision_model import IMAGE_PAD, VISION_END, VISION_START, image, make_vision_model, png_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "seeing"


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_vision_model(str(tmp_path_factory.mktemp("vision") / "dense"))


@pytest.fixture(scope="module")
def server(model_path: str) -> Iterator[Server]:
    args = ["--model-path", model_path, "--served-model-name", MODEL, "--dtype", "float32",
            "--chunked-prefill-size", "32", *DETERMINISTIC]  # fmt: skip
    with running_server(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def user(*parts: Any) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {
        "url": data_url(p)}} for p in parts]  # fmt: skip
    return [{"role": "user", "content": content}]


def chat(sdk: openai.OpenAI, messages: list[dict], n: int = 6) -> Any:
    return sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip


def transformers_greedy(path: str, prompt_ids: list[int], images: list, n: int) -> list[int]:
    import torch
    from transformers import AutoImageProcessor

    from tests.fixtures.vision_model import reference

    proc = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    ids = torch.tensor([prompt_ids])
    out = reference(path).generate(input_ids=ids, pixel_values=proc["pixel_values"],
                                   image_grid_thw=proc["image_grid_thw"], mm_token_type_ids=(ids == IMAGE_PAD).int(),
                                   max_new_tokens=n, do_sample=False, min_new_tokens=n)  # fmt: skip
    return out[0, len(prompt_ids):].tolist()


def test_answers_equal_transformers_for_images_between_text(sdk: openai.OpenAI, model_path: str) -> None:
    imgs = [image(64, 96, 1), image(100, 50, 2)]
    r = chat(sdk, user("Compare ", imgs[0], " with ", imgs[1], " please."), n=8)
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt.count(VISION_START) == prompt.count(VISION_END) == 2
    assert prompt.count(IMAGE_PAD) == 6 + 6  # 96x64 and 50x100 pixels: 3 x 2 and 2 x 3 merged patches of 32 px
    assert r.choices[0].model_extra["token_ids"] == transformers_greedy(model_path, prompt, imgs, 8)


def cached(r: Any) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def test_the_prefix_cache_hits_on_the_same_image_and_never_on_another(sdk: openai.OpenAI) -> None:
    text = "A long system prompt that every request shares before its image. " * 2
    same = [chat(sdk, user(text, image(64, 64, 10), f" question {i}")) for i in range(3)]
    prompt = same[0].model_extra["prompt_token_ids"]
    image_end = len(prompt) - prompt[::-1].index(VISION_END)
    assert cached(same[2]) >= image_end, [cached(r) for r in same]
    other = chat(sdk, user(text, image(64, 64, 11), " question 2"))
    assert cached(other) <= prompt.index(IMAGE_PAD)
    # the same prompt as same[2] but another image: its own answer, never the cached one's state
    alone = chat(sdk, user(text, image(64, 64, 11), " question 2"))
    assert alone.choices[0].model_extra["token_ids"] == other.choices[0].model_extra["token_ids"]


def test_the_next_turn_after_an_image_hits(sdk: openai.OpenAI) -> None:
    first = user("Look at this: ", image(96, 64, 20), " What is it?")
    r1 = chat(sdk, first)
    turn2 = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And its colour?"}]  # fmt: skip
    r2 = chat(sdk, turn2)
    assert cached(r2) >= len(r1.model_extra["prompt_token_ids"]) - 1, cached(r2)


def test_responses_input_image_and_generate_image_data(server: Server, sdk: openai.OpenAI) -> None:
    img = image(64, 64, 30)
    want = chat(sdk, user("Name it: ", img)).choices[0].message.content
    resp = sdk.responses.create(model=MODEL, max_output_tokens=6, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Name it: "}, {"type": "input_image", "image_url": data_url(img)}]}],
        extra_body={"ignore_eos": True})  # fmt: skip
    assert resp.output_text == want
    with httpx.Client(base_url=server.url, timeout=120) as c:
        text = "<|start_of_role|>user<|end_of_role|>Name it: <|vision_start|><|image_pad|><|vision_end|>" \
               "<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"  # fmt: skip
        r = c.post("/generate", json={"text": text, "image_data": data_url(img), "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["text"] == want


def test_langchain_and_litellm_send_images(server: Server, sdk: openai.OpenAI) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    img = image(64, 96, 40)
    want = chat(sdk, user("What is in ", img)).choices[0].message.content
    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", max_tokens=6, temperature=0,
                     extra_body={"ignore_eos": True})  # fmt: skip
    msg = HumanMessage(content=[{"type": "text", "text": "What is in "},
                                {"type": "image_url", "image_url": {"url": data_url(img)}}])  # fmt: skip
    assert llm.invoke([msg]).content == want
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.telemetry = False
    r = litellm.completion(model=f"openai/{MODEL}", api_base=server.url + "/v1", api_key="none", timeout=120,
                           messages=user("What is in ", img), max_tokens=6, temperature=0, ignore_eos=True)
    assert r.choices[0].message.content == want


def test_an_image_after_other_text_is_not_encoded_again(server: Server, sdk: openai.OpenAI) -> None:
    """The prefix cache cannot serve an image that follows other text; the encoder cache does."""
    img = image(64, 96, 50)
    encoded, cached_before = (server.metric("hyssm_image_encodings_total", result=r) for r in ("encoded", "cached"))
    first = chat(sdk, user("One text before it: ", img))
    assert server.metric("hyssm_image_encodings_total", result="encoded") == encoded + 1
    second = chat(sdk, user("Another text entirely before it: ", img))
    assert server.metric("hyssm_image_encodings_total", result="encoded") == encoded + 1
    assert server.metric("hyssm_image_encodings_total", result="cached") == cached_before + 1
    assert cached(second) < second.model_extra["prompt_token_ids"].index(IMAGE_PAD)
    assert first.choices[0].message.content is not None
