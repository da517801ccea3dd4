"""Request bodies of bench_serving's backends (pure; the SSE chunks are parsed by serving_metrics.apply_chunk).

Every backend sends the same workload: a prompt of token ids, a fixed number of
new tokens, the given temperature, EOS ignored unless asked otherwise, streamed as SSE.
- ``hyssm``: hyssm's (SGLang-style) ``POST /generate`` with ``input_ids`` and ``sampling_params``.
- ``openai``: ``POST /v1/completions`` of any OpenAI-compatible server (vLLM, SGLang, llama-server,
  hyssm) with the ids as ``prompt`` (all four accept a list of ints), ``stream_options.include_usage``
  and the ``ignore_eos`` extension (vLLM, SGLang, llama-server and hyssm read it).
- ``llama-server``: llama.cpp's native ``POST /completion`` with ``n_predict``, ``ignore_eos`` and
  ``cache_prompt`` (reuse of a slot's matching prompt prefix, the peer of a prefix cache).
``extra`` (``--extra-body``) is merged last into the top level of the body, for server-specific
options (e.g. ``{"min_tokens": 32}`` for vLLM).

``as_text`` (``--prompt-format text``) sends the prompt as a string instead of ids (``text`` on
/generate, ``prompt`` elsewhere): id ``k`` becomes the letter ``chr(ord("a") + k % 26)``, so prompts
sharing an id prefix share a text prefix. The server tokenizes it; prompt and cached token counts
are then the server's. sglang-router needs it for ``/v1/completions`` (it accepts only string
prompts there); its ``/generate`` passes ids through.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

BACKENDS = ("hyssm", "openai", "llama-server")
ALIASES = {"generate": "hyssm"}  # the name this backend had before there were others


def canonical_backend(name: str) -> str:
    """The backend's canonical name; raises ValueError for an unknown one."""
    name = ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (use one of {', '.join(BACKENDS)})")
    return name


def ids_as_text(prompt_ids: Sequence[int]) -> str:
    """The text form of a prompt of ids: one lowercase letter per id (id mod 26)."""
    return "".join(chr(ord("a") + i % 26) for i in prompt_ids)


def request_for(
    backend: str,
    prompt_ids: Sequence[int],
    output_len: int,
    *,
    model: str | None,
    temperature: float,
    ignore_eos: bool,
    extra: Mapping[str, object] | None = None,
    as_text: bool = False,
) -> tuple[str, dict[str, object]]:
    """(path, JSON body) of one streaming request of `output_len` new tokens."""
    backend = canonical_backend(backend)
    ids: list[int] | str = ids_as_text(prompt_ids) if as_text else list(prompt_ids)
    body: dict[str, object]
    if backend == "hyssm":
        params = {"max_new_tokens": output_len, "temperature": temperature, "ignore_eos": ignore_eos}
        path, body = "/generate", {"text" if as_text else "input_ids": ids, "sampling_params": params, "stream": True}
    elif backend == "llama-server":
        path = "/completion"
        body = {"prompt": ids, "n_predict": output_len, "temperature": temperature, "stream": True,
                "cache_prompt": True}  # fmt: skip
        if ignore_eos:
            body["ignore_eos"] = True
    else:
        path = "/v1/completions"
        body = {"model": model, "prompt": ids, "max_tokens": output_len, "temperature": temperature,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        if ignore_eos:  # an extension of the OpenAI schema; --no-ignore-eos omits it
            body["ignore_eos"] = True
    if extra:
        body.update(extra)
    return path, body
