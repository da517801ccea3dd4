"""benchmarks/plan_survey.py in its `--tiny` mode (tiny widths, one round): every cell has a winner among its
timed methods, and the summary's counts are those of the cells (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "plan_survey.py"


@pytest.fixture(scope="module")
def survey(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("plan-survey")
    json_path, text_path = out / "survey.json", out / "survey.txt"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--rounds", "1", "--attempts", "1", "--max-wait", "0",
           "--families", "granite-4.0-h-tiny,qwen3-next", "--dtypes", "float32,bfloat16",
           "--quantizations", "none,int8,int4", "--out-json", str(json_path), "--out-text", str(text_path),
           "--workdir", str(out), "--log-level", "WARNING"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert text_path.read_text().startswith("plan survey:")
    return json.loads(json_path.read_text())


def test_every_configuration_is_measured(survey: dict) -> None:
    measured = {(c["family"], c["dtype"], c["quantization"]) for c in survey["configs"] if "skipped" not in c}
    assert len(survey["configs"]) == 2 * 2 * 3
    assert {(c["family"], c["dtype"], c["quantization"]) for c in survey["cells"]} == measured
    for conf in survey["configs"]:
        if "skipped" not in conf:
            mine = [c for c in survey["cells"] if (c["family"], c["dtype"], c["quantization"])
                    == (conf["family"], conf["dtype"], conf["quantization"])]
            assert len(mine) == conf["cells"] > 0
    assert {c["storage"] for c in survey["cells"]} == {"dense", "int8", "int4"}


def test_every_cell_has_its_fastest_method_as_winner(survey: dict) -> None:
    for cell in survey["cells"]:
        seconds = cell["seconds"]
        assert seconds and all(s > 0 for s in seconds.values()), cell
        assert cell["winner"] == min(seconds, key=seconds.get), cell
        assert cell["winner"] in cell["near"] and set(cell["near"]) <= set(seconds), cell
        assert cell["plan"] in seconds or cell["plan"].startswith("dequant_"), cell


def test_the_summary_counts_match_the_cells(survey: dict) -> None:
    cells, summary = survey["cells"], survey["summary"]
    per = summary["methods"]
    assert set(per) == set(survey["meta"]["candidates"])
    assert sum(n["wins"] for n in per.values()) == len(cells)
    for name, n in per.items():
        assert n["timed"] == sum(name in c["seconds"] for c in cells)
        assert n["wins"] == sum(c["winner"] == name for c in cells)
        assert n["near"] == sum(name in c["near"] for c in cells)
        assert n["plan"] == sum(c["plan"] == name for c in cells)
        assert n["wins"] <= n["near"] <= n["timed"]
    assert set(summary["never_win"]) == {m for m, n in per.items() if n["timed"] and not n["wins"]}
    assert set(summary["never_timed"]) == {m for m, n in per.items() if not n["timed"]}
    for method, others in summary["covered_by"].items():
        for other in others:
            assert all(other in c["seconds"] and c["seconds"][other] <= c["seconds"][method] * 1.03
                       for c in cells if method in c["seconds"])


def test_help_names_the_flags() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for flag in ("--families", "--dtypes", "--quantizations", "--rounds", "--out-json", "--tiny"):
        assert flag in done.stdout
