r"""Structured output requests: from the body's fields to one validated `GrammarSpec`.

Accepted forms (at most one per request, else a 400 naming the second):
- OpenAI `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON
  object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
- vLLM `guided_json` (a schema, object or JSON text), `guided_regex`, `guided_choice` (one of the
  given strings), `guided_grammar` (EBNF, xgrammar's dialect);
- vLLM >= 0.11 `structured_outputs`: an object with one of `json`, `regex`, `choice`, `grammar`,
  `json_object` (true), meaning what the guided_* fields mean (a problem names
  `structured_outputs.<key>`);
- SGLang's top-level `regex` and `ebnf` on the OpenAI endpoints;
- SGLang `sampling_params.json_schema` (JSON text), `regex`, `ebnf` on /generate.
Rule: a spec is parsed by xgrammar here, before the request is queued, so a malformed or
unsupported schema, regex or grammar is a 400 naming the field and the problem. So is a spec no
text satisfies, as far as a cheap check sees (`_dead_after`): compiled against a 257-token byte
vocabulary, a mask that allows neither a byte nor the end, at the start or after the text the spec
forces (`[^\s\S]`, an EBNF rule with no string, a schema whose required string has an impossible
pattern). A spec that empties only after a choice is found at run time (worker_proc/output/grammar.py:
the request ends as rejected, a 400 too). Worker rank 0 compiles the spec. JSON output is compact
(no free whitespace between tokens), so small models cannot wander off into whitespace. Validation
is memoised per spec (LRU). xgrammar (and with it torch) is imported on the first structured
request, in a worker thread (`needs_grammar` tells the caller to prepare the request there).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from shared.messages import GrammarSpec
from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.requests.validation import json_depth, too_deep

MAX_VALIDATED = 512
MAX_SPEC_CHARS = 256 * 1024
MAX_SCHEMA_DEPTH = 128  # JSON nesting of a schema (64 levels of nested objects: xgrammar compiles that in ~0.05 s)
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
PROBE_STOP = 256  # the stop token of the validation vocabulary (`_probe_compiler`)
PROBE_FORCED_BYTES = 256  # how far a spec's forced prefix is followed to find an empty language



def needs_grammar(body: Any) -> bool:
    """Whether preparing `body` may validate a grammar (and so may import xgrammar)."""
    rf = getattr(body, "response_format", None)
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        return True
    if any(getattr(body, n, None) is not None for n in ("guided_json", "guided_regex", "guided_choice",
                                                         "guided_grammar", "structured_outputs", "regex", "ebnf")):
        return True
    if getattr(body, "tools", None):
        return True
    sp = getattr(body, "sampling_params", None)
    return any(getattr(one, n, None) is not None for one in (sp if isinstance(sp, list) else [sp])
               for n in ("json_schema", "regex", "ebnf"))  # fmt: skip


def _message(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _XGR_PREFIX.sub("", text)


@functools.cache
def _probe_compiler() -> Any:
    """An xgrammar compiler over 257 tokens: token b is the byte b, token 256 (PROBE_STOP) the stop token. Any
    text is a sequence of these tokens, so a grammar's masks over them say what text it allows."""
    import xgrammar

    info = xgrammar.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], xgrammar.VocabType.RAW,
                                  stop_token_ids=[PROBE_STOP])
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _dead_after(grammar: Any) -> str | None:
    """The text after which `grammar` allows nothing more, not even its end (None: no such text was
    found). Walks the forced prefix only: while exactly one byte may come next it is taken, up to
    PROBE_FORCED_BYTES; the first mask that allows nothing proves the language empty. About a
    millisecond for a typical schema (compiling against the 257-token vocabulary included)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(_probe_compiler().compile_grammar(grammar))
    bitmask = xgrammar.allocate_token_bitmask(1, PROBE_STOP + 1)
    forced = bytearray()
    for _ in range(PROBE_FORCED_BYTES + 1):
        matcher.fill_next_token_bitmask(bitmask)
        words = [w & 0xFFFFFFFF for w in bitmask[0].tolist()]
        allowed = sum(w.bit_count() for w in words)
        if allowed == 0:
            return forced.decode("utf-8", "replace")
        if allowed > 1:
            return None
        tok = next(32 * i + w.bit_length() - 1 for i, w in enumerate(words) if w)
        if tok == PROBE_STOP or not matcher.accept_token(tok):
            return None
        forced.append(tok)
    return None


@functools.lru_cache(maxsize=MAX_VALIDATED)
def _problem(spec: GrammarSpec) -> str | None:
    """Why xgrammar cannot use `spec` (None: it can): it does not parse, or no text satisfies it
    (`_dead_after`). A pure function of the spec, memoised."""
    import xgrammar

    try:
        if spec.kind in ("json_schema", "json_object"):
            grammar = xgrammar.Grammar.from_json_schema(spec.source, strict_mode=spec.strict, any_whitespace=False)
        elif spec.kind == "regex":
            grammar = xgrammar.Grammar.from_regex(spec.source)
        else:
            grammar = xgrammar.Grammar.from_ebnf(spec.source)
        dead = _dead_after(grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        return _message(e)
    if dead is None:
        return None
    return "no text satisfies it" + (f" (nothing can follow {dead!r})" if dead else "")


def validate(spec: GrammarSpec, param: str) -> GrammarSpec:
    """`spec` if xgrammar can parse it, else ApiError 400 naming `param`."""
    if len(spec.source) > MAX_SPEC_CHARS:
        raise bad_request(f"{param} is {len(spec.source)} characters; at most {MAX_SPEC_CHARS}", param)
    if (problem := _problem(spec)) is not None:
        raise bad_request(f"{param}: {spec.kind} is not usable: {problem}", param)
    return spec


def _schema_text(schema: Any, param: str) -> str:
    """The schema as compact JSON text. Rule: its nesting is bounded (MAX_SCHEMA_DEPTH) before
    xgrammar sees it, since the compile time grows much faster than the depth."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param) from e
        except RecursionError as e:
            raise too_deep(param, param, MAX_SCHEMA_DEPTH) from e
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object)", param)
    if json_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise too_deep(param, param, MAX_SCHEMA_DEPTH)
    return json.dumps(schema, separators=(",", ":"))  # property order kept: it is the output order


