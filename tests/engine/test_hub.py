"""Hugging Face Hub ids as model paths, resolved by huggingface_hub itself from a local cache in the
Hub's layout (HF_HUB_OFFLINE=1: nothing leaves the machine): for the Engine, for `hyssm serve`,
and the one-line error for an id the cache lacks."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects

import hyssm
from shared.config import ConfigError, ServerArgs, builtin_model_dir
from shared.hub import LOADER_FILES, is_hub_id, resolve_model
from tests.e2e.server import ROOT, free_port, running_server
from tests.engine.conftest import COMMIT, HUB_ID, hyssm_command, make_hub_cache

MISSING = "hyssm-test/not-in-the-cache"


def test_only_the_files_the_loader_reads_are_fetched() -> None:
    """The patterns given to snapshot_download, applied by huggingface_hub's own filter."""
    repo = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
            "additional_chat_templates/tool_use.jinja", "pytorch_model.bin", "model.gguf", "README.md",
            "original/consolidated.00.pth", "tokenizer.model", ".gitattributes", "flax_model.msgpack"]
    kept = set(filter_repo_objects(repo, allow_patterns=LOADER_FILES))
    assert kept == set(repo[:10])


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache: Path) -> None:
    args = resolve_model(ServerArgs(model_path=HUB_ID))
    assert Path(args.model_path) == hub_cache / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert args.model_name == HUB_ID  # what /v1/models reports, as vLLM and SGLang do
    assert sorted(os.listdir(args.model_path)) == sorted(os.listdir(builtin_model_dir()))
    assert resolve_model(ServerArgs(model_path=HUB_ID, revision=COMMIT)).model_path == args.model_path
    assert resolve_model(ServerArgs(model_path=HUB_ID, served_model_name="mine")).model_name == "mine"


def test_download_dir_is_the_cache_used(hub_cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    snapshot = make_hub_cache(other, "hyssm-test/other")
    with pytest.raises(ConfigError):  # not in HF_HUB_CACHE
        resolve_model(ServerArgs(model_path="hyssm-test/other"))
    args = resolve_model(ServerArgs(model_path="hyssm-test/other", download_dir=str(other)))
    assert Path(args.model_path) == snapshot


def test_a_missing_id_offline_is_one_line_naming_it(hub_cache: Path) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_model(ServerArgs(model_path=MISSING))
    message = str(e.value)
    assert MISSING in message and "HF_HUB_OFFLINE" in message and "\n" not in message
    with pytest.raises(ConfigError, match="--revision v9"):
        resolve_model(ServerArgs(model_path=HUB_ID, revision="v9"))


def test_local_paths_are_never_hub_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not is_hub_id("builtin")
    assert not is_hub_id(builtin_model_dir())
    assert not is_hub_id(str(tmp_path / "missing"))  # a missing absolute path stays a path (and its error)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    assert not is_hub_id("org/model")  # an existing relative directory wins over the Hub
    assert is_hub_id("org/other")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_engine_serves_a_hub_id(hub_cache: Path) -> None:
    with hyssm.Engine(model_path=HUB_ID, device="cpu") as eng:
        assert eng.args.model_path.startswith(str(hub_cache))
        out = eng.generate(["Once upon a time"], {"max_new_tokens": 4, "temperature": 0})
        assert out[0]["meta_info"]["completion_tokens"] == 4
        assert eng.get_server_info()["model_name"] == HUB_ID
        assert eng.chat([{"role": "user", "content": "Hi"}], {"max_tokens": 2})["model"] == HUB_ID


def test_the_engine_refuses_a_missing_id(hub_cache: Path) -> None:
    with pytest.raises(hyssm.ConfigError, match=MISSING):
        hyssm.Engine(model_path=MISSING, device="cpu")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_hyssm_serve_a_hub_id(hub_cache: Path) -> None:
    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE")}
    with running_server([], command=[*hyssm_command(), "serve", HUB_ID], env=env) as srv, srv.client() as http:
        r = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [HUB_ID]
        assert f"serving {HUB_ID} at {srv.url}" in srv.output


def _serve_error(model: str, env: dict[str, str]) -> str:
    """`hyssm serve MODEL` that must fail before starting anything: its one error line."""
    proc = subprocess.run([*hyssm_command(), "serve", model, "--device", "cpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and model in errors[0], proc.stderr
    return errors[0]


def test_hyssm_serve_a_missing_id_fails_with_one_line(hub_cache: Path) -> None:
    assert "HF_HUB_OFFLINE" in _serve_error(MISSING, {**os.environ})


class _NoSuchRepo(http.server.BaseHTTPRequestHandler):
    """A Hub that knows no repository (the answer huggingface_hub reads as RepositoryNotFoundError)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


def test_an_unknown_id_and_no_network_fail_with_one_line(tmp_path: Path) -> None:
    """Online (HF_HUB_OFFLINE unset) against a local endpoint: a Hub without the repository, then none at all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepo)
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    try:
        line = _serve_error(MISSING, {**env, "HF_ENDPOINT": f"http://127.0.0.1:{hub.server_address[1]}"})
        assert "no such model on the Hugging Face Hub" in line
    finally:
        hub.shutdown()
        hub.server_close()
        thread.join(10)
    line = _serve_error(MISSING, {**env, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"})  # nothing listens
    assert "cannot be reached" in line
