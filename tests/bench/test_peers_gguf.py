"""bench_peers' GGUF for llama.cpp: the placeholder merge of a BPE vocabulary without merges, the staged
tokenizer, and the staged, cached (and redone when stale) conversion of the built-in model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from benchmarks.peers_gguf import gguf_for, placeholder_merge, safetensors_header
from benchmarks.peers_procs import PeerError
from tests.bench.peers_helpers import BUILTIN

pytestmark = pytest.mark.timeout(120)


def _builtin_tokenizer() -> dict:
    return json.loads((Path(BUILTIN) / "tokenizer.json").read_text(encoding="utf-8"))


def test_placeholder_merge_for_a_bpe_vocabulary_without_merges() -> None:
    tok = _builtin_tokenizer()
    original = json.dumps(tok)
    assert tok["model"]["type"] == "BPE" and tok["model"]["merges"] == [] and len(tok["model"]["vocab"]) == 256
    staged, what = placeholder_merge(tok)  # type: ignore[misc]
    assert json.dumps(tok) == original  # the input is not modified
    vocab, old = staged["model"]["vocab"], tok["model"]["vocab"]
    assert staged["model"]["merges"] == ["\u00fe \u00fe"]
    a, b = staged["model"]["merges"][0].split(" ")
    assert a in vocab and b in vocab and a + b in vocab  # what tokenizers (and so the converter) requires
    assert sorted(vocab.values()) == sorted(old.values()) == list(range(256))  # same ids, same size
    changed = {k: v for k, v in vocab.items() if old.get(k) != v}
    assert changed == {"\u00fe\u00fe": old["\u00ff"]} and set(old) - set(vocab) == {"\u00ff"}
    assert vocab["\u010a"] == 10  # the newline token llama.cpp looks up stays
    assert staged["added_tokens"] == tok["added_tokens"] and staged["pre_tokenizer"] == tok["pre_tokenizer"]
    assert "re-pointed token 255" in what and "llama.cpp requires" in what
    # nothing to do: merges present, or not BPE; a merged token already in the vocabulary: no re-pointing
    assert placeholder_merge({**tok, "model": {**tok["model"], "merges": ["a b"]}}) is None
    assert placeholder_merge({**tok, "model": {"type": "Unigram", "vocab": []}}) is None
    with_merged = {**tok, "model": {**tok["model"], "vocab": {**old, "\u00fe\u00fe": 256}}}
    staged2, what2 = placeholder_merge(with_merged)  # type: ignore[misc]
    assert staged2["model"]["vocab"] == with_merged["model"]["vocab"] and "re-pointed" not in what2
    not_bytes = {**tok, "model": {**tok["model"], "vocab": {"a": 0, "b": 1}}}
    with pytest.raises(PeerError, match="no byte-level token '\u00fe'"):
        placeholder_merge(not_bytes)


def test_staged_tokenizer_loads_and_tokenizes_text_as_before() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = _builtin_tokenizer()
    staged, _ = placeholder_merge(tok)  # type: ignore[misc]
    before, after = tokenizers.Tokenizer.from_str(json.dumps(tok)), tokenizers.Tokenizer.from_str(json.dumps(staged))
    text = "hello \u00fe\u00fe world\n\u00ff\u00ff caf\u00e9 \u65e5\u672c <|pad|>"
    assert after.encode(text).ids == before.encode(text).ids and len(before.encode(text).ids) > 20


FAKE_CONVERT = """#!/bin/bash
set -euo pipefail
[ "$1" = convert ] && [ "$4" = f32 ]
n=$(ls {rec} | wc -l); mkdir {rec}/$n
cp -L "$2"/tokenizer.json "$2"/config.json "$2"/model.safetensors {rec}/$n/
echo "$2" > {rec}/$n/src
echo gguf > "$3"
"""


def test_gguf_for_stages_a_copy_caches_it_and_redoes_a_stale_one(tmp_path: Path) -> None:
    model, rec, logs = tmp_path / "builtin", tmp_path / "rec", tmp_path / "logs"
    shutil.copytree(BUILTIN, model)
    rec.mkdir()
    logs.mkdir()
    script = tmp_path / "convert.sh"
    script.write_text(FAKE_CONVERT.replace("{rec}", str(rec)))
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    stale = tmp_path / "builtin.f32.gguf"
    stale.write_text("converted before staging existed")  # newer than the weights, but without a sidecar
    assert gguf_for(str(model), str(script), logs) == stale and stale.read_text() == "gguf\n"
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before  # the model directory is untouched
    got = rec / "0"
    src = Path((got / "src").read_text().strip())
    assert src.parent == logs and not src.exists()  # a staged temporary copy in the log dir, removed after
    assert json.loads((got / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"] == ["\u00fe \u00fe"]
    config = json.loads((got / "config.json").read_text())
    assert config["vocab_size"] == 264 and {**config, "vocab_size": 260} == json.loads(before["config.json"])
    with open(got / "model.safetensors", "rb") as f:
        header, base = safetensors_header(f)
        data = f.read()
    with open(model / "model.safetensors", "rb") as f:
        old_header, _ = safetensors_header(f)
        old_data = f.read()
    emb, old_emb = header["model.embed_tokens.weight"], old_header["model.embed_tokens.weight"]
    assert emb["shape"] == [264, 128] and old_emb["shape"] == [260, 128] and emb["dtype"] == old_emb["dtype"]
    start, end = emb["data_offsets"]
    o_start, o_end = old_emb["data_offsets"]
    assert data[start : start + o_end - o_start] == old_data[o_start:o_end]
    assert data[start + o_end - o_start : end] == bytes(4 * 128 * 2)  # four zero bf16 rows
    for name, info in old_header.items():  # every other tensor byte-identical
        if name not in ("__metadata__", "model.embed_tokens.weight"):
            s0, e0 = info["data_offsets"]
            s1, e1 = header[name]["data_offsets"]
            assert header[name]["shape"] == info["shape"] and data[s1:e1] == old_data[s0:e0]
    sidecar = json.loads((tmp_path / "builtin.f32.gguf.staging.json").read_text(encoding="utf-8"))
    assert len(sidecar) == 2 and "merges" in sidecar[0] and "padded model.embed_tokens.weight" in sidecar[1]
    assert gguf_for(str(model), str(script), logs) == stale and len(list(rec.iterdir())) == 1  # cached
    later = stale.stat().st_mtime + 10
    os.utime(model / "model.safetensors", (later, later))  # newer weights: converted again
    assert gguf_for(str(model), str(script), logs) == stale and len(list(rec.iterdir())) == 2
