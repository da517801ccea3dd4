"""bench_serving's load sweeps against the fake server: the JSON document, and a figure whose lines
carry exactly that document's numbers (read back from the matplotlib Figure and from the PNG file)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from benchmarks.bench_plots import PEER_TTFTS, peer_levels, plot_peers, plot_sweep, save_figure
from benchmarks.bench_serving import main
from tests.bench.fake_server import FakeServer

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.timeout(120)

FLAGS = ["--num-prompts", "6", "--input-len", "8", "--output-len", "5", "--disable-tqdm"]


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file; fails unless it starts with the PNG signature and an IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def _sweep(server: FakeServer, tmp_path: Path, *flags: str, data: Path | None = None) -> tuple[dict, Path]:
    """Run a sweep plotting to tmp_path/sweep.png; its JSON document (read from `data`, by default
    beside the plot) and the plot's path."""
    server.reset(0)
    png = tmp_path / "sweep.png"
    assert main(["--base-url", server.base_url, *FLAGS, "--plot", str(png), *flags]) == 0
    server.check_integrity()
    doc = json.loads((data or png.with_suffix(".json")).read_text())
    return doc, png


def _lines(ax) -> dict[str, list[tuple[float, float]]]:  # noqa: ANN001
    return {line.get_label(): [tuple(map(float, xy)) for xy in line.get_xydata()] for line in ax.get_lines()}


def _expected(points: list[dict], key: str, stat: str | None) -> list[float]:
    """The plotted (x, y) pairs of `key`, flattened to x0, y0, x1, y1, ... (pytest.approx compares flat lists)."""
    return [v for p in points for v in (float(p["load"]), float(p[key] if stat is None else p[key][stat]))]


def _flat(xy: list[tuple[float, float]]) -> list[float]:
    return [v for pair in xy for v in pair]


def test_concurrency_sweep_of_two_targets_plots_the_json(server: FakeServer, tmp_path: Path) -> None:
    targets = ["--target", f"gen=hyssm@{server.base_url}", "--target", f"oai=openai@{server.base_url}"]
    doc, png = _sweep(server, tmp_path, "--sweep-concurrency", "1,2,4", *targets)
    assert doc["sweep"] == "concurrency" and doc["levels"] == [1, 2, 4]
    assert [t["label"] for t in doc["targets"]] == ["gen", "oai"]
    endpoints = [s.endpoint for s in server.state.seen]
    assert endpoints == ["generate"] * 18 + ["openai"] * 18  # 3 levels x 6 requests, target after target
    for t in doc["targets"]:
        assert [p["load"] for p in t["points"]] == [1, 2, 4]
        assert all(p["completed"] == 6 and p["failed"] == 0 and p["output_token_throughput"] > 0 for p in t["points"])
    width, height = _png_size(png)
    assert width > 400 and height > 100

    fig = plot_sweep(doc)
    tps, ttft, itl = fig.axes
    for t in doc["targets"]:
        pts, label = t["points"], t["label"]
        assert _flat(_lines(tps)[label]) == pytest.approx(_expected(pts, "output_token_throughput", None))
        assert _flat(_lines(ttft)[f"{label} p50"]) == pytest.approx(_expected(pts, "ttft_ms", "median"))
        assert _flat(_lines(ttft)[f"{label} p99"]) == pytest.approx(_expected(pts, "ttft_ms", "p99"))
        assert _flat(_lines(itl)[f"{label} p50"]) == pytest.approx(_expected(pts, "itl_ms", "median"))
        assert _flat(_lines(itl)[f"{label} p99"]) == pytest.approx(_expected(pts, "itl_ms", "p99"))
    assert len(tps.get_lines()) == 2 and len(ttft.get_lines()) == 4 and len(itl.get_lines()) == 4

    # the PNG on disk is this figure: drawn again from the JSON, it decodes to the same pixels
    import matplotlib.image as mpimg

    again = tmp_path / "again.png"
    save_figure(fig, again)
    assert (mpimg.imread(png) == mpimg.imread(again)).all()


def test_rate_sweep_of_the_configured_server(server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "data" / "rate.json"
    doc, _ = _sweep(server, tmp_path, "--backend", "openai", "--sweep-rate", "40,400", "--out-json", str(out), data=out)
    assert not (tmp_path / "sweep.json").exists()
    assert doc["sweep"] == "rate" and doc["levels"] == [40.0, 400.0]
    (target,) = doc["targets"]
    assert target["label"] == "openai" and target["backend"] == "openai"
    assert [p["completed"] for p in target["points"]] == [6, 6]
    tps = plot_sweep(doc).axes[0]
    assert tps.get_xlabel().startswith("request rate")
    assert _flat(_lines(tps)["openai"]) == pytest.approx(_expected(target["points"], "output_token_throughput", None))


@pytest.mark.parametrize("flags", [
    ["--sweep-concurrency", "1,2", "--sweep-rate", "1"],
    ["--sweep-concurrency", "1,x"],
    ["--sweep-concurrency", "0,2"],
    ["--sweep-rate", "inf"],
    ["--sweep-rate", "1", "--target", "no-backend-or-url"],
    ["--sweep-rate", "1", "--target", "x=vllm@http://h"],
    ["--plot", "x.png"],
])  # fmt: skip
def test_bad_sweep_flags_exit_2(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--base-url", "http://127.0.0.1:9", *flags])
    assert exc.value.code == 2


def test_peers_figure_draws_the_medians(tmp_path: Path) -> None:
    medians = {
        "hyssm": {"tps_c1": 50.0, "tps_c8": 300.0, "tps_c32": 900.0, "ttft_cold_ms": 12.0, "ttft_prefix_ms": 3.0,
                  "ttft_shared_ms": 4.0, "decode_ms": 9.0, "peak_rss_mib": 700.0},
        "llama.cpp": {"tps_c1": 60.0, "tps_c8": None, "tps_c32": 500.0, "ttft_cold_ms": 10.0, "ttft_prefix_ms": None,
                      "ttft_shared_ms": 8.0, "decode_ms": 8.0, "peak_rss_mib": math.nan},
    }  # fmt: skip
    assert peer_levels(medians) == [1, 8, 32]
    fig = plot_peers(medians)
    tps, ttft, decode, rss = fig.axes
    assert _lines(tps) == {"hyssm": [(1.0, 50.0), (8.0, 300.0), (32.0, 900.0)],
                           "llama.cpp": [(1.0, 60.0), (32.0, 500.0)]}  # fmt: skip
    by_system = {c.get_label(): [b.get_height() for b in c] for c in ttft.containers}
    assert by_system == {"hyssm": [12.0, 3.0, 4.0], "llama.cpp": [10.0, 8.0]}
    assert [t.get_text() for t in ttft.get_xticklabels()] == [label for _, label in PEER_TTFTS]
    assert {c.get_label(): [b.get_height() for b in c] for c in decode.containers} == {"hyssm": [9.0],
                                                                                       "llama.cpp": [8.0]}
    assert {c.get_label(): [b.get_height() for b in c] for c in rss.containers} == {"hyssm": [700.0], "llama.cpp": []}
    png = tmp_path / "peers.png"
    save_figure(fig, png)
    assert _png_size(png)[0] > 400
