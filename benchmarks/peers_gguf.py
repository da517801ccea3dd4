"""bench_peers' GGUF for llama-server: converted once with the peers script, cached, from a staged copy
when llama.cpp cannot load the checkpoint as it is.

Rules:
- path: ``NAME.TYPE.gguf`` beside the model directory (in the log dir for a model inside this
  repository), TYPE the converter's output type (``f32``, ``bf16``; one file per type, so they
  coexist); reused while it is at least as new as every file of the model directory and, for a
  staged conversion, while its sidecar ``NAME.TYPE.gguf.staging.json`` records the same staging (a
  GGUF converted before staging existed is redone);
- the model directory is never modified; a staged copy is a temporary directory in the log dir holding
  symlinks to the model's files, with these files replaced:
  - ``tokenizer.json``, when it is a BPE model with an empty merges list (a byte-level vocabulary and
    nothing else, e.g. hyssm's built-in model): llama.cpp's BPE vocabulary loader requires the
    ``tokenizer.ggml.merges`` key, which the converter writes only for a non-empty list, and the
    tokenizers library (which the converter loads) requires a merge's two parts and its result to be in
    the vocabulary. So one placeholder merge of byte 0xFE with itself (``"þ þ"``) is added, and when its
    result ``"þþ"`` is not in the vocabulary the token of byte 0xFF (``"ÿ"``) is re-pointed to it, same
    id. Neither byte occurs in UTF-8 text, so tokenizing any text is unchanged; bench_peers' prompts are
    token ids in any case;
  - ``config.json`` and the safetensors file(s) holding the vocabulary-sized tensors (names ending in
    VOCAB_TENSOR_SUFFIXES), when ``vocab_size`` is not a multiple of VOCAB_MULTIPLE: llama.cpp's Mamba-2
    based converters (Granite hybrid, Nemotron-H) round the token list up to a multiple of 8 but not the
    tensors, and llama-server then rejects ``token_embd.weight``'s shape. The tensors get zero rows and
    ``vocab_size`` is rounded up (the extra ids are never in a prompt; their logits are 0).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from benchmarks.peers_procs import PeerError

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
VOCAB_MULTIPLE = 8
VOCAB_TENSOR_SUFFIXES = ("embed_tokens.weight", "embeddings.weight", "lm_head.weight")
GGUF_OUTTYPES = ("f32", "bf16", "f16", "q8_0")  # what llama-server.sh convert writes
QUANTIZE_TYPES = ("Q4_K_M",)  # what llama-quantize makes here from the f32 file
PLACEHOLDER_PART, SPARE_TOKEN = "\u00fe", "\u00ff"  # byte-level BPE's characters of bytes 0xFE and 0xFF


def placeholder_merge(tokenizer: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """(a copy of `tokenizer` with one merge llama.cpp accepts, what was done) for a BPE model with an
    empty merges list; None when it needs nothing. Raises PeerError when the vocabulary lacks the byte
    tokens it needs. The input is not modified."""
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE" or model.get("merges") != []:
        return None
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    merge, merged = f"{PLACEHOLDER_PART} {PLACEHOLDER_PART}", PLACEHOLDER_PART * 2
    needed = (PLACEHOLDER_PART,) if merged in vocab else (PLACEHOLDER_PART, SPARE_TOKEN)
    missing = [c for c in needed if c not in vocab]
    if missing:
        raise PeerError(
            f"tokenizer.json: a BPE model without merges needs a placeholder merge for llama.cpp, but its "
            f"vocabulary has no byte-level token {missing[0]!r} (is it byte-level BPE?)"
        )
    what = f"added the one placeholder merge {merge!r}"
    if merged not in vocab:
        token_id = vocab.pop(SPARE_TOKEN)
        vocab[merged] = token_id
        what = f"re-pointed token {token_id} {SPARE_TOKEN!r} (byte 0xFF) to {merged!r} and {what}"
    staged = {**tokenizer, "model": {**model, "vocab": vocab, "merges": [merge]}}
    return staged, f"tokenizer.json has no BPE merges and llama.cpp requires some: {what}"


def safetensors_header(f: BinaryIO) -> tuple[dict[str, Any], int]:
    """(the JSON header, the offset of the data) of the safetensors file open at its start."""
    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n)), 8 + n


def vocab_tensors(path: Path, vocab: int) -> list[str]:
    """Names of the tensors of a safetensors file (header only) ending in VOCAB_TENSOR_SUFFIXES with
    `vocab` rows."""
    with open(path, "rb") as f:
        header, _ = safetensors_header(f)
    return [k for k, v in header.items() if k.endswith(VOCAB_TENSOR_SUFFIXES) and v["shape"][:1] == [vocab]]


def pad_safetensors(src: Path, dst: Path, vocab: int, padded: int) -> None:
    """Copy `src` to `dst` with zero rows appended (up to `padded`) to its vocab_tensors (zero bytes are
    0.0 in every float dtype); other tensors and the metadata are copied as they are."""
    hits = set(vocab_tensors(src, vocab))
    with open(src, "rb") as f, open(dst, "wb") as out:
        header, base = safetensors_header(f)
        meta = {k: header.pop(k) for k in ("__metadata__",) if k in header}
        tensors = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        new_header: dict[str, Any] = dict(meta)
        offset, grow = 0, {}
        for name, info in tensors:
            start, end = info["data_offsets"]
            grow[name] = (end - start) // vocab * (padded - vocab) if name in hits else 0
            shape = [padded, *info["shape"][1:]] if name in hits else info["shape"]
            new_header[name] = {**info, "shape": shape, "data_offsets": [offset, offset + end - start + grow[name]]}
            offset += end - start + grow[name]
        raw = json.dumps(new_header).encode()
        raw += b" " * (-len(raw) % 8)
        out.write(struct.pack("<Q", len(raw)) + raw)
        for name, info in tensors:
            start, end = info["data_offsets"]
            f.seek(base + start)
            for done in range(0, end - start, 1 << 24):
                out.write(f.read(min(1 << 24, end - start - done)))
            out.write(bytes(grow[name]))


@dataclass(frozen=True)
class Staging:
    """What a staged copy replaces: new file contents, safetensors files to pad, and why (notes)."""

    notes: tuple[str, ...] = ()
    files: dict[str, bytes] = field(default_factory=dict)
    pad: tuple[str, ...] = ()
    vocab: int = 0
    padded: int = 0


def plan_staging(model: Path) -> Staging:
    """What `model` needs staged for llama.cpp (see the module docstring); reads JSON and safetensors
    headers only. Staging().notes empty: nothing."""
    notes, files, pad = [], {}, []
    tok_path = model / "tokenizer.json"
    if tok_path.is_file():
        fixed = placeholder_merge(json.loads(tok_path.read_text(encoding="utf-8")))
        if fixed is not None:
            files["tokenizer.json"] = json.dumps(fixed[0], ensure_ascii=False).encode()
            notes.append(fixed[1])
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    vocab = int(config.get("vocab_size") or 0)
    padded = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if padded != vocab:
        names: list[str] = []
        for src in sorted(model.glob("*.safetensors")):
            hits = vocab_tensors(src, vocab)
            names += hits
            pad += [src.name] if hits else []
        if not names:
            raise PeerError(f"{model}: vocab_size {vocab} needs padding for llama.cpp, but no safetensors tensor "
                            f"named *{'/*'.join(VOCAB_TENSOR_SUFFIXES)} has {vocab} rows")  # fmt: skip
        files["config.json"] = json.dumps({**config, "vocab_size": padded}, indent=2).encode()
        notes.append(
            f"vocab_size {vocab} is not a multiple of {VOCAB_MULTIPLE} (llama.cpp's Mamba-2 converters pad the "
            f"token list, not the tensors): padded {', '.join(names)} with zero rows to {padded}"
        )
    return Staging(tuple(notes), files, tuple(pad), vocab, padded)


def write_staging(model: Path, plan: Staging, staging: Path) -> None:
    """Fill the empty directory `staging`: the plan's files, padded safetensors, symlinks to the rest."""
    for p in model.iterdir():
        if p.name in plan.files:
            (staging / p.name).write_bytes(plan.files[p.name])
        elif p.name in plan.pad:
            pad_safetensors(p, staging / p.name, plan.vocab, plan.padded)
        else:
            (staging / p.name).symlink_to(p.resolve())


