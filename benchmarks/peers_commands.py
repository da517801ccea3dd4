"""bench_peers' configuration and the command lines of the systems it compares (pure: nothing is started).

Every system runs the checkpoint in the one --dtype (DTYPES):
- hyssm: ``launch.py --model-path MODEL --dtype DTYPE`` on a loopback port;
- llama.cpp: ``llama-server -m MODEL.TYPE.gguf``, TYPE = GGUF_TYPES[DTYPE] (f32, bf16), the type the
  checkpoint is converted to and a part of the cached file's name (peers_gguf), so both coexist;
- transformers: peers_transformers.py's job carries DTYPE (``from_pretrained(..., dtype=DTYPE)``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PEERS_SCRIPT = REPO.parent / "shared" / "peers" / "llama-server.sh"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}  # --dtype -> llama-server.sh convert's output type
DTYPES = tuple(GGUF_TYPES)
QUANTIZED_GGUF = {"int8": "q8_0", "int4": "Q4_K_M"}
"""--quantization -> the llama.cpp file users run for it: Q8_0 (written by the converter) and Q4_K_M
(llama-quantize over the f32 file)."""


@dataclasses.dataclass(frozen=True)
class PeersConfig:
    """One bench_peers invocation; `dtype` must be one of DTYPES (ValueError otherwise)."""

    model: str
    runs: int = 3
    dtype: str = "float32"
    skip_llama: bool = False
    skip_transformers: bool = False
    sequential: bool = False  # one server at a time, all its runs (else both up, runs alternating)
    llama_server: str | None = None
    hyssm_args: tuple[str, ...] = ()
    peers_script: str = str(DEFAULT_PEERS_SCRIPT)
    threads: int = os.cpu_count() or 1
    levels: tuple[int, ...] = (1, 8, 32)
    input_len: int = 128
    output_len: int = 32
    prefix_len: int = 512
    suffix_len: int = 32
    seed: int = 0
    ready_timeout_s: float = 900.0
    request_timeout_s: float = 3600.0
    output_json: str | None = None
    plot: str | None = None  # PNG of the medians (bench_plots.plot_peers)
    log_dir: str | None = None
    quantization: str = ""  # "" or a key of QUANTIZED_GGUF: hyssm --quantization, llama.cpp's matching file

    def __post_init__(self) -> None:
        if self.dtype not in GGUF_TYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization and self.quantization not in QUANTIZED_GGUF:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZED_GGUF)}, got {self.quantization!r}")

    @property
    def gguf_type(self) -> str:
        """The GGUF type llama.cpp gets for `dtype` (and `quantization`)."""
        return QUANTIZED_GGUF[self.quantization] if self.quantization else GGUF_TYPES[self.dtype]

    @property
    def weights(self) -> str:
        """The weights every system runs, for the table's title."""
        return f"{self.quantization} weights ({self.dtype} activations)" if self.quantization else self.dtype


def default_llama_server(script: str) -> Path | None:
    """Where ``llama-server.sh build`` puts the binary (its ROOT/VER rule), without building it."""
    try:
        text = Path(script).read_text()
    except OSError:
        return None
    ver = re.search(r"^VER=(\S+)", text, re.M)
    if ver is None:
        return None
    root = Path(os.environ.get("HYSSM_PEERS", Path.home() / ".cache" / "hyssm-peers"))  # the script's own rule
    return root / f"llama_cpp_python-{ver.group(1)}" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"


def hyssm_command(cfg: PeersConfig, port: int) -> list[str]:
    """launch.py on 127.0.0.1:`port` in cfg.dtype, admitting at least the highest concurrency level."""
    quant = ("--quantization", cfg.quantization) if cfg.quantization else ()
    return [sys.executable, str(REPO / "launch.py"), "--model-path", cfg.model, "--dtype", cfg.dtype, *quant,
            "--host", "127.0.0.1", "--port", str(port), "--max-running-requests", str(max(64, *cfg.levels)),
            *cfg.hyssm_args]  # fmt: skip


def llama_command(cfg: PeersConfig, binary: str, gguf: Path, port: int) -> list[str]:
    """llama-server on `gguf` (cfg.gguf_type) at 127.0.0.1:`port`: one slot per request of the highest
    level, each with a context of whole KiB that holds the longest prompt plus its output."""
    longest = max(cfg.input_len, cfg.prefix_len + cfg.suffix_len) + cfg.output_len
    ctx = max(cfg.levels) * 1024 * max(1, -(-longest // 1024))
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(max(cfg.levels)),
            "--threads", str(cfg.threads), "-c", str(ctx), "--no-webui"]  # fmt: skip


def transformers_job(runs: list[dict[str, object]], cfg: PeersConfig) -> dict[str, object]:
    """peers_transformers.py's job: the model, dtype, threads, output length and each run's prompts."""
    return {
        "model": cfg.model,
        "dtype": cfg.dtype,
        "threads": cfg.threads,
        "output_len": cfg.output_len,
        "runs": [{k: r[k] for k in ("throughput", "cold", "prefix", "shared")} for r in runs],
    }
