"""Fixtures of the fault tests: the state store filled once for test_state_store_faults*.py."""

from __future__ import annotations

import random

import pytest

from tests.e2e.server import DETERMINISTIC, running_server
from tests.e2e.test_state_store import answers, make_prompts, store_args
from tests.faults.state_store_helpers import BIG_LEN, BIG_NEW, Filled, entry_files, kind, namespace_folders


@pytest.fixture(scope="session")
def filled(tmp_path_factory) -> Filled:
    tmp = tmp_path_factory.mktemp("filled")
    prompts = make_prompts(61)
    restart = prompts.restart_prompts
    rng = random.Random(62)
    big = [[rng.randrange(3, 256) for _ in range(BIG_LEN)] for _ in range(6)]
    with running_server([*DETERMINISTIC, *store_args(tmp / "pristine")]) as server:
        answers(server, prompts.fill)
    with running_server([*DETERMINISTIC, "--mamba-ssm-dtype", "int8", *store_args(tmp / "foreign")]) as server:
        answers(server, prompts.fill)
    with running_server(DETERMINISTIC) as server:
        no_store_ids = [r["output_ids"] for r in answers(server, restart)]
        big_ids = [r["output_ids"] for r in answers(server, big, BIG_NEW)]
    with running_server([*DETERMINISTIC, *store_args(tmp / "empty")]) as server:
        empty_store = answers(server, restart)
    assert [r["output_ids"] for r in empty_store] == no_store_ids
    assert namespace_folders(tmp / "pristine")[0].name != namespace_folders(tmp / "foreign")[0].name
    kinds = {kind(f) for f in entry_files(tmp / "pristine")}
    assert kinds == {"kv", "state"}, kinds
    return Filled(prompts, restart, tmp / "pristine", tmp / "foreign", no_store_ids, empty_store, big, big_ids)
