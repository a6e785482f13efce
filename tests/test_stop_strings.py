"""StopStringMatcher: stop strings are never leaked, whatever the chunking."""

from __future__ import annotations

import random

import pytest
from _tokenizers import smollm2_tokenizer

from minivllm.text.detokenizer import IncrementalDetokenizer
from minivllm.text.stop_strings import StopStringMatcher


def run(matcher: StopStringMatcher, chunks) -> tuple[str, bool, list[str]]:
    """Feed chunks until stopped; return (emitted text, stopped, emitted pieces)."""
    pieces = []
    stopped = False
    for c in chunks:
        out, stopped = matcher.feed(c)
        pieces.append(out)
        if stopped:
            break
    if not stopped:
        pieces.append(matcher.flush())
    return "".join(pieces), stopped, pieces


def reference(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Stop at the occurrence that completes first (ties: earliest start)."""
    best = None
    for s in stop:
        if not s:
            continue
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    if best is None:
        return text, None
    end, start, s = best
    return (text[:end] if include else text[:start]), s


def random_chunks(rng: random.Random, text: str) -> list[str]:
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(0, 4)
        chunks.append(text[i : i + n])
        i += n
    return chunks


def test_basic_stop():
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello wor") == ("Hello wor", False)
    assert m.feed("ld STOP here") == ("ld ", True)
    assert m.matched == "STOP" and m.stopped
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_stop_split_across_deltas_is_never_leaked():
    stop = "<|end|>"
    text = "The answer is 42.<|end|>garbage"
    for chunking in (list(text), ["The answer is 42.<", "|e", "nd", "|", ">garbage"], [text]):
        m = StopStringMatcher([stop])
        emitted, stopped, pieces = run(m, chunking)
        assert stopped and emitted == "The answer is 42."
        assert m.matched == stop
        # no emitted prefix ever contains the start of the stop string
        acc = ""
        for p in pieces:
            acc += p
            assert "<" not in acc


def test_hold_back_then_release():
    m = StopStringMatcher(["\nUser:"])
    assert m.feed("Hi\nUs") == ("Hi", False)
    assert m.held == "\nUs"
    assert m.feed("ually") == ("\nUsually", False)
    assert m.held == ""
    assert m.feed(" fine\n") == (" fine", False)
    assert m.feed("User: x") == ("", True)
    assert m.matched == "\nUser:"


def test_include_stop_str_in_output():
    m = StopStringMatcher(["</answer>"], include_stop_str_in_output=True)
    emitted, stopped, _ = run(m, ["42</ans", "wer> and more"])
    assert stopped and emitted == "42</answer>"
    assert m.matched == "</answer>"


def test_multiple_stop_strings_first_to_complete_wins():
    m = StopStringMatcher(["world", "lo w"])
    emitted, stopped, _ = run(m, ["hel", "lo world"])
    assert stopped and emitted == "hel" and m.matched == "lo w"
    m = StopStringMatcher(["bbb", "a"])
    assert run(m, ["xxbbbya"])[0] == "xx" and m.matched == "bbb"


@pytest.mark.parametrize("order", [["foo", "foobar"], ["foobar", "foo"]])
def test_stop_string_prefix_of_another(order):
    for chunks in (["xfoobar"], list("xfoobar"), ["xfo", "ob", "ar"]):
        m = StopStringMatcher(order)
        emitted, stopped, _ = run(m, chunks)
        assert stopped and emitted == "x" and m.matched == "foo"
    m = StopStringMatcher(order, include_stop_str_in_output=True)
    assert run(m, ["xfoob", "ar"])[0] == "xfoo"


def test_no_false_hold_back_at_end():
    m = StopStringMatcher(["<|end|>", "###"])
    out1, s1 = m.feed("Hello <|en")
    assert (out1, s1) == ("Hello ", False)
    out2, s2 = m.feed("d of text #")
    assert (out2, s2) == ("<|end of text ", False)
    assert m.held == "#"
    assert m.flush() == "#"
    assert m.flush() == ""
    assert m.matched is None and not m.stopped


def test_no_stops_and_empty_stops():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""
    m = StopStringMatcher(["", "x"])
    assert m.stop == ["x"]
    assert run(m, ["a", "bxc"])[0] == "ab"
    m = StopStringMatcher(None)
    assert m.feed("") == ("", False)


def test_stop_at_very_start_and_single_char_stops():
    m = StopStringMatcher(["\n"])
    assert m.feed("\nrest") == ("", True)
    m = StopStringMatcher(["."], include_stop_str_in_output=True)
    assert run(m, ["One", ". Two."])[0] == "One."


@pytest.mark.parametrize("max_stops", [3, 64])  # 64: the most a request may send, sharing prefixes galore
def test_random_chunkings_match_reference(max_stops):
    rng = random.Random(2024)
    alphabet = "ab c\n<>|"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stop = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4 if max_stops <= 3 else 7)))
            for _ in range(rng.randint(1, max_stops))
        ]
        include = rng.random() < 0.5
        m = StopStringMatcher(stop, include_stop_str_in_output=include)
        emitted, stopped, pieces = run(m, random_chunks(rng, text))
        want, matched = reference(text, stop, include)
        assert emitted == want, (text, stop, include)
        assert m.matched == matched and stopped == (matched is not None)
        if not include and matched:
            assert matched not in emitted


def test_with_detokenizer_stop_split_over_byte_tokens():
    tok = smollm2_tokenizer()
    text = "Answer: 日本語 is Japanese.\nUser: next question"
    ids = tok.encode(text, add_special_tokens=False)
    for stop, want in (
        (["\nUser:"], "Answer: 日本語 is Japanese."),
        (["本語"], "Answer: 日"),
        (["語 is"], "Answer: 日本"),
    ):
        detok = IncrementalDetokenizer(tok, [])
        m = StopStringMatcher(stop)
        out, stopped = "", False
        for t in ids:
            piece, stopped = m.feed(detok.append(t))
            out += piece
            assert stop[0] not in out and "\ufffd" not in out
            if stopped:
                break
        assert stopped and out == want and m.matched == stop[0]
