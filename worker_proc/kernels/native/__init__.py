"""The fused CPU kernels of the recurrent layers (`scan_ops.cpp`, `norm_ops.cpp`, `cpu_common.h`), compiled
once per machine and loaded as `torch.ops.hyssm_cpu`.

Owns the build: the library is compiled with torch's extension builder for this machine's CPU into a
directory named by a digest of the source, the torch version, the compiler flags and the CPU's model
and ISA flags (`$XDG_CACHE_HOME/hyssm/kernels/<digest>`, `~/.cache/...` by default), so a later start,
or another process of the same launch, loads it without compiling.

Rules: a build happens under an flock on `build.lock` in that directory, which the kernel releases
however its holder ends (SIGKILL included), and a `built` marker is written only after the library
linked. A process that finds the marker loads the library without the builder; one that does not takes
the flock and, before building, removes the builder's own lock file, which a builder killed mid-build
leaves behind and which would otherwise make every later load wait for ever. A machine without a
working C++ toolchain gets False from `load` with the reason in `load_error()`; the kernel selection
then runs the pure-torch `FastOps` and says why.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

from worker_proc.kernels.native.layout import LAYOUT, defines

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
LIBRARY = "hyssm_cpu_ops"
BUILT_MARKER = "built"
BUILDER_LOCK = "lock"  # the file torch's extension builder waits on while it exists
SOURCES = tuple(sorted(HERE.glob("*.cpp")))
HEADERS = tuple(sorted(HERE.glob("*.h")))
NATIVE_ARCH = "native"
"""What the library is compiled for where it runs: this machine's CPU and every ISA extension it has.
The sources hold no path that needs one extension only: each has a portable form (see cpu_common.h),
and `compile_library` builds them for any other `-march` (tests build the baseline x86-64 levels)."""


def cflags(arch: str = NATIVE_ARCH) -> tuple[str, ...]:
    """The compiler flags of a build for `-march=arch` (the layout constants among them, `layout.defines`)."""
    wide = ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
    return ("-O3", f"-march={arch}", "-fopenmp", "-ffp-contract=fast", *wide, *defines())


def check_layout() -> None:
    """The loaded library's layout constants are `layout.LAYOUT` (a build made with others is refused)."""
    built = list(torch.ops.hyssm_cpu.layout())
    if built != list(LAYOUT.values()):
        raise RuntimeError(f"the loaded kernels were built with layout {built}, not {list(LAYOUT.values())}")


def _cpu_identity() -> str:
    """The CPU model and ISA flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', '')}|{fields.get('flags', '')}"


def build_digest() -> str:
    """What the compiled library depends on, hashed."""
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        h.update(path.name.encode() + path.read_bytes())
    for part in (torch.__version__, " ".join(cflags()), _cpu_identity(), platform.machine()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hyssm" / "kernels" / build_digest()


def compile_library(target: Path, arch: str = NATIVE_ARCH) -> Path:
    """Compile the library for `-march=arch` into `target`, load it into this process (which holds one
    build of `torch.ops.hyssm_cpu`) and return its path."""
    from torch.utils import cpp_extension  # needs setuptools, which a bare environment may lack

    (target / BUILDER_LOCK).unlink(missing_ok=True)
    cpp_extension.load(name=LIBRARY, sources=[str(p) for p in SOURCES], extra_cflags=list(cflags(arch)),
                       extra_ldflags=["-fopenmp"], build_directory=str(target), is_python_module=False,
                       verbose=False)  # fmt: skip
    return target / f"{LIBRARY}.so"


def _build(target: Path) -> None:
    """Compile and load the library into `target`; the caller holds the build flock."""
    (target / BUILT_MARKER).unlink(missing_ok=True)
    compile_library(target)
    (target / BUILT_MARKER).write_text(f"{LIBRARY}.so\n")


def _load_into(target: Path) -> None:
    """Load the built library, building it first when no finished build is there."""
    library = target / f"{LIBRARY}.so"
    if (target / BUILT_MARKER).exists() and library.exists():
        torch.ops.load_library(str(library))
        check_layout()
        return
    with open(target / "build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / BUILT_MARKER).exists() and library.exists():  # another process built it meanwhile
            torch.ops.load_library(str(library))
            check_layout()
            return
        logger.info("compiling the fused CPU kernels for this machine into %s (once; seconds)", target)
        start = time.perf_counter()
        _build(target)
        check_layout()
        logger.info("fused CPU kernels compiled in %.1f s", time.perf_counter() - start)


@functools.cache
def _load() -> tuple[bool, str]:
    target = build_dir()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        logger.warning("the fused CPU kernels cannot be built in %s (%s): the pure-torch kernels run", target, exc)
        return False, f"{target}: {exc}"
    try:
        _load_into(target)
    except Exception as exc:  # a missing compiler or ninja, a failed build: the pure-torch kernels run
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        logger.warning("the fused CPU kernels could not be built (%s): the pure-torch kernels run", reason)
        return False, reason
    return True, ""


def load() -> bool:
    """Whether `torch.ops.hyssm_cpu` is available (built or read from the cache on first call)."""
    return _load()[0]


def load_error() -> str:
    """Why `load()` failed ("" when it did not)."""
    return _load()[1]
