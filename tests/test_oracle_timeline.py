"""The per-slot oracle timeline: resets, appends, padding, epochs, late tokens."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kame.frontend.oracle import OracleOp, OracleTimeline, OracleUpdate, tokenize_words

START, PAD = 1000, 3


def timeline() -> OracleTimeline:
    return OracleTimeline(start_token=START, padding_token=PAD)


def test_padding_before_any_oracle():
    tl = timeline()
    assert [tl.token_at(f) for f in range(5)] == [PAD] * 5


def test_reset_then_append_then_padding():
    tl = timeline()
    tl.apply(OracleUpdate.reset(0, (10, 11)), frame=4)
    tl.apply(OracleUpdate.append(0, (12,)), frame=5)
    assert [tl.token_at(f) for f in range(3, 10)] == [PAD, START, 10, 11, 12, PAD, PAD]


def test_stale_append_is_dropped_and_reset_never():
    tl = timeline()
    tl.apply(OracleUpdate.reset(2, (20,)), frame=0)
    stale = tl.apply(OracleUpdate.append(1, (99,)), frame=0)
    assert not stale.accepted
    old_reset = tl.apply(OracleUpdate.reset(1, (30,)), frame=1)
    assert old_reset.accepted
    assert [tl.token_at(f) for f in range(1, 4)] == [START, 30, PAD]


def test_append_without_reset_is_dropped():
    tl = timeline()
    assert not tl.apply(OracleUpdate.append(0, (5,)), frame=0).accepted
    assert tl.token_at(0) == PAD


def test_late_tokens_are_counted():
    tl = timeline()
    tl.apply(OracleUpdate.reset(0, ()), frame=0)
    # frames 0..4 were consumed (start, then padding); an append at frame 5 lands at positions 1..3
    applied = tl.apply(OracleUpdate.append(0, (7, 8, 9)), frame=5)
    assert applied.late_tokens == 3
    applied = tl.apply(OracleUpdate.append(0, (10, 11, 12, 13)), frame=6)
    assert applied.late_tokens == 2  # positions 4 and 5 had passed; 12 and 13 are still ahead
    assert tl.token_at(6) == 12


def test_clear_forgets_everything():
    tl = timeline()
    tl.apply(OracleUpdate.reset(3, (1, 2)), frame=0)
    tl.clear()
    assert tl.token_at(1) == PAD
    assert not tl.apply(OracleUpdate.append(3, (4,)), frame=2).accepted


@given(
    start=st.integers(0, 50),
    tokens=st.lists(st.integers(4, 999), max_size=20),
    frame=st.integers(0, 100),
)
def test_token_at_matches_position(start, tokens, frame):
    tl = timeline()
    tl.apply(OracleUpdate.reset(0, tuple(tokens)), frame=start)
    expected = [START, *tokens]
    position = frame - start
    want = expected[position] if 0 <= position < len(expected) else PAD
    assert tl.token_at(frame) == want


class _WordTokenizer:
    def encode(self, text):
        return [len(text)] if not text.startswith(" ") else [-1]

    def id_to_piece(self, token):
        return str(token)


def test_tokenize_words_encodes_each_word_alone():
    assert tokenize_words(_WordTokenizer(), "  the capital   of France ") == [3, 7, 2, 6]


class _BytePieces:
    """A tokenizer whose pieces are SentencePiece's: word pieces, and byte-fallback pieces."""

    pieces = {1: "▁caf", 2: "<0xC3>", 3: "<0xA9>", 4: "▁ok", 5: "<0xE2>", 6: "<0x82>", 7: "<0xAC>", 8: "!"}

    def id_to_piece(self, token: int) -> str:
        return self.pieces[token]

    def vocab_size(self) -> int:
        return 9

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError


def test_byte_pieces_come_out_as_whole_characters():
    from kame.frontend.oracle import PieceDecoder

    decoder = PieceDecoder(_BytePieces())
    out = [decoder.push(t) for t in (1, 2, 3, 4, 5, 6, 7, 8)]
    assert out == [" caf", "", "é", " ok", "", "", "€", "!"]
    assert "".join(out) == " café ok€!"
    broken = PieceDecoder(_BytePieces())
    assert [broken.push(t) for t in (5, 4)] == ["", "\ufffd ok"]  # a character cut short is marked, not lost
    assert [decoder.push(t) for t in (9, 12000, -1, 4)] == ["", "", "", " ok"]  # ids the tokenizer lacks


def test_oracle_stream_clears_the_tail_of_a_longer_earlier_oracle():
    from kame.frontend.oracle import oracle_stream

    stream = oracle_stream([(1, (10, 11, 12, 13)), (4, (20,))], frames=8, start_token=START, padding_token=PAD)
    # the second reset at frame 4 replaces the first: 12 and 13 never appear after it
    assert stream == [PAD, START, 10, 11, START, 20, PAD, PAD]


def test_oracle_stream_orders_events_and_keeps_frames_before_the_first_padding():
    from kame.frontend.oracle import oracle_stream

    stream = oracle_stream([(5, (7,)), (2, (6, 6))], frames=7, start_token=START, padding_token=PAD)
    assert stream == [PAD, PAD, START, 6, 6, START, 7]
    assert oracle_stream([], frames=3, start_token=START, padding_token=PAD) == [PAD] * 3


def test_a_frame_output_becomes_audio_then_its_text_then_the_updates_it_applied():
    from kame.engine_events import FrameEvents
    from kame.frontend.engine import FrameOutput
    from kame.frontend.oracle import AppliedUpdate, OracleUpdate
    from kame.session_events import AssistantAudio, AssistantText, OracleApplied

    frames = FrameEvents(_BytePieces())
    pcm = np.zeros(1920, dtype=np.float32)
    reset = OracleUpdate(epoch=2, op=OracleOp.RESET, tokens=(7, 8), text="hi there")
    stale = OracleUpdate(epoch=1, op=OracleOp.APPEND, tokens=(9,), text="old")
    first = frames.of(FrameOutput(0, 4, pcm, True, 5, 0, (AppliedUpdate(reset, 4, True, 1),
                                                          AppliedUpdate(stale, 4, False))), 0.05)
    assert [type(e) for e in first] == [AssistantAudio, OracleApplied, OracleApplied]  # byte 5 waits for 4's end
    assert first[0].frame == 4 and first[0].ready and first[0].latency_s == 0.05
    assert first[1] == OracleApplied("reset", 2, "hi there", 2, 4, True, 1)
    assert first[2] == OracleApplied("append", 1, "old", 1, 4, False, 0)
    second = frames.of(FrameOutput(0, 5, pcm, True, 4, 0), None)
    assert second[1:] == [AssistantText(5, "\ufffd ok")]  # the decoder's state carries from frame to frame
    assert frames.of(FrameOutput(0, 6, pcm, False, None, 0), None)[1:] == []
    assert FrameEvents(None).of(FrameOutput(0, 7, pcm, True, 4, 0), None)[1:] == []  # no tokenizer, no text
