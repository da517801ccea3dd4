"""Where a request's images are and where their tokens go in its prompt.

Rules:
- chat (and the Responses API's chat request): every `image_url` content part is one image, in message
  and part order; its `image_url` is `{"url": ...}` or the URL alone; a `video_url` part is a 400 ("video
  input is not supported"). A message with an image keeps its content list for the chat template
  (text parts `{"type": "text", "text": ...}`, image parts `{"type": "image_url", "image_url": {"url":
  ...}}`), so the template places each image's placeholder where the part is; a message of text parts only
  is rendered as their joined text, as before;
- /generate: SGLang's `image_data` is one image (a string) or a list of them for one prompt; for a batch
  of prompts, a list of one entry (a string, a list, or null) per prompt. The prompt (`text`, or
  `input_ids`) holds the image placeholder once per image where its tokens go;
- a prompt's image placeholder tokens (`VisionInfo.image_token_id`) are exactly one per image, in order
  (else a 400 naming the counts); each is expanded to the image's `length` tokens, and the image's offset
  is where they start (`place_images`). On a checkpoint that sees, a placeholder without an image is a 400
  too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.images import make_image_input
from shared.messages.images import ImageInput
from shared.model_info import VisionInfo
from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.requests.image_fetch import ImageRef
from tokenizer_proc.requests.images import PromptImages
from tokenizer_proc.requests.schemas import ChatMessage, GenerateBody, ImagePart, TextPart, VideoPart

VIDEO_UNSUPPORTED = "video input is not supported"


def _url(part: ImagePart) -> str:
    return part.image_url if isinstance(part.image_url, str) else part.image_url.url


def chat_image_refs(messages: Sequence[ChatMessage] | None) -> list[ImageRef]:
    """Every image of the messages, in order (a 400 for a video part)."""
    refs: list[ImageRef] = []
    for i, m in enumerate(messages or ()):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if isinstance(part, VideoPart):
                raise bad_request(VIDEO_UNSUPPORTED, f"messages[{i}].content[{j}]")
            if isinstance(part, ImagePart):
                refs.append(ImageRef(_url(part), f"messages[{i}].content[{j}].image_url"))
    return refs


def template_content(content: Sequence[TextPart | ImagePart | VideoPart]) -> str | list[dict[str, Any]]:
    """What the chat template sees of a content list (module doc)."""
    if all(isinstance(p, TextPart) for p in content):
        return "".join(p.text for p in content)  # type: ignore[union-attr]
    out: list[dict[str, Any]] = []
    for p in content:
        if isinstance(p, TextPart):
            out.append({"type": "text", "text": p.text})
        elif isinstance(p, ImagePart):
            out.append({"type": "image_url", "image_url": {"url": _url(p)}})
    return out


def _one_prompt_refs(entry: Any, param: str) -> list[ImageRef]:
    if entry is None:
        return []
    if isinstance(entry, str):
        return [ImageRef(entry, param, raw_ok=True)]
    if isinstance(entry, list) and all(isinstance(e, str) for e in entry):
        return [ImageRef(e, f"{param}[{k}]", raw_ok=True) for k, e in enumerate(entry)]
    raise bad_request("image_data must be an image (a URL or base64 string) or a list of them", param)


def generate_image_refs(body: GenerateBody) -> list[list[ImageRef]]:
    """Each prompt's images of a /generate body: one list for a single prompt, one per prompt of a batch."""
    if isinstance(body.text, list):
        prompts, batch = len(body.text), True
    elif body.input_ids and all(isinstance(t, list) for t in body.input_ids):
        prompts, batch = len(body.input_ids), True
    else:
        prompts, batch = 1, False
    data = body.image_data
    if data is None or data == []:
        return [[] for _ in range(prompts)]
    if body.video_data not in (None, [], ""):
        raise bad_request(VIDEO_UNSUPPORTED, "video_data")
    if not batch:
        return [_one_prompt_refs(data, "image_data")]
    if not isinstance(data, list) or len(data) != prompts:
        raise bad_request(f"image_data of a batch of {prompts} prompts must be a list of one entry per prompt (an "
                          "image, a list of images, or null)", "image_data")  # fmt: skip
    return [_one_prompt_refs(entry, f"image_data[{i}]") for i, entry in enumerate(data)]


def place_images(ids: list[int], images: PromptImages | None, vision: VisionInfo | None,
                 param: str) -> tuple[list[int], tuple[ImageInput, ...]]:  # fmt: skip
    """The prompt with each image placeholder expanded to its image's tokens, and the images at their offsets."""
    if vision is None:
        return ids, ()
    token = vision.image_token_id
    at = [k for k, t in enumerate(ids) if t == token]
    given = images.images if images is not None else ()
    if len(at) != len(given):
        raise bad_request(f"the prompt has {len(at)} image placeholder(s) (token {token}) for {len(given)} image(s): "
                          "each image needs exactly one, where its tokens go", param)  # fmt: skip
    if not given:
        return ids, ()
    out: list[int] = []
    placed: list[ImageInput] = []
    start = 0
    for k, img in zip(at, given, strict=True):
        out.extend(ids[start:k])
        inp = make_image_input(img.pixels, img.grid, len(out), token, vision.spatial_merge_size)
        out.extend([token] * inp.length)
        placed.append(inp)
        start = k + 1
    out.extend(ids[start:])
    return out, tuple(placed)