def gguf_for(model_dir: str, peers_script: str, log_dir: Path, outtype: str = "f32") -> Path:
    """The cached GGUF of type `outtype` (``llama-server.sh convert``'s f32, bf16, ...) of `model_dir`
    for llama-server, converted now when missing, older than the weights or staged differently (see the
    module docstring); a `QUANTIZE_TYPES` type is llama-quantize's output over the f32 file."""
    if outtype in QUANTIZE_TYPES:
        return _quantized(gguf_for(model_dir, peers_script, log_dir, "f32"), outtype, peers_script, log_dir)
    if outtype not in GGUF_OUTTYPES:
        raise PeerError(f"GGUF type must be one of {', '.join(GGUF_OUTTYPES)}, got {outtype!r}")
    model = Path(model_dir).resolve()
    gguf = (log_dir if model.is_relative_to(REPO) else model.parent) / f"{model.name}.{outtype}.gguf"
    sidecar = gguf.with_name(gguf.name + ".staging.json")
    newest = max(p.stat().st_mtime for p in model.iterdir() if p.is_file())
    plan = plan_staging(model)
    recorded = json.loads(sidecar.read_text(encoding="utf-8")) if sidecar.is_file() else []
    if gguf.is_file() and gguf.stat().st_mtime >= newest and recorded == list(plan.notes):
        return gguf
    if not plan.notes:
        _convert(model, gguf, outtype, peers_script, log_dir)
        sidecar.unlink(missing_ok=True)
        return gguf
    logger.info("llama.cpp: converting a staged copy of %s (the model directory is untouched): %s",
                model, "; ".join(plan.notes))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gguf-staging-", dir=log_dir) as tmp:
        write_staging(model, plan, Path(tmp))
        _convert(Path(tmp), gguf, outtype, peers_script, log_dir)
    sidecar.write_text(json.dumps(plan.notes, indent=1, ensure_ascii=False), encoding="utf-8")
    return gguf


