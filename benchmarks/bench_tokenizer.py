"""A synthetic byte-level BPE tokenizer with a real model's vocabulary size (for bench checkpoints).

Layout of the ids (vocab_size V, for Granite-4.0 V = 100352):
- 0..255: the 256 byte tokens in byte order, spelled with the GPT-2 byte-to-unicode map;
- 256..S-1: synthetic merges, S = V - len(special tokens). Merges are listed in order of length:
  every pair of the ALPHABET characters, then every (previous level token, ALPHABET character), ...
  until S - 256 merges exist; each merge joins two tokens that exist before it, so the BPE is valid;
- S..V-1: special tokens, Granite-style (``<|pad|>`` first, ``<|end_of_text|>`` second, which is
  eos and bos, then role, FIM and tool tokens), padded with ``<|reserved_special_token_k|>``.
The pre-tokenizer is ByteLevel with the GPT-2 split regex (what llama.cpp's converter assumes for
an unknown BPE tokenizer), so text tokenizes alike in both. The text it produces means nothing: the
benchmarks send token ids. As a script it writes one into a folder:

    python -m benchmarks.bench_tokenizer OUT_DIR [--vocab-size 100352]
"""

from __future__ import annotations

import argparse
import json
import os
import string
import sys
from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tokenizer_proc.make_builtin_tokenizer import tokenizer_config as builtin_tokenizer_config

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|end_of_text|>"
NAMED_SPECIAL_TOKENS = (
    PAD_TOKEN,
    EOS_TOKEN,
    "<fim_prefix>",
    "<fim_middle>",
    "<fim_suffix>",
    "<fim_pad>",
    "<filename>",
    "<reponame>",
    "<|start_of_role|>",
    "<|end_of_role|>",
    "<|unused_1|>",
    "<|start_of_plugin|>",
    "<|end_of_plugin|>",
    "<|unk|>",
    "<|tool_call|>",
)
NUM_SPECIAL_TOKENS = 96  # named ones, then reserved ones
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content']"
    " + '<|end_of_text|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_of_role|>assistant<|end_of_role|>' }}"
    "{%- endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes are themselves,
    the remaining bytes take code points 256, 257, ... in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in kept}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


def _alphabet(chars: dict[int, str]) -> list[str]:
    """Characters merges are built from: space (as its byte-level char), letters, digits, some punctuation."""
    text = " " + string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,'-:;!?()\n"
    return [chars[b] for b in text.encode()]


def special_tokens() -> list[str]:
    reserved = NUM_SPECIAL_TOKENS - len(NAMED_SPECIAL_TOKENS)
    return [*NAMED_SPECIAL_TOKENS, *(f"<|reserved_special_token_{k}|>" for k in range(reserved))]


def synthetic_merges(count: int, chars: dict[int, str]) -> list[tuple[str, str]]:
    """`count` merges, shortest results first (see the module docstring)."""
    alphabet = _alphabet(chars)
    merges: list[tuple[str, str]] = []
    level = alphabet
    while len(merges) < count:
        nxt: list[str] = []
        for left in level:
            for c in alphabet:
                merges.append((left, c))
                nxt.append(left + c)
                if len(merges) == count:
                    return merges
        level = nxt
    return merges


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """The tokenizer with exactly `vocab_size` ids. Raises ValueError if vocab_size is too small."""
    specials = special_tokens()
    n_merges = vocab_size - 256 - len(specials)
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} < 256 byte tokens + {len(specials)} special tokens")
    chars = byte_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    merges = synthetic_merges(n_merges, chars)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size}")
    return tok


def tokenizer_config(tok: Tokenizer) -> dict[str, object]:
    added = {tid: t.content for tid, t in tok.get_added_tokens_decoder().items()}
    return builtin_tokenizer_config(added, CHAT_TEMPLATE, model_max_length=1 << 20, padding_side="left")


def write_tokenizer(out_dir: str, vocab_size: int) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json; returns {"eos": id, "pad": id}."""
    tok = build_tokenizer(vocab_size)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(tok), f, indent=2)
        f.write("\n")
    eos, pad = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    assert eos is not None and pad is not None
    return {"eos": eos, "pad": pad}


def main(argv: Sequence[str] | None = None) -> int:
    """Write tokenizer.json and tokenizer_config.json into OUT_DIR (created); print the eos/pad ids."""
    p = argparse.ArgumentParser(description="Write a synthetic byte-level BPE tokenizer of a given vocabulary size.")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--vocab-size", type=int, default=100352, help="ids in all (Granite-4.0: 100352)")
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    try:
        ids = write_tokenizer(args.out_dir, args.vocab_size)
    except ValueError as e:
        p.error(str(e))
    print(f"{args.out_dir}: {args.vocab_size} ids, eos {ids['eos']}, pad {ids['pad']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
