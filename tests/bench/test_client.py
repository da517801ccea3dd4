"""bench_serving's client path end to end against a fake streaming server (real HTTP, in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_serving import SHARED_PREFIX_PRESET, main, parse_args
from tests.bench.fake_server import MODEL_NAME, VOCAB_SIZE, FakeServer

pytestmark = pytest.mark.timeout(60)


def _strict_json(path: Path) -> dict[str, object]:
    def no_constants(name: str) -> object:
        raise AssertionError(f"non-strict JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=no_constants)


def _run(server: FakeServer, tmp_path: Path, *flags: str, fail_every: int = 0,
         hide_server_info: bool = False) -> tuple[int, dict[str, object]]:  # fmt: skip
    server.reset(fail_every, hide_server_info)
    out = tmp_path / "result.json"
    rc = main(["--base-url", server.base_url, "--disable-tqdm", "--output-json", str(out), *flags])
    server.check_integrity()
    return rc, _strict_json(out)


def test_generate_shared_prefix_reports_hit_rate(server: FakeServer, tmp_path: Path, capsys) -> None:
    flags = ["--num-prompts", "8", "--concurrency", "1", "--input-len", "5", "--output-len", "6"]
    rc, m = _run(server, tmp_path, *flags, "--shared-prefix-len", "30", "--num-prefix-groups", "2", "--seed", "3")
    assert rc == 0
    seen = server.state.seen
    assert [s.endpoint for s in seen] == ["generate"] * 8
    # the vocab size came from /get_server_info; group prefixes alternate; every suffix is distinct
    assert all(max(s.prompt_ids) < VOCAB_SIZE and len(s.prompt_ids) == 35 for s in seen)
    assert all(s.prompt_ids[:30] == seen[i % 2].prompt_ids[:30] for i, s in enumerate(seen))
    assert seen[0].prompt_ids[:30] != seen[1].prompt_ids[:30]
    assert len({tuple(s.prompt_ids[30:]) for s in seen}) == 8
    assert all(s.body["sampling_params"]["ignore_eos"] is True for s in seen)  # type: ignore[index]
    assert seen[0].cached_tokens == 0 and all(s.cached_tokens >= 30 for s in seen[2:])
    cached = sum(s.cached_tokens for s in seen)
    assert (m["completed"], m["failed"]) == (8, 0)
    assert (m["total_input_tokens"], m["total_output_tokens"], m["total_cached_tokens"]) == (280, 48, cached)
    assert m["prefix_cache_hit_rate"] == pytest.approx(cached / 280)
    ttft, itl, e2e = m["ttft_ms"], m["itl_ms"], m["e2e_ms"]
    assert 0 < ttft["median"] <= e2e["median"] and itl["mean"] > 0  # type: ignore[index, operator]
    assert m["config"]["vocab_size"] == VOCAB_SIZE  # type: ignore[index]
    table = capsys.readouterr().out
    assert "Successful requests:" in table and f"{cached / 280:.2%}" in table


def test_openai_backend_with_rate_and_length_spread(server: FakeServer, tmp_path: Path) -> None:
    flags = [
        "--backend",
        "openai",
        "--num-prompts",
        "12",
        "--concurrency",
        "4",
        "--request-rate",
        "500",
        "--api-key",
        "k1",
    ]
    rc, m = _run(server, tmp_path, *flags, "--input-len", "20", "--output-len", "8", "--range-ratio", "0.5")
    assert rc == 0
    seen = server.state.seen
    assert len(seen) == 12 and all(s.endpoint == "openai" and s.body["model"] == MODEL_NAME for s in seen)
    assert all(10 <= len(s.prompt_ids) <= 30 and 4 <= s.max_tokens <= 12 for s in seen)
    assert len({len(s.prompt_ids) for s in seen}) > 1  # lengths actually vary
    assert m["completed"] == 12 and m["failed"] == 0
    assert m["total_output_tokens"] == sum(s.max_tokens for s in seen)  # from usage, not from text chunks
    assert m["total_input_tokens"] == sum(len(s.prompt_ids) for s in seen)
    assert m["config"]["model"] == MODEL_NAME  # type: ignore[index]
    assert all(s.auth == "Bearer k1" for s in seen) and m["config"]["api_key"] == "<redacted>"  # type: ignore[index]


def test_failures_are_counted_not_fatal(server: FakeServer, tmp_path: Path) -> None:
    rc, m = _run(server, tmp_path, "--num-prompts", "9", "--concurrency", "1", "--input-len", "4",
                 "--output-len", "2", fail_every=3)  # fmt: skip
    assert rc == 0
    assert (m["completed"], m["failed"]) == (6, 3)
    assert any("HTTP 503" in e for e in m["errors"])  # type: ignore[union-attr]


def test_all_failed_exits_nonzero(server: FakeServer, tmp_path: Path) -> None:
    rc, m = _run(server, tmp_path, "--num-prompts", "2", "--input-len", "4", "--output-len", "2", fail_every=1)
    assert rc == 1 and m["completed"] == 0 and m["ttft_ms"]["median"] is None  # type: ignore[index]


def test_warmup_flush_and_runs(server: FakeServer, tmp_path: Path) -> None:
    flags = ["--num-prompts", "3", "--input-len", "6", "--output-len", "3", "--concurrency", "2"]
    rc, m = _run(server, tmp_path, *flags, "--warmup", "2", "--flush-cache", "--runs", "2", "--vocab-size", "50")
    assert rc == 0
    assert server.state.flushes == 2 and len(server.state.seen) == 2 + 2 * 3
    assert all(max(s.prompt_ids) < 50 for s in server.state.seen)
    runs = m["runs"]
    assert isinstance(runs, list) and len(runs) == 2 and all(r["completed"] == 3 for r in runs)
    # runs use seeds seed and seed+1: no measured prompt repeats across runs
    measured = [tuple(s.prompt_ids) for s in server.state.seen[2:]]
    assert len(set(measured)) == 6
    assert m["completed"] == 3


def test_shared_prefix_preset_and_flag_validation() -> None:
    cfg = parse_args(["--shared-prefix", "--num-prompts", "4"])
    assert cfg.shared_prefix_len == SHARED_PREFIX_PRESET["shared_prefix_len"] and cfg.num_prompts == 4
    assert cfg.concurrency == 1 and cfg.base_url == "http://127.0.0.1:30000"
    for bad in (["--range-ratio", "1"], ["--concurrency", "0"], ["--num-prompts", "0"], ["--request-rate", "0"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(bad)
        assert exc.value.code == 2


def test_llama_server_backend_native_completion(server: FakeServer, tmp_path: Path) -> None:
    flags = ["--backend", "llama-server", "--num-prompts", "6", "--concurrency", "3", "--input-len", "9",
             "--output-len", "5", "--shared-prefix-len", "20"]  # fmt: skip
    rc, m = _run(server, tmp_path, *flags, hide_server_info=True)
    assert rc == 0
    seen = server.state.seen
    assert [s.endpoint for s in seen] == ["llama-server"] * 6
    assert all(s.body["ignore_eos"] is True and s.body["cache_prompt"] is True and s.body["n_predict"] == 5
               and s.body["stream"] is True for s in seen)  # fmt: skip
    # vocab came from /v1/models' meta.n_vocab (no /get_server_info on llama-server)
    assert all(max(s.prompt_ids) < VOCAB_SIZE for s in seen) and m["config"]["vocab_size"] == VOCAB_SIZE  # type: ignore[index]
    assert (m["completed"], m["failed"]) == (6, 0)
    assert m["total_output_tokens"] == 30 and m["total_input_tokens"] == 6 * 29
    assert m["total_cached_tokens"] == sum(s.cached_tokens for s in seen) > 0  # from timings.cache_n
    # the progress chunk (0 tokens) is not a first token; one token per later chunk: 4 ITLs per request
    assert m["ttft_ms"]["median"] > 0 and m["itl_ms"]["mean"] > 0  # type: ignore[index, operator]


def test_openai_backend_extra_body_and_no_ignore_eos(server: FakeServer, tmp_path: Path) -> None:
    flags = ["--backend", "openai", "--num-prompts", "2", "--input-len", "4", "--output-len", "3",
             "--no-ignore-eos", "--extra-body", '{"min_tokens": 3, "top_k": 1}']  # fmt: skip
    rc, m = _run(server, tmp_path, *flags, hide_server_info=True)
    assert rc == 0 and m["completed"] == 2
    assert all("ignore_eos" not in s.body and s.body["min_tokens"] == 3 and s.body["top_k"] == 1
               for s in server.state.seen)  # fmt: skip
    assert m["config"]["vocab_size"] == VOCAB_SIZE  # type: ignore[index]


def test_backend_alias_and_bad_backend_flags() -> None:
    assert parse_args(["--backend", "generate"]).backend == "hyssm"
    assert parse_args([]).backend == "hyssm"
    bad = (["--backend", "vllm"], ["--backend", "llama-server", "--flush-cache"], ["--extra-body", "[1]"],
           ["--extra-body", "{nope"])  # fmt: skip
    for flags in bad:
        with pytest.raises(SystemExit) as exc:
            parse_args(flags)
        assert exc.value.code == 2
