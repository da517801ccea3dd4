"""Pre-quantized checkpoints at start-up: an unsupported quantization method, and `--quantization`
naming another format than the checkpoint's, each exit non-zero with one line naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.server import ROOT, free_port
from tests.fixtures.make_prequant import write_fp8_block
from tests.worker.util import fixture_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _launch(args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "launch.py", "--device", "cpu", "--port", str(free_port()), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, start_new_session=True)


def _one_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0 and len(lines) == 1, res.stderr
    return lines[0]


def test_an_unsupported_quantization_method_fails_with_one_line(tmp_path) -> None:
    with open(os.path.join(fixture_dir("rope_moe"), "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gguf"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    line = _one_line(_launch(["--model-path", str(tmp_path)]))
    assert "quant_method 'gguf' is not supported" in line


def test_quantization_flag_naming_another_format_fails_with_one_line(tmp_path) -> None:
    path = write_fp8_block("rope_moe", str(tmp_path / "fp8"))
    line = _one_line(_launch(["--model-path", path, "--quantization", "int8"]))
    assert "--quantization int8 would re-quantize" in line
