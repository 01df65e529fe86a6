"""The user's transcript as GPT-Live's append-only deltas: a word goes out once it is stable."""

from __future__ import annotations

import pytest

from server.stable_text import Keepalive, StableWords


def test_a_word_goes_out_once_two_partials_agree_and_it_is_not_among_the_newest():
    words = StableWords(hold=2)
    assert words.partial("what") == ""
    assert words.partial("what is") == ""
    assert words.partial("what is the") == "what"  # agreed by two partials, two newer words held back
    assert words.partial("what is the capital") == " is"
    assert words.partial("what is the capital of france") == " the capital"
    assert words.final("What is the capital of France?") == " of France?"


def test_the_newest_words_may_be_revised_before_they_go_out():
    words = StableWords(hold=1)
    sent = [words.partial("the cat"), words.partial("the cats at"), words.partial("the cat sat on")]
    assert sent == ["", "the", ""]  # "cat"/"cats" disagreed twice: held
    assert words.partial("the cat sat on the") == " cat sat on"
    assert words.final("the cat sat on the mat") == " the mat"


def test_case_and_punctuation_changes_do_not_unsettle_a_word():
    words = StableWords(hold=0)
    assert words.partial("hello there") == ""
    assert words.partial("Hello, there.") == "Hello, there."


def test_a_revision_of_words_already_sent_goes_on_from_the_same_count():
    words = StableWords(hold=0)
    words.partial("I scream")
    assert words.partial("I scream now") == "I scream"
    # the ASR now hears "ice cream": the sent words stay, the deltas go on by count
    assert words.final("ice cream now please") == " now please"


def test_utterances_follow_one_another_with_a_space_and_a_short_final_sends_nothing():
    words = StableWords(hold=1)
    deltas = [words.final("hello"), words.partial("how are"), words.partial("how are you"),
              words.final("how"),  # nothing new: the final is shorter than what went out
              words.final("fine")]
    assert deltas == ["hello", "", " how are", "", " fine"]
    assert "".join(deltas) == "hello how are fine"


def test_every_word_goes_out_exactly_once_and_in_order():
    """Whatever the partials, the deltas joined are the final's words past those already sent."""
    import random

    rng = random.Random(7)
    vocabulary = ["a", "b", "c", "d", "e"]
    for _ in range(200):
        words = StableWords(hold=rng.randint(0, 3))
        final = [rng.choice(vocabulary) for _ in range(rng.randint(1, 8))]
        out = ""
        for n in range(1, len(final) + 1):  # growing partials, their newest word sometimes misheard
            heard = final[:n - 1] + [rng.choice(vocabulary)]
            out += words.partial(" ".join(heard))
        out += words.final(" ".join(final))
        assert out.split() == final, (out, final)  # the stable prefix agreed with the final here


def test_hold_must_not_be_negative():
    with pytest.raises(ValueError):
        StableWords(hold=-1)


def test_a_settled_partial_sends_every_word_and_the_utterance_goes_on():
    words = StableWords(hold=2)
    assert words.partial("what is") == ""
    assert words.partial("what is the", settled=True) == "what is the"  # the speech paused
    assert words.open  # the client's user turn is open until the final
    assert words.partial("what is the capital") == ""  # the utterance goes on: held again
    assert words.partial("what is the capital of france") == " capital"
    assert words.final("what is the capital of france") == " of france" and not words.open


def test_a_space_sent_ahead_is_the_next_words_separator():
    words = StableWords(hold=0)
    deltas = [words.partial("so what"), words.partial("so what"), words.space(), words.space()]
    deltas += [words.partial("so what is"), words.partial("so what is"), words.final("so what is the capital")]
    assert deltas == ["", "so what", " ", " ", "", "is", " the capital"]
    assert "".join(deltas).split() == ["so", "what", "is", "the", "capital"]


def test_the_keepalive_is_due_while_the_turn_is_open_and_words_came_lately():
    keep = Keepalive(every_s=0.25, for_s=1.0)
    assert keep.due() == () and not keep.fire(10.0, True)
    keep.sent(10.0, words=True, open_turn=True)
    assert keep.due() == (10.25,) and not keep.fire(10.2, True)
    spaces = []
    for now in (10.25, 10.5, 10.75, 11.0, 11.25):  # the space goes out each time, and sent() schedules the next
        if keep.fire(now, True):
            spaces.append(now)
            keep.sent(now, words=False, open_turn=True)
    assert spaces == [10.25, 10.5, 10.75, 11.0]  # a second without words: the turn is the client's to end
    assert keep.due() == ()
    keep.sent(12.0, words=True, open_turn=True)
    assert keep.fire(12.25, False) is False  # the final came meanwhile: no space
    keep.sent(13.0, words=True, open_turn=False)  # a final with words
    assert keep.due() == ()


def test_a_final_with_more_or_fewer_words_than_those_sent_sends_none_twice():
    """Whisper's final decodes the whole utterance again: its words are aligned with those sent, and only
    those after them go out (by count, "France?" would have gone out twice)."""
    words = StableWords(hold=1)
    assert words.partial("So what's the", settled=True) == "So what's the"
    assert words.final("So what is the capital of France?") == " capital of France?"
    assert words.partial("what is the capital", settled=True) == " what is the capital"
    assert words.final("What's the capital of Spain?") == " of Spain?"

