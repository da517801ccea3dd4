"""Incremental detokenisation: UTF-8 split across byte tokens, stop strings across tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from shared.model_info import ModelInfo
from tokenizer_proc.requests.detokenizer import (
    ByteTableStream,
    DecodeStreamAdapter,
    IncrementalDetokenizer,
    StopStringMatcher,
)
from tokenizer_proc.requests.tokenizer import TextTokenizer


def _feed(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    out = []
    for i in range(0, len(ids), step):
        out.append(detok.push(ids[i : i + step]))
        detok.check_integrity()
    return out


def test_multibyte_characters_split_across_byte_tokens(tok: TextTokenizer) -> None:
    text = "é世🙂"  # 2, 3 and 4 UTF-8 bytes: one byte token each
    ids = tok.encode(text)
    assert ids == list(text.encode())
    pieces = _feed(tok.detokenizer(), ids)
    # nothing is emitted until the last byte of each character has arrived
    assert pieces == ["", "é", "", "", "世", "", "", "", "🙂"]


def test_no_broken_utf8_is_ever_emitted(tok: TextTokenizer) -> None:
    ids = list("añ€😀x".encode())
    for piece in _feed(tok.detokenizer(), ids):
        piece.encode("utf-8")  # would raise on a lone surrogate
        assert "\ufffd" not in piece


def test_invalid_bytes_become_replacement_characters(tok: TextTokenizer) -> None:
    detok = tok.detokenizer()
    assert detok.push([0xFF]) == "\ufffd"
    assert detok.push([ord("a")]) == "a"
    # an unfinished character at the very end is released as U+FFFD by finish()
    assert detok.push([0xE4, 0xB8]) == ""
    assert detok.finish() == "\ufffd"
    assert detok.finish() == ""


def test_special_tokens_skipped_or_kept(tok: TextTokenizer) -> None:
    ids = [ord("h"), ord("i"), 256]
    assert "".join(_feed(tok.detokenizer(), ids)) == "hi"
    assert "".join(_feed(tok.detokenizer(skip_special_tokens=False), ids)) == "hi<|end_of_text|>"


def test_out_of_vocab_ids_decode_to_nothing(tok: TextTokenizer) -> None:
    assert tok.detokenizer().push([ord("a"), 999_999, -1, ord("b")]) == "ab"


def test_stop_string_across_token_boundaries(tok: TextTokenizer) -> None:
    detok = tok.detokenizer(stops=["world"])
    pieces = _feed(detok, tok.encode("hello world and more"))
    assert "".join(pieces) == "hello "
    assert detok.matched_stop == "world"
    # the held-back "w", "wo", ... was never emitted before the match was known
    assert pieces[6:11] == ["", "", "", "", ""]
    assert detok.push([ord("x")]) == "" and detok.finish() == ""


def test_held_stop_prefix_is_released_when_it_diverges_or_ends(tok: TextTokenizer) -> None:
    detok = tok.detokenizer(stops=["abc"])
    assert detok.push(tok.encode("xab")) == "x"
    assert detok.push(tok.encode("d")) == "abd"
    assert detok.push(tok.encode("ab")) == ""
    assert detok.finish() == "ab"
    assert detok.matched_stop is None


def test_earliest_stop_wins_and_stops_spanning_multibyte(tok: TextTokenizer) -> None:
    detok = tok.detokenizer(stops=["cd", "bcde", "世界"])
    assert "".join(_feed(detok, tok.encode("abcdef"), step=3)) == "a"
    assert detok.matched_stop == "bcde"
    detok = tok.detokenizer(stops=["世界"])
    assert "".join(_feed(detok, tok.encode("hi 世界!"))) == "hi "
    assert detok.matched_stop == "世界"


def test_stop_string_in_the_final_flush(tok: TextTokenizer) -> None:
    detok = tok.detokenizer(stops=["\ufffd"])
    assert detok.push([ord("a"), 0xE4]) == "a"
    assert detok.finish() == ""
    assert detok.matched_stop == "\ufffd"


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=60), cuts=st.lists(st.integers(1, 7), max_size=60))
def test_property_chunked_decoding_equals_whole_decoding(data: bytes, cuts: list[int]) -> None:
    detok = IncrementalDetokenizer(ByteTableStream([bytes([b]) for b in range(256)]))
    out, i = [], 0
    for c in cuts + [len(data)]:
        out.append(detok.push(list(data[i : i + c])))
        detok.check_integrity()
        i += c
    out.append(detok.finish())
    assert "".join(out) == data.decode("utf-8", errors="replace")


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abcé ", max_size=40),
    stops=st.lists(st.text(alphabet="abcé", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(1, 5), max_size=40),
)
def test_property_stop_matcher_equals_truncation_at_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    matcher = StopStringMatcher(stops)
    out, i = [], 0
    for c in cuts + [len(text)]:
        out.append(matcher.push(text[i : i + c]))
        matcher.check_integrity()
        i += c
    out.append(matcher.finish())
    hits = [(text.find(s), s) for s in stops if s in text]
    expected = text[: min(hits)[0]] if hits else text
    assert "".join(out) == expected
    assert (matcher.matched is not None) == bool(hits)


def _metaspace_tokenizer() -> Tokenizer:
    vocab = {"[UNK]": 0, "▁hello": 1, "▁world": 2, "!": 3}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    return t


def test_decode_stream_adapter_for_non_byte_level_tokenizers() -> None:
    t = _metaspace_tokenizer()
    ids = [1, 2, 3]
    detok = IncrementalDetokenizer(DecodeStreamAdapter(t, skip_special_tokens=True), stops=["ld!"])
    text = "".join(_feed(detok, ids)) + detok.finish()
    assert text == t.decode(ids)[: t.decode(ids).find("ld!")]
    assert detok.matched_stop == "ld!"


def test_byte_tables_follow_the_decoder_also_inside_a_sequence(model_dir: str) -> None:
    """A ByteLevel decoder, alone or chained (ByteLevel then Strip, as some checkpoints write it), decodes
    through the byte tables; another decoder, or none, through the tokenizers library."""
    path = f"{model_dir}/tokenizer.json"
    info = ModelInfo.from_dir(model_dir)
    for decoder, byte_level in ((decoders.ByteLevel(), True),
                                (decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 0, 0)]), True),
                                (decoders.Metaspace(), False), (None, False)):  # fmt: skip
        t = Tokenizer.from_file(path)
        t.decoder = decoder
        tok = TextTokenizer(t, {}, model_dir, info)
        ids = tok.encode("héllo wörld")
        assert isinstance(tok.detokenizer()._stream, ByteTableStream) == byte_level, decoder
        if byte_level:
            assert tok.decode(ids) == "héllo wörld"
