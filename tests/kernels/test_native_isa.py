"""The fused CPU kernels build and agree with the reference on CPUs with fewer ISA extensions than this
one: each x86-64 level is compiled (`native.compile_library`) and the kernel tests run against that
build in a fresh process (`tests.isa_library`). A build that needs an extension the level lacks (a
bfloat16 pair product on AVX-512 without AVX512-BF16, say) fails here, where it would otherwise leave
such a machine on the slower pure-torch kernels."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from worker_proc.kernels import native

REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ("tests/kernels/test_native.py", "tests/kernels/test_native_gemv.py",
                "tests/kernels/test_native_w4a8.py", "tests/kernels/test_native_lora.py",
                "tests/kernels/test_native_kda.py")
LEVELS = {  # -march level: the CPU flags its code may execute
    "x86-64-v3": {"avx2", "fma", "bmi2", "f16c", "movbe"},  # AVX2: Haswell, Zen 1-3
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},  # no BF16: Skylake-SP to Ice Lake
}

pytestmark = pytest.mark.skipif(not native.load() or platform.machine() != "x86_64",
                                reason="no fused CPU kernels build here, or this is no x86-64 CPU")  # fmt: skip


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@pytest.mark.timeout(1260)  # a whole build and the kernel tests, each bounded by its subprocess's 600 s
@pytest.mark.parametrize("level", sorted(LEVELS))
def test_the_kernels_built_for_an_older_x86_64_level_agree_with_the_reference(tmp_path: Path, level: str) -> None:
    if not LEVELS[level] <= _cpu_flags():
        pytest.skip(f"this CPU cannot run {level} code")
    build = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; from worker_proc.kernels import native; "
         "print(native.compile_library(Path(sys.argv[1]), sys.argv[2]))", str(tmp_path), level],
        cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert build.returncode == 0, f"the {level} build failed:\n{build.stderr[-3000:]}"
    library = build.stdout.strip().splitlines()[-1]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.isa_library", "--native-library", library,
         "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    assert f"fused CPU kernels: {library}" in run.stdout
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-1000:]
