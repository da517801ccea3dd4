"""The namespace digest and the block key chain: stable across processes, sensitive to every input."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from shared.images import key_token
from shared.state_store import StoreNamespace, block_key, chain_keys, config_fingerprint, root_key
from shared.state_store.keys import FORMAT_VERSION, is_key
from tests.state_store.common import NAMESPACE_FIELDS, PYTHON, ROOT, namespace, subprocess_env

TOKENS = list(range(1000, 1040))
CHANGES = dict(model_config="d" * 64, weights="rev-2", dtype="float16", quantization="fp8", state_dtype="bfloat16",
               tp_size=4, tp_rank=1, adapter_id="lora-a", numerics="reference",
               format_version=FORMAT_VERSION + 1)


def test_every_field_is_covered_by_a_change() -> None:
    assert set(CHANGES) == set(namespace().fields())


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_the_digest_changes_with_every_field(field: str) -> None:
    base, changed = namespace(), namespace(**{field: CHANGES[field]})
    assert changed.digest != base.digest
    assert set(chain_keys(base, TOKENS, 8)).isdisjoint(chain_keys(changed, TOKENS, 8))


def test_equal_fields_give_equal_digests_and_keys() -> None:
    a, b = namespace(), namespace()
    assert a == b and a.digest == b.digest and len(a.digest) == 64
    assert chain_keys(a, TOKENS, 8) == chain_keys(b, TOKENS, 8)


def test_digest_and_keys_are_equal_in_another_process_that_imports_no_torch() -> None:
    script = textwrap.dedent(f"""
        import json, sys
        from shared.state_store import StoreNamespace, chain_keys
        ns = StoreNamespace(**{NAMESPACE_FIELDS!r})
        print(json.dumps([ns.digest, chain_keys(ns, {TOKENS!r}, 8), "torch" in sys.modules]))
    """)
    out = subprocess.run([PYTHON, "-c", script], env=subprocess_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    digest, keys, torch_loaded = json.loads(out)
    assert digest == namespace().digest
    assert keys == chain_keys(namespace(), TOKENS, 8)
    assert not torch_loaded


def test_the_chain_is_block_key_from_the_root() -> None:
    ns = namespace()
    keys = chain_keys(ns, TOKENS, 16)
    assert len(keys) == 2  # 40 tokens: two full blocks, the partial one has no key
    first = block_key(root_key(ns), TOKENS[:16])
    assert keys == [first, block_key(first, TOKENS[16:32])]
    assert all(is_key(k) for k in keys)
    assert chain_keys(ns, TOKENS[:15], 16) == []


def test_one_changed_token_changes_its_block_and_every_later_one() -> None:
    ns = namespace()
    keys = chain_keys(ns, TOKENS, 8)
    changed = list(TOKENS)
    changed[19] += 1  # in the third block
    other = chain_keys(ns, changed, 8)
    assert other[:2] == keys[:2]
    assert all(a != b for a, b in zip(other[2:], keys[2:], strict=True))


def test_a_prefix_has_the_keys_of_the_longer_sequence() -> None:
    ns = namespace()
    assert chain_keys(ns, TOKENS[:24], 8) == chain_keys(ns, TOKENS, 8)[:3]


def test_tokens_are_fixed_width_so_splits_do_not_collide() -> None:
    ns = namespace()
    assert chain_keys(ns, [1, 2, 3, 4], 4)[0] not in chain_keys(ns, [1, 2, 3, 4], 2)
    assert block_key(root_key(ns), [1, 256]) != block_key(root_key(ns), [256, 1])
    assert block_key(root_key(ns), [0]) != block_key(root_key(ns), [0, 0])


@pytest.mark.parametrize("tokens", [[2**63], [-(2**63) - 1], [1.5]])
def test_token_ids_outside_int64_are_refused(tokens: list) -> None:
    with pytest.raises(ValueError):
        chain_keys(namespace(), tokens, 1)


def test_an_image_key_token_keys_its_blocks_by_the_image() -> None:
    """Image positions hold their image's key token (< 0): the same image keys the same blocks, another one
    other blocks from its first position on."""
    ns = namespace()
    a, b = key_token("ab" * 32), key_token("cd" * 32)
    assert a < 0 and b < 0 and a != b
    same = chain_keys(ns, [5, 6, a, a, 7, 8], 2)
    assert same == chain_keys(ns, [5, 6, a, a, 7, 8], 2)
    other = chain_keys(ns, [5, 6, b, b, 7, 8], 2)
    assert same[0] == other[0] and same[1] != other[1] and same[2] != other[2]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        block_key("not a key", [1])
    with pytest.raises(ValueError):
        chain_keys(namespace(), TOKENS, 0)
    with pytest.raises(ValueError):
        namespace(tp_rank=2)
    with pytest.raises(ValueError):
        namespace(weights="")
    with pytest.raises(TypeError):
        namespace(tp_size="2")


def test_config_fingerprint_ignores_key_order_only() -> None:
    assert config_fingerprint({"a": 1, "b": [1, 2]}) == config_fingerprint({"b": [1, 2], "a": 1})
    assert config_fingerprint({"a": 1}) != config_fingerprint({"a": 2})
    assert len(config_fingerprint({})) == 64


def test_namespace_is_frozen() -> None:
    ns: StoreNamespace = namespace()
    with pytest.raises(AttributeError):
        ns.tp_rank = 1  # type: ignore[misc]
