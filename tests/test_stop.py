"""StopStringMatcher: stop strings are never emitted, also when split across chunks."""

from __future__ import annotations

from worker.engine.stop import StopStringMatcher


def run(matcher: StopStringMatcher, chunks: list[str]) -> tuple[list[str], bool]:
    """Feed chunks until a stop hits; return the emitted pieces (flush last) and the hit."""
    emitted = []
    for chunk in chunks:
        text, hit = matcher.feed(chunk)
        emitted.append(text)
        if hit:
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


def test_stop_inside_one_chunk() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("hello ") == ("hello ", False)
    assert matcher.feed("worldSTOPmore") == ("world", True)


def test_stop_split_across_two_chunks() -> None:
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("abc</") == ("abc", False)
    assert matcher.feed("s>tail") == ("", True)


def test_stop_split_across_three_chunks() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("x E") == ("x ", False)
    assert matcher.feed("N") == ("", False)
    assert matcher.feed("Dy") == ("", True)


def test_false_partial_match_is_released_later() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("a EN") == ("a ", False)
    assert matcher.feed("X") == ("ENX", False)
    assert matcher.feed("b") == ("b", False)
    assert matcher.flush() == ""


def test_partial_match_restarting_inside_held_text() -> None:
    # "aab" with stop "ab": the held "a" is released, the second "a" starts the real match
    matcher = StopStringMatcher(["ab"])
    assert matcher.feed("a") == ("", False)
    assert matcher.feed("a") == ("a", False)
    assert matcher.feed("bc") == ("", True)


def test_multiple_stop_strings_earliest_wins() -> None:
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.feed("hello world") == ("hel", True)
    matcher = StopStringMatcher(["zz", "y"])
    assert matcher.feed("ab") == ("ab", False)
    assert matcher.feed("z") == ("", False)  # could be "zz"
    assert matcher.feed("y") == ("z", True)  # "y" matched; the lone "z" was text


def test_earliest_wins_even_when_later_stop_is_listed_first() -> None:
    emitted, hit = run(StopStringMatcher(["cd", "b"]), ["a", "bcd"])
    assert hit and "".join(emitted) == "a"


def test_include_stop() -> None:
    matcher = StopStringMatcher(["END"], include_stop=True)
    assert matcher.feed("abcE") == ("abc", False)
    assert matcher.feed("NDxyz") == ("END", True)
    matcher = StopStringMatcher(["\n"], include_stop=True)
    assert matcher.feed("line\nnext") == ("line\n", True)


def test_flush_at_end_releases_held_text() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("the ST") == ("the ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.flush() == "STO"
    assert matcher.flush() == ""


def test_empty_stop_list_passes_text_through() -> None:
    for stops in ([], [""]):
        matcher = StopStringMatcher(stops)
        assert matcher.feed("any S") == ("any S", False)
        assert matcher.feed("") == ("", False)
        assert matcher.flush() == ""


def test_stop_at_very_start() -> None:
    matcher = StopStringMatcher(["Hi"])
    assert matcher.feed("Hi there") == ("", True)
    matcher = StopStringMatcher(["Hi"])
    assert matcher.feed("H") == ("", False)
    assert matcher.feed("i") == ("", True)


def test_emitted_text_never_contains_a_stop() -> None:
    text = "one two, three; four five. END six"
    for size in (1, 2, 3, 5):
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        emitted, hit = run(StopStringMatcher([". END", ";"]), chunks)
        assert hit
        assert "".join(emitted) == "one two, three"
        emitted, hit = run(StopStringMatcher(["not there"]), chunks)
        assert not hit
        assert "".join(emitted) == text
