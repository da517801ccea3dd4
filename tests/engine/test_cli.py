"""`hyssm serve MODEL [flags]` (the console script) and `python -m hyssm serve ...`: launch.py under
another name, started for real and answering HTTP."""

from __future__ import annotations

import sys

import pytest

from hyssm.cli import main, serve_argv
from tests.e2e.server import running_server, wait_group_empty
from tests.engine.conftest import hyssm_command


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["console script", "python -m hyssm"])
def test_serve_starts_and_answers(command: str) -> None:
    launcher = hyssm_command() if command == "console script" else [sys.executable, "-m", "hyssm"]
    with running_server(["--served-model-name", "tiny"], command=[*launcher, "serve", "builtin"]) as srv:
        with srv.client() as http:
            r = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 3}})
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
        assert srv.stop() == 0  # SIGTERM: the graceful stop of launch.py
    assert wait_group_empty(srv.pgid) == []


def test_model_argument_is_the_model_path() -> None:
    assert serve_argv(["org/name", "--port", "1"]) == ["--model-path", "org/name", "--port", "1"]
    assert serve_argv(["--model-path", "x"]) == ["--model-path", "x"]
    assert serve_argv([]) == []


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2 and "usage: hyssm serve" in capsys.readouterr().err
    assert main(["--help"]) == 0 and "usage: hyssm serve" in capsys.readouterr().out
    assert main(["start"]) == 2
    assert capsys.readouterr().err.strip() == "hyssm: error: unknown command 'start' (the command is: serve)"
    assert main(["serve", "builtin", "--tp-size", "0"]) == 2
    assert "--tp-size must be a positive integer" in capsys.readouterr().err
