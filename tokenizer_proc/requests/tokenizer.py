"""The tokenizer of the served model: encode, chat template, eos ids, detokeniser factory.

Loaded once per tokenizer process from the model directory (`tokenizer.json`, optional
`tokenizer_config.json` / `chat_template.jinja`) and immutable afterwards, so every request
handler may share it. Vocabulary bounds for validation come from the model (`ModelInfo`), since
a checkpoint's embedding may be larger than the tokenizer's vocabulary.

GIL rule: `Tokenizer.encode` holds the GIL for its whole run (seconds for a few megabytes of text), so
a text longer than `GIL_FREE_ENCODE_CHARS` is encoded through `encode_batch_fast`, which releases it:
encoding in a worker thread then never holds the event loop. Both give the same ids.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from shared.config import ServerArgs
from shared.errors import ModelLoadError
from shared.model_info import ModelInfo
from tokenizer_proc.make_builtin_tokenizer import bytes_to_unicode
from tokenizer_proc.requests.chat_continuation import continue_final
from tokenizer_proc.requests.chat_template import ChatTemplate, select_template
from tokenizer_proc.requests.detokenizer import ByteTableStream, DecodeStreamAdapter, IncrementalDetokenizer

logger = logging.getLogger(__name__)

GIL_FREE_ENCODE_CHARS = 16 * 1024


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    """Whether the decoder is (or chains) ByteLevel, read from the decoder's own serialisation: the whole
    tokenizer's would parse its vocabulary and merges into Python objects that outlive the load."""
    decoder = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else {}
    if decoder.get("type") == "Sequence":
        return any(d.get("type") == "ByteLevel" for d in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"


def _byte_tables(tokenizer: Tokenizer) -> tuple[list[bytes], list[bytes]]:
    """Each token id's bytes, with special tokens kept / skipped (empty). Added tokens that are
    not special are stored verbatim (not byte-level encoded) and decode to their UTF-8."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    added = tokenizer.get_added_tokens_decoder()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    keep: list[bytes] = [b""] * size
    skip: list[bytes] = [b""] * size
    for tid in range(size):
        tok = added.get(tid)
        if tok is not None:
            keep[tid] = tok.content.encode()
            skip[tid] = b"" if tok.special else keep[tid]
            continue
        piece = tokenizer.id_to_token(tid)
        if piece is None:
            continue
        if all(c in byte_of for c in piece):
            keep[tid] = skip[tid] = bytes(byte_of[c] for c in piece)
        else:
            keep[tid] = skip[tid] = piece.encode()
    return keep, skip


@dataclass(frozen=True)
class ChatConventions:
    """How the served model's chats are written and read: the template (--chat-template, "" = the
    checkpoint's), the tool-call format (--tool-call-parser), the reasoning format (--reasoning-parser) and
    whether a request may bring its own template (--trust-request-chat-template)."""

    template: str = ""
    tool_call_parser: str = "auto"
    reasoning_parser: str = ""
    trust_request_template: bool = False

    @staticmethod
    def from_args(args: ServerArgs) -> ChatConventions:
        return ChatConventions(args.chat_template, args.tool_call_parser, args.reasoning_parser,
                               args.trust_request_chat_template)  # fmt: skip


_REQUEST_TEMPLATES_KEPT = 8  # compiled per-request templates kept, the least recently used dropped first
# Pieces whose BPE merges the tokenizers library memoises (its default is 10,000). A piece is a word
# for a tokenizer that splits on a regex, but a whole run of text between special tokens for one that
# does not (the built-in model's): then each entry is a short prompt of a few KB and never hit again.
# The library fills its cache and never evicts, so this bound is what the cache adds to the process.
WORD_CACHE_ENTRIES = 2048


class TextTokenizer:
    """Owns the `tokenizers.Tokenizer`, the chat template and the per-token byte tables. Immutable but
    for the bounded cache of per-request templates compiled so far (the rendering is the same either way)."""

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any], model_dir: str, info: ModelInfo,
                 chat: ChatConventions = ChatConventions()) -> None:  # fmt: skip
        self.chat = chat
        self.tokenizer = tokenizer
        self.vocab_size = info.vocab_size
        specials = {
            key: content
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (content := _token_content(config.get(key))) is not None
        }
        self.special_tokens: dict[str, str] = dict(specials)  # bos/eos/pad/unk token strings of the config
        eos_ids = list(info.eos_token_ids)
        cfg_eos = tokenizer.token_to_id(specials["eos_token"]) if "eos_token" in specials else None
        if cfg_eos is not None and cfg_eos not in eos_ids:
            eos_ids.append(cfg_eos)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)
        self.model_eos_ids: frozenset[int] = frozenset(info.eos_token_ids)
        self.chat_template = ChatTemplate(select_template(config, model_dir, chat.template), specials)
        self._specials = specials
        self._request_templates: OrderedDict[str, ChatTemplate] = OrderedDict()
        self._tables = _byte_tables(tokenizer) if _is_byte_level(tokenizer) else None
        resize = getattr(tokenizer.model, "_resize_cache", None)  # tokenizers >= 0.21, BPE models
        if resize is not None:
            resize(WORD_CACHE_ENTRIES)

    @staticmethod
    def from_dir(model_dir: str, info: ModelInfo | None = None, chat: ChatConventions = ChatConventions()
                 ) -> TextTokenizer:  # fmt: skip
        """Load from a model directory; raise ModelLoadError naming the file on failure (ChatTemplateError
        when --chat-template names nothing)."""
        info = info or ModelInfo.from_dir(model_dir)
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(f"missing {path}")
        try:
            tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception
            raise ModelLoadError(f"{path} cannot be loaded: {e}") from e
        config: dict[str, Any] = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from e
        return TextTokenizer(tokenizer, config, model_dir, info, chat)

    @property
    def extra_stop_ids(self) -> tuple[int, ...]:
        """EOS ids of the tokenizer config that the model config does not list (the scheduler
        stops on the model's own EOS ids; these are sent as stop_token_ids unless ignore_eos)."""
        return tuple(t for t in self.eos_token_ids if t not in self.model_eos_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > GIL_FREE_ENCODE_CHARS:
            return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False, template: str | None = None,
    ) -> str:
        """The chat template over `messages`; `extra` are chat_template_kwargs, `tools` the tool
        definitions the template renders (OpenAI shape); `continue_final_message`: the text ends
        inside the last message, without a generation prompt (chat_continuation.py); `template`: a
        request's own template source instead of the server's (the caller checked it may bring one)."""
        chosen = self.chat_template if template is None else self._request_template(template)
        text = chosen.render(messages, add_generation_prompt=add_generation_prompt and not continue_final_message,
                             extra=extra, tools=tools)  # fmt: skip
        return continue_final(text, messages) if continue_final_message else text

    def _request_template(self, source: str) -> ChatTemplate:
        """The compiled `source` (ChatTemplateError when it does not compile), from the bounded cache."""
        kept = self._request_templates.get(source)
        if kept is None:
            kept = ChatTemplate(source, self._specials)
            self._request_templates[source] = kept
            while len(self._request_templates) > _REQUEST_TEMPLATES_KEPT:
                self._request_templates.popitem(last=False)
        self._request_templates.move_to_end(source)
        return kept

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        detok = self.detokenizer((), skip_special_tokens)
        return detok.push(list(token_ids)) + detok.finish()

    def detokenizer(self, stops: Sequence[str] = (), skip_special_tokens: bool = True,
                    stop_regexes: Sequence[str] = ()) -> IncrementalDetokenizer:  # fmt: skip
        if self._tables is not None:
            stream: ByteTableStream | DecodeStreamAdapter = ByteTableStream(
                self._tables[1] if skip_special_tokens else self._tables[0]
            )
        else:
            stream = DecodeStreamAdapter(self.tokenizer, skip_special_tokens)
        return IncrementalDetokenizer(stream, stops, stop_regexes)

    def token_text(self, token_id: int) -> str:
        """Display text of one token (for logprobs); partial UTF-8 shows as U+FFFD."""
        if self._tables is not None:
            table = self._tables[0]
            return table[token_id].decode("utf-8", "replace") if 0 <= token_id < len(table) else ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        if self._tables is not None and 0 <= token_id < len(self._tables[0]):
            return list(self._tables[0][token_id])
        return list(self.token_text(token_id).encode())
