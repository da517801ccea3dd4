"""benchmarks/device_check.sh without a GPU: its syntax, its dry run (every step has a function, the
limits fit the 8-minute budget, the CUDA tests are found) and the flags it passes to the repo's tools."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
PARTS = ROOT / "benchmarks" / "device_check"  # the parts SCRIPT sources
BUDGET_S = 480

STEP_LINE = re.compile(r"^\s+(\d\d) (\S+)\s+(\d+) s$")
TOTAL_LINE = re.compile(r"^total: (\d+) s with (\d+) s kill grace per step \(budget (\d+) s\): (OK|OVER BUDGET)$")


def _dry_run(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=60)


def test_syntax() -> None:
    for script in (SCRIPT, *sorted(PARTS.glob("*.sh"))):
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr


def test_dry_run_lists_every_step_within_the_budget() -> None:
    proc = _dry_run(SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    steps = [(m[2], int(m[3])) for m in map(STEP_LINE.match, lines) if m]
    names = [name for name, _ in steps]
    assert {"nvidia-smi", "fla-core", "env", "pytest-cuda", "pytest-kernels", "kernel-parity", "bench-kernels",
            "make-model", "bench-step-builtin", "bench-step-350m", "e2e"} <= set(names)  # fmt: skip
    assert len(names) == len(set(names))
    totals = [m for m in map(TOTAL_LINE.match, lines) if m]
    assert len(totals) == 1
    total, grace, budget, verdict = int(totals[0][1]), int(totals[0][2]), int(totals[0][3]), totals[0][4]
    assert budget == BUDGET_S and verdict == "OK"
    assert total == sum(limit + grace for _, limit in steps) < BUDGET_S
    assert "fla-core" in names and dict(steps)["fla-core"] <= 60  # the fla-core install is capped at 60 s
    cuda_tests = lines[lines.index("CUDA tests (step pytest-cuda):") + 1 : lines.index(totals[0][0])]
    cuda_tests = [t.strip() for t in cuda_tests]
    assert "tests/kernels/test_gated_delta.py" in cuda_tests  # holds the fla-on-CUDA test and its skip reason
    assert all((ROOT / t.split("::")[0]).is_file() for t in cuda_tests), cuda_tests


def test_dry_run_fails_over_budget(tmp_path: Path) -> None:
    text = SCRIPT.read_text()
    first = re.search(r'^    "([a-z0-9-]+) (\d+)"$', text, flags=re.M)
    assert first, "no step entry found in STEPS"
    copy = tmp_path / "benchmarks" / "device_check.sh"
    copy.parent.mkdir()
    shutil.copytree(PARTS, copy.parent / PARTS.name)
    copy.write_text(text[: first.start(2)] + str(BUDGET_S) + text[first.end(2) :])
    proc = _dry_run(copy)
    assert proc.returncode == 1 and "OVER BUDGET" in proc.stdout, proc.stdout + proc.stderr


def _invocations() -> list[tuple[str, set[str]]]:
    """(tool path, flags) of every `"$PY" benchmarks/X.py ...` / `"$PY" launch.py ...` in the script."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    found = []
    for m in re.finditer(r'"\$PY" ((?:benchmarks/\w+|launch)\.py)([^\n]*)', text):
        found.append((m[1], set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m[2]))))
    return found


def _argparse_flags(path: Path) -> set[str]:
    """The option strings given to `add_argument` in a tool's source (no import: no torch needed)."""
    flags = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def test_every_flag_it_passes_exists() -> None:
    calls = _invocations()
    tools = {tool for tool, _ in calls}
    assert {"benchmarks/bench_kernels.py", "benchmarks/bench_step.py", "benchmarks/make_bench_model.py",
            "launch.py"} <= tools  # fmt: skip
    for tool, flags in calls:
        if tool == "launch.py":  # options generated from ServerArgs: ask the parser
            proc = subprocess.run([sys.executable, "launch.py", "--help"], cwd=ROOT, capture_output=True,
                                  text=True, timeout=60)  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            known = set(re.findall(r"--[a-z][a-z0-9-]*", proc.stdout))
        else:
            known = _argparse_flags(ROOT / tool)
        assert flags <= known, f"{tool}: {sorted(flags - known)} not among its options"
    assert any(tool == "benchmarks/bench_step.py" and "--device" in flags for tool, flags in calls)
    assert all("--device" in flags for tool, flags in calls if tool in ("launch.py", "benchmarks/bench_kernels.py"))


def test_help_runs_nothing() -> None:
    proc = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "--dry-run" in proc.stdout
