"""vLLM / SGLang request fields that shape the request, against a fake backend: structured_outputs and
SGLang's regex / ebnf, truncate_prompt_tokens, continue_final_message, custom roles, documents,
add_special_tokens, /tokenize with tools and template variables, and the out-of-scope fields (a 400
naming each, their neutral values accepted)."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from tokenizers import processors

from shared.config import ServerArgs
from tests.tokenizer.conftest import CONTEXT, FakeBackend, write_model_dir
from tests.tokenizer.test_app import serve
from tokenizer_proc.requests.tokenizer import TextTokenizer

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _post_all(args, tok, calls: list[tuple[str, dict]]) -> tuple[list[httpx.Response], FakeBackend]:
    backend = FakeBackend()
    out: list[httpx.Response] = []

    async def check(c: httpx.AsyncClient) -> None:
        for path, body in calls:
            out.append(await c.post(path, json=body))

    serve(args, backend, tok, check)
    return out, backend


@pytest.mark.parametrize(("so", "kind", "source"), [
    ({"json": SCHEMA}, "json_schema", json.dumps(SCHEMA, separators=(",", ":"))),
    ({"json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA, separators=(",", ":"))),
    ({"regex": "[ab]+"}, "regex", "[ab]+"),
    ({"choice": ["yes", "no"]}, "regex", "(yes|no)"),
    ({"grammar": 'root ::= "x"'}, "ebnf", 'root ::= "x"'),
    ({"json_object": True, "disable_any_whitespace": True}, "json_object", '{"type":"object"}'),
])
def test_structured_outputs_reach_the_sampler(args, tok, so, kind, source) -> None:
    rs, backend = _post_all(args, tok, [(COMP, {"prompt": "a", "max_tokens": 2, "structured_outputs": so}),
                                        (CHAT, {"messages": MSGS, "max_tokens": 2, "structured_outputs": so})])
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    for sub in backend.submitted:
        assert sub.sampling.grammar is not None
        assert (sub.sampling.grammar.kind, sub.sampling.grammar.source) == (kind, source)


@pytest.mark.parametrize(("body", "kind", "source"), [
    ({"regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
    ({"ebnf": 'root ::= "y"'}, "ebnf", 'root ::= "y"'),
])
def test_sglang_regex_and_ebnf_on_openai_endpoints(args, tok, body, kind, source) -> None:
    rs, backend = _post_all(args, tok, [(COMP, {"prompt": "a", "max_tokens": 2, **body}),
                                        (CHAT, {"messages": MSGS, "max_tokens": 2, **body})])
    assert [r.status_code for r in rs] == [200, 200]
    assert all((s.sampling.grammar.kind, s.sampling.grammar.source) == (kind, source) for s in backend.submitted)


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"regex": "a", "guided_grammar": 'root ::= "a"'}, "regex"),
    ({"regex": "[a-"}, "regex"),
])
def test_structured_outputs_errors_name_the_key(args, tok, body, param) -> None:
    rs, backend = _post_all(args, tok, [(COMP, {"prompt": "a", **body}), (CHAT, {"messages": MSGS, **body})])
    for r in rs:
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert backend.submitted == []


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs.regex"),
    ({"guided_regex": "[a-z]+"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_a_constraint_with_a_forced_tool_call_names_its_own_field(args, tok, body, param) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    rs, backend = _post_all(args, tok, [(CHAT, {"messages": MSGS, "tools": [tool], "tool_choice": "required",
                                                **body})])  # fmt: skip
    assert rs[0].status_code == 400 and rs[0].json()["error"]["param"] == param, rs[0].text
    assert "tool_choice" in rs[0].json()["error"]["message"] and backend.submitted == []


def test_truncate_prompt_tokens(args, tok) -> None:
    prompt = list(range(10, 40))
    rs, backend = _post_all(args, tok, [
        (COMP, {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 5}),
        (COMP, {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 5, "truncation_side": "right"}),
        (COMP, {"prompt": "abcdefgh", "max_tokens": 1, "truncate_prompt_tokens": 3, "echo": True}),
        (COMP, {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 100}),  # shorter already: unchanged
        (COMP, {"prompt": list(range(10, 10 + 2 * CONTEXT)), "max_tokens": 1, "truncate_prompt_tokens": -1}),
        (CHAT, {"messages": MSGS, "max_tokens": 1, "truncate_prompt_tokens": 4}),
    ])
    assert [r.status_code for r in rs] == [200, 200, 200, 200, 400, 200], [r.text for r in rs]
    ids = [s.input_ids for s in backend.submitted]
    assert ids[0] == prompt[-5:] and ids[1] == prompt[:5] and ids[2] == list(b"fgh") and ids[3] == prompt
    assert rs[2].json()["choices"][0]["text"].startswith("fgh")  # echo returns what the model saw
    # -1 keeps the context length's worth, which leaves no room to generate: the usual 400
    assert rs[4].json()["error"]["param"] == "prompt"
    chat_ids = tok.encode(tok.render_chat(MSGS), add_special_tokens=False)
    assert ids[4] == chat_ids[-4:]


@pytest.mark.parametrize("value", [0, -2, CONTEXT + 1])
def test_truncate_prompt_tokens_out_of_range(args, tok, value) -> None:
    (r,), _ = _post_all(args, tok, [(COMP, {"prompt": "a", "truncate_prompt_tokens": value})])
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_continue_final_message(args, tok) -> None:
    msgs = [*MSGS, {"role": "assistant", "content": "The answer is "}]
    rs, backend = _post_all(args, tok, [
        (CHAT, {"messages": msgs, "max_tokens": 2, "continue_final_message": True}),
        (CHAT, {"messages": msgs, "max_tokens": 2, "continue_final_message": True, "add_generation_prompt": False}),
        (CHAT, {"messages": msgs, "max_tokens": 2, "continue_final_message": True, "add_generation_prompt": True}),
        (CHAT, {"messages": MSGS, "max_tokens": 2, "continue_final_message": True}),
        (CHAT, {"messages": [*MSGS, {"role": "assistant", "content": " "}], "continue_final_message": True}),
        ("/tokenize", {"messages": msgs, "continue_final_message": True}),
    ])
    assert [r.status_code for r in rs] == [200, 200, 400, 400, 400, 200], [r.text for r in rs]
    full = tok.render_chat(msgs, add_generation_prompt=False)
    want = full[: full.rindex("The answer is ") + len("The answer is ")]
    assert want.endswith("<|start_of_role|>assistant<|end_of_role|>The answer is ")
    assert [tok.decode(s.input_ids) for s in backend.submitted] == [want, want]
    assert rs[2].json()["error"]["param"] == "add_generation_prompt"
    assert rs[3].json()["error"]["param"] == "continue_final_message"
    assert rs[4].json()["error"]["param"] == "messages"
    assert rs[5].json()["tokens"] == backend.submitted[0].input_ids


def test_continue_final_keeps_or_strips_trailing_space() -> None:
    from tokenizer_proc.requests.chat_continuation import continue_final

    msgs = [{"role": "assistant", "content": "Hi there  "}]
    assert continue_final("<a>Hi there  </a>", msgs) == "<a>Hi there  "
    assert continue_final("<a>Hi there</a>", msgs) == "<a>Hi there"  # the template stripped it


def test_custom_roles_are_rendered(args, tok) -> None:
    msgs = [{"role": "wizard", "content": "abra"}, {"role": "user", "content": "hi"}]
    (r, t), backend = _post_all(args, tok, [(CHAT, {"messages": msgs, "max_tokens": 1}),
                                            ("/tokenize", {"messages": msgs})])
    assert r.status_code == 200 and t.status_code == 200
    assert "<|start_of_role|>wizard<|end_of_role|>abra" in tok.decode(backend.submitted[0].input_ids)
    assert t.json()["tokens"] == backend.submitted[0].input_ids


@pytest.fixture(scope="module")
def custom_tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    """The test tokenizer with a template that writes `greeting`, `documents` and the tools, and a
    post-processor that puts token 256 before every text encoded with special tokens."""
    path = write_model_dir(str(tmp_path_factory.mktemp("custom")))
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = ("{{ greeting }}{% for d in documents or [] %}[{{ d.text }}]{% endfor %}"
                            "{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}"
                            "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    tok = TextTokenizer.from_dir(path)
    tok.tokenizer.post_processor = processors.TemplateProcessing(
        single="<|end_of_text|> $A", special_tokens=[("<|end_of_text|>", 256)])
    return tok


def test_tokenize_renders_tools_and_template_variables(args, tok, custom_tok) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = tok.encode(tok.render_chat(MSGS, tools=tools), add_special_tokens=False)
    (r, plain, strs), _ = _post_all(args, tok, [("/tokenize", {"messages": MSGS, "tools": tools}),
                                                ("/tokenize", {"messages": MSGS}),
                                                ("/tokenize", {"prompt": "a b", "return_token_strs": True})])
    assert r.json()["tokens"] == with_tools and r.json()["count"] > plain.json()["count"]
    assert strs.json()["token_strs"] == ["a", "\u0120", "b"]  # vocabulary strings: the byte-level space
    body = {"messages": MSGS, "tools": tools, "chat_template_kwargs": {"greeting": "hey "},
            "documents": [{"text": "doc"}]}
    (t, c, special), backend = _post_all(args, custom_tok, [
        ("/tokenize", body), (CHAT, {**body, "max_tokens": 1}),
        ("/tokenize", {"messages": MSGS, "add_special_tokens": True})])
    assert custom_tok.decode(t.json()["tokens"]) == "hey [doc]<get_weather>user:hi;"
    assert c.status_code == 200 and backend.submitted[0].input_ids == t.json()["tokens"]
    assert special.json()["tokens"][0] == 256


def test_add_special_tokens(args, custom_tok) -> None:
    rs, backend = _post_all(args, custom_tok, [
        (COMP, {"prompt": "ab", "max_tokens": 1}),
        (COMP, {"prompt": "ab", "max_tokens": 1, "add_special_tokens": False}),
        (CHAT, {"messages": MSGS, "max_tokens": 1}),
        (CHAT, {"messages": MSGS, "max_tokens": 1, "add_special_tokens": True}),
    ])
    assert all(r.status_code == 200 for r in rs)
    ids = [s.input_ids for s in backend.submitted]
    assert ids[0] == [256, *b"ab"] and ids[1] == list(b"ab")
    assert ids[2][0] != 256 and ids[3] == [256, *ids[2]]


OUT_OF_SCOPE = [
    ("length_penalty", 2.0), ("early_stopping", True),
    ("include_stop_str_in_output", True), ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
    ("logits_processors", ["m.f"]), ("custom_logit_processor", "x"), ("custom_params", {"a": 1}),
    ("logprob_token_ids", [1]), ("return_tokens_as_token_ids", True), ("cache_salt", "salt"),
    ("kv_transfer_params", {"do_remote_decode": True}), ("vllm_xargs", {"a": 1}),
    ("repetition_detection", {"max_pattern_size": 4}), ("watermarking", True),
    ("guided_whitespace_pattern", " "), ("lora_path", "adapter"), ("modalities", ["text", "audio"]),
]


@pytest.mark.parametrize(("name", "value"), OUT_OF_SCOPE)
def test_out_of_scope_fields_are_400_naming_them(args, tok, name, value) -> None:
    rs, backend = _post_all(args, tok, [(COMP, {"prompt": "a", name: value}),
                                        (CHAT, {"messages": MSGS, name: value})])
    for r in rs:
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    assert backend.submitted == []


def test_beam_search_with_best_of_and_endpoint_specific_fields(args, tok) -> None:
    rs, _ = _post_all(args, tok, [
        (COMP, {"prompt": "a", "best_of": 3, "n": 1, "use_beam_search": True}),
        (COMP, {"prompt": "a", "prompt_embeds": "AAAA"}),
        (CHAT, {"messages": MSGS, "echo": True}),
    ])
    assert [r.json()["error"]["param"] for r in rs] == ["best_of", "prompt_embeds", "echo"]


def test_neutral_values_and_identifiers_are_accepted(args, tok) -> None:
    neutral = {"use_beam_search": False, "length_penalty": 1.0, "early_stopping": False,
               "include_stop_str_in_output": False, "bad_words": [], "allowed_token_ids": None,
               "return_tokens_as_token_ids": False, "modalities": ["text"], "spaces_between_special_tokens": False,
               "request_id": "r", "session_id": "s", "rid": "x", "priority": 3}
    rs, backend = _post_all(args, tok, [(COMP, {"prompt": "a", "max_tokens": 1, **neutral}),
                                        (CHAT, {"messages": MSGS, "max_tokens": 1, **neutral})])
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    assert [s.priority for s in backend.submitted] == [3, 3]


def test_models_root_is_the_model_path(args, tok) -> None:
    from shared.config import builtin_model_dir

    for model_args, want in ((args, args.model_path), (ServerArgs(model_path="builtin"), builtin_model_dir())):
        backend = FakeBackend()
        got: list[str] = []

        async def check(c: httpx.AsyncClient, name: str = model_args.model_name, got: list[str] = got) -> None:
            got.append((await c.get("/v1/models")).json()["data"][0]["root"])
            got.append((await c.get(f"/v1/models/{name}")).json()["root"])

        serve(model_args, backend, tok, check)
        assert got == [want, want] and "builtin" != want
