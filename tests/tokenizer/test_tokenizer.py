"""The built-in tokenizer files, loading, eos ids and chat templates."""

from __future__ import annotations

import json
import os

import pytest

from shared.config import builtin_model_dir
from shared.errors import ModelLoadError
from shared.model_info import ModelInfo
from tests.tokenizer.conftest import write_model_dir
from tokenizer_proc.make_builtin_tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, bytes_to_unicode, write
from tokenizer_proc.requests.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    select_template,
)
from tokenizer_proc.requests.tokenizer import TextTokenizer


def test_committed_files_are_what_the_script_writes(tmp_path) -> None:
    write(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(tmp_path / name) as f, open(os.path.join(builtin_model_dir(), name)) as g:
            assert json.load(f) == json.load(g), name


def test_builtin_vocabulary_layout(tok: TextTokenizer) -> None:
    t = tok.tokenizer
    assert t.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE == 260
    chars = bytes_to_unicode()
    assert len(set(chars.values())) == 256
    for b in range(256):
        assert t.token_to_id(chars[b]) == b
    for i, special in enumerate(SPECIAL_TOKENS):
        assert t.token_to_id(special) == 256 + i
    text = "Grüße, 世界! 🙂\n\t"
    assert tok.encode(text) == list(text.encode())
    assert tok.encode("a<|end_of_text|>b") == [ord("a"), 256, ord("b")]


def test_builtin_model_dir_matches_its_config() -> None:
    info = ModelInfo.from_dir(builtin_model_dir())
    tok = TextTokenizer.from_dir(builtin_model_dir(), info)
    assert info.vocab_size == tok.tokenizer.get_vocab_size(with_added_tokens=True)
    assert tok.eos_token_ids == (256,)


def test_chat_template_renders_granite_style(tok: TextTokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.render_chat(messages)
    assert text == (
        "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:8] == [257, *b"system", 258]
    assert ids[-11:] == [257, *b"assistant", 258]


def test_template_selection_order(tmp_path) -> None:
    assert select_template({"chat_template": "X"}, str(tmp_path)) == "X"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert select_template({"chat_template": named}, str(tmp_path)) == "D"
    assert select_template({}, str(tmp_path)) == DEFAULT_CHAT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("J")
    assert select_template({}, str(tmp_path)) == "J"


def test_template_features_and_errors() -> None:
    t = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
        "{% if messages|length > 2 %}{{ raise_exception('too many') }}{% endif %}",
        {"bos_token": "<s>"},
    )
    assert t.render([{"role": "user", "content": 'a"b'}]) == '<s>"a\\"b"'
    with pytest.raises(ChatTemplateError, match="too many"):
        t.render([{"role": "user", "content": "x"}] * 3)
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        sandboxed.render([])


def test_tokenizer_config_eos_joins_model_eos(tmp_path) -> None:
    path = write_model_dir(str(tmp_path / "m"))
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["eos_token"] = "<|end_of_role|>"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    tok = TextTokenizer.from_dir(path)
    assert tok.eos_token_ids == (256, 258)
    assert tok.extra_stop_ids == (258,)


def test_load_failures_name_the_file(tmp_path) -> None:
    path = write_model_dir(str(tmp_path / "m"))
    os.remove(os.path.join(path, "tokenizer.json"))
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        TextTokenizer.from_dir(path)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write("{broken")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        TextTokenizer.from_dir(path)


def test_token_text_and_bytes_for_logprobs(tok: TextTokenizer) -> None:
    assert tok.token_text(ord("a")) == "a"
    assert tok.token_text(0xE4) == "\ufffd"
    assert tok.token_bytes(0xE4) == [0xE4]
    assert tok.token_text(257) == "<|start_of_role|>"
