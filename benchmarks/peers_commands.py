"""bench_peers' configuration and the command lines of the systems it compares (pure: nothing is started).

Every system runs the checkpoint in the one --dtype (DTYPES):
- hyssm: ``launch.py --model-path MODEL --dtype DTYPE`` on a loopback port;
- llama.cpp: ``llama-server -m MODEL.TYPE.gguf``, TYPE = GGUF_TYPES[DTYPE] (f32, bf16), the type the
  checkpoint is converted to and a part of the cached file's name (peers_gguf), so both coexist;
  ``--parallel`` = the highest concurrency level, ``-c`` (its KV cache in tokens, split evenly over the
  slots) by ``--llama-ctx`` (`llama_context`): ``hyssm`` (the default) = hyssm's KV pool as that server
  reports it, so both hold the same number of tokens in memory; ``workload`` = just what the prompts
  need; a number = that many tokens. It is raised, and the report says so, where it would not give
  every slot room for the longest prompt plus its output;
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
    llama_ctx: str = "hyssm"  # llama-server -c: "hyssm" (its KV pool), "workload" or a token count
    settle_quiet_s: float = 0.5  # before a measured TTFT: the server idle this long (peers_settle)
    settle_timeout_s: float = 120.0
    settle_cpu: float = 0.25  # cores the server's processes may use in that quiet window

    def __post_init__(self) -> None:
        if self.dtype not in GGUF_TYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization and self.quantization not in QUANTIZED_GGUF:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZED_GGUF)}, got {self.quantization!r}")
        if self.llama_ctx not in ("hyssm", "workload") and not (self.llama_ctx.isdigit() and int(self.llama_ctx) > 0):
            raise ValueError(f"--llama-ctx must be hyssm, workload or a positive token count, got {self.llama_ctx!r}")
        if self.settle_quiet_s < 0 or self.settle_cpu < 0 or self.settle_timeout_s <= 0:
            raise ValueError("--settle-quiet and --settle-cpu must be >= 0, --settle-timeout > 0")

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


def slot_tokens(cfg: PeersConfig) -> int:
    """What one llama-server slot must hold: the longest prompt plus its output."""
    return max(cfg.input_len, cfg.prefix_len + cfg.suffix_len) + cfg.output_len


def llama_context(cfg: PeersConfig, hyssm_kv_tokens: int | None) -> tuple[int, str]:
    """llama-server's -c for `cfg.llama_ctx` (see the module docstring) and a phrase saying how it was
    sized. `hyssm_kv_tokens`: hyssm's KV pool as its server reported it (None: not known)."""
    parallel = max(cfg.levels)
    workload = parallel * 1024 * max(1, -(-slot_tokens(cfg) // 1024))  # whole KiB per slot
    if cfg.llama_ctx == "workload":
        ctx, how = workload, "sized for the workload (--llama-ctx workload)"
    elif cfg.llama_ctx == "hyssm" and hyssm_kv_tokens:
        ctx, how = hyssm_kv_tokens, "hyssm's KV pool"
    elif cfg.llama_ctx == "hyssm":
        ctx, how = workload, "sized for the workload: hyssm's KV pool is unknown (its server did not start or say)"
    else:
        ctx, how = int(cfg.llama_ctx), "--llama-ctx"
    need = parallel * slot_tokens(cfg)
    if ctx < need:
        how += f", raised from {ctx} so that each of the {parallel} slots holds {slot_tokens(cfg)} tokens"
        ctx = need
    return ctx, how


def llama_command(cfg: PeersConfig, binary: str, gguf: Path, port: int, ctx: int | None = None) -> list[str]:
    """llama-server on `gguf` (cfg.gguf_type) at 127.0.0.1:`port`: one slot per request of the highest
    level, a KV cache of `ctx` tokens in all (default: `llama_context` without hyssm's pool), and
    /metrics on (what peers_settle reads)."""
    ctx = llama_context(cfg, None)[0] if ctx is None else ctx
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(max(cfg.levels)),
            "--threads", str(cfg.threads), "-c", str(ctx), "--no-webui", "--metrics"]  # fmt: skip


def hyssm_config_line(cfg: PeersConfig, pools: dict[str, int] | None) -> str:
    """hyssm's configuration for the report: its flags and the pools its server reported."""
    flags = " ".join(hyssm_command(cfg, 0)[2:]).replace(" --host 127.0.0.1 --port 0", "")
    if pools:
        sizes = (f"KV pool {pools.get('kv_tokens', '?')} token slots shared by all requests, "
                 f"{pools.get('state_slots', '?')} recurrent-state slots (requests, cached prefixes, checkpoints)")
    else:
        sizes = "pools not read (the server did not start)"
    return f"hyssm: launch.py {flags}; {sizes}"


def llama_config_line(cfg: PeersConfig, ctx: int, how: str) -> str:
    """llama-server's configuration for the report: slots, context (and how it was sized), cache type."""
    parallel = max(cfg.levels)
    return (f"llama.cpp: llama-server {cfg.gguf_type} GGUF --parallel {parallel} -c {ctx} ({how}): {ctx // parallel} "
            f"KV tokens per slot, one recurrent state per slot ({parallel}), KV cache type llama.cpp's default (f16)")


def transformers_job(runs: list[dict[str, object]], cfg: PeersConfig) -> dict[str, object]:
    """peers_transformers.py's job: the model, dtype, threads, output length, the warm-up prompt, the
    settle rule and each run's prompts."""
    return {
        "model": cfg.model,
        "dtype": cfg.dtype,
        "threads": cfg.threads,
        "output_len": cfg.output_len,
        "warmup": runs[0]["warmup"][0],  # type: ignore[index]  # one prompt
        "settle": {"quiet_s": cfg.settle_quiet_s, "timeout_s": cfg.settle_timeout_s, "max_cpu": cfg.settle_cpu},
        "runs": [{k: r[k] for k in ("throughput", "cold", "prefix", "shared")} for r in runs],
    }
