"""bench_peers' --dtype and --quantization: the type every command gets (hyssm's flags, llama.cpp's GGUF
of that type, transformers' job), transformers loading the model in the job's dtype, and llama-server's
context holding the longest prompt of every slot."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from benchmarks import bench_peers
from benchmarks.bench_peers import PeersConfig, ServerSpec, benchmark
from tests.bench.peers_helpers import BUILTIN

pytestmark = pytest.mark.timeout(120)


FAKE_TYPED_CONVERT = """#!/bin/bash
set -euo pipefail
[ "$1" = convert ]
echo "$4" >> {rec}
echo "gguf $4" > "$3"
"""


class _FakeTransformersProcess:
    """Stands in for ManagedProcess in run_transformers: records the job, answers in `answer_dtype`
    (None: the job's dtype)."""

    jobs: list[dict] = []
    answer_dtype: str | None = None

    def __init__(self, name: str, cmd: list[str], log_path: Path, cwd: str | None = None) -> None:
        assert name == "transformers" and cmd[1].endswith("peers_transformers.py")
        job = json.loads(Path(cmd[2]).read_text())
        self.jobs.append(job)
        runs = [{"tps_c1": 1.0} for _ in job["runs"]]
        Path(cmd[3]).write_text(json.dumps({"runs": runs, "dtype": self.answer_dtype or job["dtype"]}))
        self.peak_rss_bytes = 0

    def wait(self, timeout_s: float) -> int:
        return 0

    def stop(self) -> None:
        pass

    def log_tail(self) -> str:
        return ""


def test_dtype_reaches_every_command_and_the_gguf_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--dtype: hyssm's --dtype, llama-server's GGUF (converted to that type, cached under a name with
    the type, so both types coexist beside the model) and transformers' job; servers are not started."""
    model, rec, logs = tmp_path / "m", tmp_path / "converted", tmp_path / "logs"
    shutil.copytree(BUILTIN, model)
    logs.mkdir()
    script = tmp_path / "convert.sh"
    script.write_text(FAKE_TYPED_CONVERT.replace("{rec}", str(rec)))
    llama = tmp_path / "llama-server"
    llama.write_text("#!/bin/sh\n")
    llama.chmod(0o755)
    commands: list[tuple[str, list[str]]] = []

    def fake_run_servers(specs: list[ServerSpec], *args: object) -> tuple[dict[str, list], list[str]]:
        commands.extend((spec.name, spec.command({})) for spec in specs)
        return {spec.name: [{"tps_c1": 1.0}] for spec in specs}, []

    monkeypatch.setattr(bench_peers, "run_servers", fake_run_servers)
    monkeypatch.setattr(bench_peers, "transformers_skip_reason", lambda cfg: None)
    monkeypatch.setattr(bench_peers, "ManagedProcess", _FakeTransformersProcess)
    monkeypatch.setattr(_FakeTransformersProcess, "jobs", [])
    for dtype, typ in (("float32", "f32"), ("bfloat16", "bf16"), ("float32", "f32")):
        cfg = PeersConfig(model=str(model), runs=1, dtype=dtype, levels=(1,), input_len=4, output_len=2,
                          prefix_len=4, suffix_len=2, llama_server=str(llama), peers_script=str(script))  # fmt: skip
        commands.clear()
        medians, _, notes = benchmark(cfg, logs)
        assert set(medians) == {"hyssm", "llama.cpp", "transformers"}, notes
        cmds = dict(commands)
        hy = cmds["hyssm"]
        assert hy[hy.index("--dtype") + 1] == dtype and hy.count("--dtype") == 1
        gguf = Path(cmds["llama.cpp"][cmds["llama.cpp"].index("-m") + 1])
        assert gguf == tmp_path / f"m.{typ}.gguf" and gguf.read_text() == f"gguf {typ}\n"
        job = _FakeTransformersProcess.jobs[-1]
        assert job["dtype"] == dtype and job["settle"] == {"quiet_s": 0.5, "timeout_s": 120.0, "max_cpu": 0.25}
        assert len(job["warmup"]) == 4 and all(isinstance(t, int) for t in job["warmup"])  # one prompt of ids
    assert rec.read_text().split() == ["f32", "bf16"]  # each type converted once, then reused
    assert (tmp_path / "m.f32.gguf").is_file() and (tmp_path / "m.bf16.gguf").is_file()
    monkeypatch.setattr(_FakeTransformersProcess, "answer_dtype", "float32")
    _, _, notes = benchmark(dataclasses.replace(cfg, dtype="bfloat16"), logs)
    assert any(n.startswith("transformers: failed: transformers ran in float32, not bfloat16") for n in notes)


FAKE_QUANTIZE = """#!/bin/bash
set -euo pipefail
if [ "$1" = quantize-bin ]; then echo {quantize}; exit 0; fi
[ "$1" = convert ]
echo "$4" >> {rec}
echo "gguf $4" > "$3"
"""


def test_quantization_reaches_hyssm_and_picks_llamas_matching_file(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """--quantization int8: hyssm --quantization int8 against the converter's q8_0 file; int4: against
    llama-quantize's Q4_K_M made from the f32 file (each cached); transformers is skipped."""
    model, rec, logs = tmp_path / "m", tmp_path / "converted", tmp_path / "logs"
    shutil.copytree(BUILTIN, model)
    logs.mkdir()
    quantize = tmp_path / "llama-quantize"
    quantize.write_text('#!/bin/bash\necho "quantize $3" >> ' + str(rec) + '\necho "$3 of $(cat $1)" > "$2"\n')
    quantize.chmod(0o755)
    script = tmp_path / "peers.sh"
    script.write_text(FAKE_QUANTIZE.replace("{rec}", str(rec)).replace("{quantize}", str(quantize)))
    llama = tmp_path / "llama-server"
    llama.write_text("#!/bin/sh\n")
    llama.chmod(0o755)
    commands: dict[str, list[str]] = {}
    groups: list[list[str]] = []

    def fake_run_servers(specs: list[ServerSpec], *args: object) -> tuple[dict[str, list], list[str]]:
        commands.update((spec.name, spec.command({})) for spec in specs)
        groups.append([spec.name for spec in specs])
        return {spec.name: [{"tps_c1": 1.0}] for spec in specs}, []

    monkeypatch.setattr(bench_peers, "run_servers", fake_run_servers)
    q4 = ("int4", "m.Q4_K_M.gguf", "Q4_K_M of gguf f32\n")
    for quant, name, content in (("int8", "m.q8_0.gguf", "gguf q8_0\n"), q4, q4):
        cfg = PeersConfig(model=str(model), runs=1, quantization=quant, levels=(1,), input_len=4, output_len=2,
                          prefix_len=4, suffix_len=2, llama_server=str(llama), peers_script=str(script))  # fmt: skip
        medians, _, notes = benchmark(cfg, logs)
        assert set(medians) == {"hyssm", "llama.cpp"} and any("transformers: skipped" in n for n in notes)
        hy = commands["hyssm"]
        assert hy[hy.index("--quantization") + 1] == quant
        gguf = Path(commands["llama.cpp"][commands["llama.cpp"].index("-m") + 1])
        assert gguf == tmp_path / name and gguf.read_text() == content
    assert rec.read_text().split("\n")[:-1] == ["q8_0", "f32", "quantize Q4_K_M"]  # each made once
    assert groups == [["hyssm", "llama.cpp"]] * 3  # both servers up together, their runs alternating
    groups.clear()
    benchmark(dataclasses.replace(cfg, sequential=True), logs)
    assert groups == [["hyssm"], ["llama.cpp"]]
    with pytest.raises(ValueError, match="quantization must be one of"):
        PeersConfig(model=str(model), quantization="int3")


def test_transformers_loads_the_model_in_the_jobs_dtype() -> None:
    pytest.importorskip("transformers")
    from benchmarks.peers_transformers import run_job

    prompt = [3, 4, 5, 6, 7, 8]
    run = {"throughput": {"1": [prompt]}, "cold": [prompt], "prefix": [prompt], "shared": [prompt]}
    job = {"model": BUILTIN, "dtype": "bfloat16", "threads": 1, "output_len": 3, "runs": [run], "warmup": [9] * 6,
           "settle": {"quiet_s": 0.05}}  # fmt: skip
    out = run_job(job)
    assert out["dtype"] == "bfloat16" and out["runs"][0]["tps_c1"] > 0
    assert all(out["runs"][0][f"settle_{k}_s"] >= 0.05 for k in ("cold", "prefix", "shared"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        run_job({**job, "dtype": "float16"})


@pytest.mark.parametrize(("input_len", "prefix_len", "levels", "want"), [
    (4096, 512, (1,), 5 * 1024),  # a long cold prompt decides the slot size
    (128, 512, (1, 8), 8 * 1024),  # the continuation prompt does
    (16384, 512, (1, 2), 2 * 17 * 1024),
])
def test_llama_context_holds_the_longest_prompt_of_every_slot(input_len: int, prefix_len: int,
                                                              levels: tuple[int, ...], want: int) -> None:
    from benchmarks.peers_commands import llama_command

    cfg = PeersConfig(model="m", levels=levels, input_len=input_len, output_len=32, prefix_len=prefix_len,
                      suffix_len=32)  # fmt: skip
    cmd = llama_command(cfg, "llama-server", Path("m.gguf"), 1234)
    assert int(cmd[cmd.index("-c") + 1]) == want
    assert int(cmd[cmd.index("--parallel") + 1]) == max(levels)
