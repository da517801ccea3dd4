"""Write the built-in model's `tokenizer.json` and `tokenizer_config.json`.

Run `python -m tokenizer_proc.make_builtin_tokenizer [OUT_DIR]` (default: the built-in model dir).
The files are committed; this script is how they were made and how to regenerate them.

The tokenizer is byte-level BPE with no merges, so every byte is one token:
ids 0..255 are the 256 ByteLevel byte tokens in byte order (id == byte value), then the special
tokens 256 `<|end_of_text|>` (eos and bos), 257 `<|start_of_role|>`, 258 `<|end_of_role|>`,
259 `<|pad|>`. vocab_size is 260 and must equal the built-in config.json's vocab_size.
"""

from __future__ import annotations

import json
import os
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from shared.config import builtin_model_dir

SPECIAL_TOKENS = ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|pad|>")
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Granite-style: one `<|start_of_role|>ROLE<|end_of_role|>CONTENT<|end_of_text|>\n` per message,
# then `<|start_of_role|>assistant<|end_of_role|>` as the generation prompt. The newline is an
# expression (not template whitespace) so trim_blocks/lstrip_blocks cannot change it. With `tools`, a
# first system turn lists them (one JSON object per line) and asks for `<tool_call>{"name", "arguments"}
# </tool_call>` blocks; an assistant turn's tool_calls are rendered in that same form after its content.
GRANITE_STYLE_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|start_of_role|>system<|end_of_role|>Available tools:\\n<tools>\\n' }}"
    "{%- for tool in tools %}"
    "{{- (tool.function if tool.function is defined else tool) | tojson + '\\n' }}"
    "{%- endfor %}"
    "{{- '</tools>\\nCall a tool by answering <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>'"
    " + '<|end_of_text|>' + '\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + (message['content'] or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson"
    " + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|end_of_text|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_of_role|>assistant<|end_of_role|>' }}"
    "{%- endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (GPT-2 convention): printable
    Latin-1 bytes map to themselves, the other 68 bytes to code points 256, 257, ... in order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    keep = set(printable)
    mapping: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer() -> Tokenizer:
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    added = tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if added != len(SPECIAL_TOKENS) or tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError("built-in tokenizer does not have the expected 260 tokens")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != 256 + i:
            raise RuntimeError(f"special token {t} did not get id {256 + i}")
    return tok


def tokenizer_config(added: dict[int, str] | None = None, chat_template: str = GRANITE_STYLE_CHAT_TEMPLATE,
                     **extra: object) -> dict[str, object]:
    """A Granite-style tokenizer_config.json whose special tokens are `added` (id -> content; the
    built-in model's by default); `extra`: further fields."""
    if added is None:
        added = {256 + i: t for i, t in enumerate(SPECIAL_TOKENS)}
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        **extra,
        "added_tokens_decoder": {str(tid): {"content": t, **flags} for tid, t in sorted(added.items())},
        "chat_template": chat_template,
    }


def write(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    build_tokenizer().save(os.path.join(out_dir, "tokenizer.json"), pretty=True)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(), f, indent=2, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else builtin_model_dir())
