"""The LoRA flags (SGLang's names): parsing, the values they become in ServerArgs, and the one-line errors
(bad values from ServerArgs, bad adapters from the launch's preflight check)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import hyssm.serve as launch
from shared.config import ConfigError, ServerArgs
from tests.fixtures.lora_adapter import write_adapter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_are_sglangs() -> None:
    args = launch.parse_args([])
    assert (args.enable_lora, args.lora_paths, args.max_loras_per_batch, args.max_lora_rank) == (False, (), 8, 64)


def test_lora_paths_take_several_values_and_imply_enable_lora() -> None:
    args = launch.parse_args(["--lora-paths", "sql=/adapters/sql", "/adapters/chat/", "--max-loras-per-batch", "2",
                              "--max-lora-rank", "16"])  # fmt: skip
    assert args.enable_lora
    assert args.lora_paths == ("sql=/adapters/sql", "chat=/adapters/chat/")
    assert args.lora_path_map() == {"sql": "/adapters/sql", "chat": "/adapters/chat/"}
    assert (args.max_loras_per_batch, args.max_lora_rank) == (2, 16)
    assert ServerArgs.from_bytes(args.to_bytes()) == args  # what every child process gets
    assert launch.parse_args(["--enable-lora"]).enable_lora and not launch.parse_args(["--enable-lora"]).lora_paths


def test_adapter_limits_without_enable_lora_are_accepted_as_sglang_does() -> None:
    args = launch.parse_args(["--max-loras-per-batch", "4", "--max-lora-rank", "32"])
    assert not args.enable_lora and args.max_loras_per_batch == 4


def _launch(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """launch.py as a user runs it (its own process: the launch sets up the process's logging)."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), *argv], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip


@pytest.mark.parametrize("argv,message", [
    (["--max-loras-per-batch", "0"], "--max-loras-per-batch must be a positive integer, got 0"),
    (["--max-lora-rank", "-1"], "--max-lora-rank must be a positive integer, got -1"),
    (["--lora-paths", "a=/x", "a=/y"], "--lora-paths names the adapter 'a' twice"),
    (["--lora-paths", "a="], "--lora-paths: 'a=' names no path"),
    (["--lora-paths", "=/x"], "the adapter name '' must be"),
    (["--lora-paths", "bad name=/x"], "the adapter name 'bad name' must be"),
])
def test_bad_values_are_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        launch.parse_args(argv)
    proc = _launch(argv)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_a_bad_adapter_fails_the_preflight_check_in_one_line(tmp_path) -> None:
    big = write_adapter(str(tmp_path / "big"), rank=128)
    for argv, message in [(["--lora-paths", f"big={big}"], "rank 128 exceeds --max-lora-rank 64"),
                          (["--lora-paths", str(tmp_path / "nothing")], "is not a directory")]:
        proc = _launch(argv)
        err = proc.stderr
        assert proc.returncode == 2 and err.count("\n") == 1 and "--lora-paths" in err and message in err, err
    assert os.path.isdir(big)