def _quantized(f32: Path, qtype: str, peers_script: str, log_dir: Path) -> Path:
    """`f32` quantized to `qtype` beside it (cached; redone when older than the f32 file)."""
    out = f32.with_name(f32.name.removesuffix(".f32.gguf") + f".{qtype}.gguf")
    if out.is_file() and out.stat().st_mtime >= f32.stat().st_mtime:
        return out
    with open(log_dir / "quantize.log", "wb") as log:
        found = subprocess.run(["bash", peers_script, "quantize-bin"], stdout=subprocess.PIPE, stderr=log,
                               timeout=3600, check=False)  # fmt: skip
        binary = found.stdout.decode().strip().splitlines()[-1:] if found.returncode == 0 else []
        if not binary:
            raise PeerError(f"cannot build llama-quantize (rc {found.returncode}); see {log_dir / 'quantize.log'}")
        tmp = out.with_suffix(".gguf.tmp")
        logger.info("quantizing %s to %s (once; cached)", f32, qtype)
        rc = subprocess.call([binary[0], str(f32), str(tmp), qtype], stdout=log, stderr=subprocess.STDOUT,
                             timeout=3600)  # fmt: skip
    if rc != 0 or not tmp.is_file():
        raise PeerError(f"llama-quantize {qtype} failed (rc {rc}); see {log_dir / 'quantize.log'}")
    os.replace(tmp, out)
    return out


def _convert(src: Path, gguf: Path, outtype: str, peers_script: str, log_dir: Path) -> None:
    tmp = gguf.with_suffix(".gguf.tmp")
    logger.info("converting %s to %s (once; cached)", src, gguf)
    with open(log_dir / "convert.log", "wb") as log:
        rc = subprocess.call(["bash", peers_script, "convert", str(src), str(tmp), outtype],
                             stdout=log, stderr=subprocess.STDOUT, timeout=3600)  # fmt: skip
    if rc != 0 or not tmp.is_file():
        raise PeerError(f"GGUF conversion failed (rc {rc}); see {log_dir / 'convert.log'}")
    os.replace(tmp, gguf)
