"""benchmarks/bench_products.py times every method the plan may time for a shape and storage (no timing
asserted) and names a malformed shape."""

from __future__ import annotations

import pytest

from benchmarks import bench_products
from worker_proc.kernels import native


@pytest.mark.parametrize(("storage", "expected"), [("int8", {"w8a8", "w8a16"}), ("dense", {"dense", "packed"}),
                                                   ("int4", {"w4a16"})])
def test_the_table_has_every_supported_method_at_every_row_count(capsys: pytest.CaptureFixture[str], storage: str,
                                                                 expected: set[str]) -> None:
    if native.load():
        expected |= {"int8": {"gemv_w8a8", "tiled_w8a8"}, "dense": {"tiled", "gemv_seq"},
                     "int4": {"tiled_over_int4"}}[storage]
    bench_products.main(["--shapes", "64x64,48x128", "--storage", storage, "--rows", "1,9", "--threads", "1",
                         "--stream-mb", "1", "--runs", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{storage} weights, bfloat16 activations, 1 threads")
    rows = [[cell.strip() for cell in line.split("|")] for line in lines[2:]]
    for shape in ("64x64", "48x128"):
        for r in ("1", "9"):
            methods = {row[1] for row in rows if row[0] == shape and row[2] == r}
            assert expected <= methods, (shape, r, methods)
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in rows)


def test_methods_can_be_named(capsys: pytest.CaptureFixture[str]) -> None:
    bench_products.main(["--shapes", "64x64", "--storage", "int8", "--rows", "2", "--threads", "1", "--stream-mb", "1",
                         "--runs", "1", "--methods", "w8a8,w8a16"])
    rows = [[cell.strip() for cell in line.split("|")] for line in capsys.readouterr().out.splitlines()[2:]]
    assert sorted(row[1] for row in rows) == ["w8a16", "w8a8"]


@pytest.mark.parametrize(("argv", "named"), [(["--shapes", "64by64"], "'64by64'"),
                                             (["--methods", "w8a8,fastest"], "no method named fastest")])
def test_bad_arguments_are_named(capsys: pytest.CaptureFixture[str], argv: list[str], named: str) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_products.main(argv)
    assert exc.value.code == 2 and named in capsys.readouterr().err
