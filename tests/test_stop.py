"""StopChecker: stop strings across pushes, held-back prefixes, flush, against a brute-force model."""
from __future__ import annotations

import random

import pytest

from engine.stop import StopChecker


def run(stop, pieces, include=False):
    """Emitted text, whether it stopped, and what flush returns at the end."""
    sc = StopChecker(stop, include)
    out, stopped = [], False
    for p in pieces:
        text, stopped = sc.push(p)
        out.append(text)
        if stopped:
            break
    return "".join(out), stopped, sc.flush()


def test_stop_within_one_push():
    assert run(["STOP"], ["hello STOP world"]) == ("hello ", True, "")


def test_stop_spanning_pushes_is_not_emitted():
    sc = StopChecker(["</s>"])
    assert sc.push("abc<") == ("abc", False)
    assert sc.push("/") == ("", False)
    assert sc.push("s") == ("", False)
    assert sc.push(">tail") == ("", True)
    assert sc.matched == "</s>" and sc.stopped
    assert sc.push("more") == ("", True)
    assert sc.flush() == ""


def test_overlapping_prefix_ababc():
    sc = StopChecker(["abc"])
    emitted = [sc.push(c) for c in "ababc"]
    assert emitted == [("", False), ("", False), ("ab", False), ("", False), ("", True)]
    assert run(["abc"], ["ab", "ab", "c"]) == ("ab", True, "")
    assert run(["aab"], ["a", "a", "a", "b"]) == ("a", True, "")


def test_with_include_the_stop_string_ends_the_text():
    assert run(["STOP"], ["hello STOP world"], include=True) == ("hello STOP", True, "")
    sc = StopChecker(["</s>"], include=True)
    assert [sc.push(p) for p in ("abc<", "/", "s", ">tail")] == [("abc", False), ("", False), ("", False),
                                                                 ("</s>", True)]
    assert sc.push("more") == ("", True) and sc.flush() == ""
    # the earliest stop string wins, whole; of two that begin there, the one that ends first
    assert run(["lo world", "lo w"], ["hello world"], include=True) == ("hello w", True, "")
    assert run(["world", "lo w"], ["hello world"], include=True) == ("hello w", True, "")


def test_false_start_is_released_as_soon_as_it_cannot_match():
    sc = StopChecker(["abc"])
    assert sc.push("xab") == ("x", False)
    assert sc.push("d") == ("abd", False)
    assert sc.push("a") == ("", False)
    assert sc.flush() == "a"


def test_multiple_stops_earliest_wins():
    assert run(["world", "lo w"], ["hello world"]) == ("hel", True, "")
    assert run(["xyz", "o"], ["hel", "lo"]) == ("hell", True, "")
    sc = StopChecker(["END", "\n\n"])
    assert sc.push("a\n") == ("a", False)
    assert sc.push("\nb") == ("", True)
    assert sc.matched == "\n\n"


def test_under_min_tokens_a_stop_string_is_text_and_one_that_ends_after_it_stops():
    sc = StopChecker(["ccc"])
    assert sc.push("ccc", may_stop=False) == ("c", False)     # passed, but "cc" may begin one
    assert sc.push("c", may_stop=False) == ("c", False)
    assert sc.push("c", may_stop=True) == ("", True)          # "cc" + "c": begun before, ended after
    sc = StopChecker(["ab", "xaby"])
    assert sc.push("xab", may_stop=False) == ("", False)      # "ab" passed; "xab" may begin "xaby"
    assert sc.push("z", may_stop=True) == ("xabz", False)     # the passed "ab" does not stop it later


def test_held_back_text_is_flushed_at_the_end():
    sc = StopChecker(["STOP"])
    assert sc.push("the ST") == ("the ", False)
    assert sc.push("O") == ("", False)
    assert sc.flush() == "STO"
    assert sc.flush() == ""


def test_no_stops_pass_through_without_copy():
    sc = StopChecker([])
    s = "some text " * 10
    out, stopped = sc.push(s)
    assert out is s and not stopped
    assert sc.flush() == ""


def test_unicode_and_empty_deltas():
    sc = StopChecker(["。」"])
    assert sc.push("") == ("", False)
    assert sc.push("日本語。") == ("日本語", False)
    assert sc.push("」後") == ("", True)


def _model(stops, pieces, include=False):
    """Brute force: after each push, cut at the earliest stop occurrence in all text so far (after it, with
    include: the first of the stop strings found there that ends soonest)."""
    text = ""
    for p in pieces:
        text += p
        hits = [(text.find(s), len(s)) for s in stops if s in text]
        if hits:
            at = min(i for i, _ in hits)
            return text[:at + min(n for i, n in hits if i == at)] if include else text[:at], True
    return text, False


@pytest.mark.parametrize("trial", range(4))
def test_random_streams_match_brute_force(trial):
    seed = random.randrange(1 << 30)
    r = random.Random(seed)
    for _ in range(300):
        stops = ["".join(r.choice("ab") for _ in range(r.randint(1, 4))) for _ in range(r.randint(1, 3))]
        text = "".join(r.choice("abc") for _ in range(r.randint(0, 20)))
        cuts = sorted(r.sample(range(len(text) + 1), min(len(text) + 1, r.randint(0, 8))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        include = r.random() < 0.5
        sc = StopChecker(stops, include)
        emitted, stopped, so_far = "", False, ""
        for p in pieces:
            so_far += p
            out, stopped = sc.push(p)
            emitted += out
            if stopped:
                break
            # what is held is exactly the longest tail that could still begin a stop string
            held = so_far[len(emitted):]
            assert so_far.startswith(emitted), (seed, stops, pieces)
            longest = max((k for k in range(1, len(so_far) + 1)
                           if any(len(s) > k and s.startswith(so_far[-k:]) for s in stops)), default=0)
            assert len(held) == longest, (seed, stops, pieces, emitted)
        if not stopped:
            emitted += sc.flush()
        assert (emitted, stopped) == _model(stops, pieces, include), (seed, stops, pieces, include)