def json_schema_spec(schema: Any, param: str, strict: bool = True) -> GrammarSpec:
    return validate(GrammarSpec(kind="json_schema", source=_schema_text(schema, param), strict=strict), param)


def _from_response_format(rf: dict[str, Any]) -> GrammarSpec | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return validate(GrammarSpec(kind="json_object", source='{"type":"object"}', strict=False), "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js and "schema_" not in js:
            raise bad_request("response_format.json_schema must be an object with a schema", "response_format")
        schema = js.get("schema", js.get("schema_"))
        return json_schema_spec(schema, "response_format.json_schema.schema", strict=bool(js.get("strict", False)))
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "response_format")


def _choice_regex(choices: Any, param: str = "guided_choice") -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def _structured_outputs(so: Any) -> list[tuple[str, GrammarSpec | None]]:
    """The constraints of vLLM's `structured_outputs` object, each named `structured_outputs.<key>`."""
    p = "structured_outputs."
    for name in ("structural_tag", "whitespace_pattern"):
        if getattr(so, name) is not None:
            raise bad_request(f"{p}{name} is not supported by this server", p + name)
    found: list[tuple[str, GrammarSpec | None]] = []
    if so.json is not None:
        found.append((p + "json", json_schema_spec(so.json, p + "json")))
    if so.regex is not None:
        found.append((p + "regex", validate(GrammarSpec(kind="regex", source=so.regex), p + "regex")))
    if so.choice is not None:
        spec = GrammarSpec(kind="regex", source=_choice_regex(so.choice, p + "choice"))
        found.append((p + "choice", validate(spec, p + "choice")))
    if so.grammar is not None:
        found.append((p + "grammar", validate(GrammarSpec(kind="ebnf", source=so.grammar), p + "grammar")))
    if so.json_object:
        spec = GrammarSpec(kind="json_object", source='{"type":"object"}', strict=False)
        found.append((p + "json_object", validate(spec, p + "json_object")))
    if not found:
        raise bad_request("structured_outputs must give one of json, regex, choice, grammar or json_object",
                          "structured_outputs")
    return found


def openai_grammar(body: Any) -> GrammarSpec | None:
    """The one constraint of an OpenAI-endpoint body (module doc), validated; None without one."""
    named = openai_constraint(body)
    return named[1] if named is not None else None


def openai_constraint(body: Any) -> tuple[str, GrammarSpec] | None:
    """(the field that gave it, the constraint) of an OpenAI-endpoint body, validated; None without one."""
    found: list[tuple[str, GrammarSpec | None]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        found.append(("response_format", _from_response_format(rf)))
    if (gj := getattr(body, "guided_json", None)) is not None:
        found.append(("guided_json", json_schema_spec(gj, "guided_json")))
    if (gr := getattr(body, "guided_regex", None)) is not None:
        found.append(("guided_regex", validate(GrammarSpec(kind="regex", source=gr), "guided_regex")))
    if (gc := getattr(body, "guided_choice", None)) is not None:
        found.append(("guided_choice", validate(GrammarSpec(kind="regex", source=_choice_regex(gc)), "guided_choice")))
    if (gg := getattr(body, "guided_grammar", None)) is not None:
        found.append(("guided_grammar", validate(GrammarSpec(kind="ebnf", source=gg), "guided_grammar")))
    if (so := getattr(body, "structured_outputs", None)) is not None:
        found.extend(_structured_outputs(so))
    for name, kind in (("regex", "regex"), ("ebnf", "ebnf")):  # SGLang's names on the OpenAI endpoints
        if (source := getattr(body, name, None)) is not None:
            found.append((name, validate(GrammarSpec(kind=kind, source=source), name)))
    given: list[tuple[str, GrammarSpec]] = [(name, spec) for name, spec in found if spec is not None]
    if len(given) > 1:
        raise bad_request(f"give one output constraint, not {given[0][0]} and {given[1][0]}", given[1][0])
    return given[0] if given else None


def native_grammar(sp: Any) -> GrammarSpec | None:
    """SGLang's sampling_params.json_schema / regex / ebnf (at most one), validated."""
    given = [n for n in ("json_schema", "regex", "ebnf") if getattr(sp, n, None) is not None]
    if len(given) > 1:
        raise bad_request(f"give one of sampling_params.json_schema, regex and ebnf, not {given[0]} and "
                          f"{given[1]}", f"sampling_params.{given[1]}")
    if not given:
        return None
    name = given[0]
    param = f"sampling_params.{name}"
    if name == "json_schema":
        return json_schema_spec(sp.json_schema, param)
    return validate(GrammarSpec(kind="regex" if name == "regex" else "ebnf", source=getattr(sp, name)), param)
