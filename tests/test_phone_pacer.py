"""The phone pacer (server/phone/pacer.py): the assistant's frames go out at most `lead_frames` ahead of
what the carrier says has played (its marks), a clear drops the rest and says what was heard, and a
carrier without marks (or whose marks stop) is paced on the session's clock."""

from __future__ import annotations

from server.phone.pacer import MARKS_SILENT_S, Pacer

F = 0.08  # a frame


def sent(out) -> list[tuple[str | None, int]]:
    return [(o.mark, o.frame) for o in out]


def test_frames_go_out_two_ahead_of_the_marks():
    pacer = Pacer(lead_frames=2, max_waiting=8)
    for frame in range(10, 16):  # a burst of six frames (an engine catching up)
        pacer.push(f"audio{frame}", frame)
    assert sent(pacer.take(0.0)) == [("1", 10), ("2", 11)]
    assert pacer.take(0.01) == [] and pacer.lead() == 2 and pacer.waiting == 4
    pacer.marked("1", F)  # the first has played
    assert sent(pacer.take(F)) == [("3", 12)] and pacer.heard_frame == 10
    pacer.marked("3", 3 * F)  # marks come back in order: "3" says 2 and 3 have played
    assert sent(pacer.take(3 * F)) == [("4", 13), ("5", 14)]
    assert pacer.heard_frame == 12 and pacer.max_lead == 2
    pacer.marked("not ours", 3 * F)  # ignored
    assert pacer.lead() == 2


def test_a_clear_drops_what_waits_and_says_what_was_heard():
    pacer = Pacer(lead_frames=2, max_waiting=8)
    for frame in range(6):
        pacer.push(frame, frame)
    pacer.take(0.0)
    pacer.marked("1", F)
    pacer.take(F)  # frames 0..2 sent, 0 heard
    assert pacer.clear(F + 0.01) == 0
    assert pacer.waiting == 0 and pacer.lead() == 0
    pacer.marked("2", 2 * F)  # the carrier's marks for the audio the clear dropped: nothing changes
    pacer.marked("3", 2 * F)
    assert pacer.heard_frame == 0
    pacer.push(40, 40)  # the assistant goes on: at once, with a fresh lead
    assert sent(pacer.take(2 * F)) == [("4", 40)]
    pacer.marked("4", 3 * F)
    assert pacer.heard_frame == 40


def test_without_marks_the_clock_keeps_the_lead():
    pacer = Pacer(lead_frames=2, marks=False, max_waiting=8)
    for frame in range(8):
        pacer.push(frame, frame)
    assert sent(pacer.take(0.0)) == [(None, 0), (None, 1)]
    assert pacer.take(F / 2) == []
    assert pacer.wake_at(F / 2) == F  # when the first has played
    assert sent(pacer.take(F)) == [(None, 2)]
    assert sent(pacer.take(3 * F)) == [(None, 3), (None, 4)]  # late: two played meanwhile, two go
    assert pacer.max_lead == 2 and pacer.heard_frame == 2


def test_marks_that_stop_coming_leave_the_pacing_to_the_clock():
    pacer = Pacer(lead_frames=2, max_waiting=40)
    for frame in range(40):
        pacer.push(frame, frame)
    pacer.take(0.0)  # two out; their marks never come
    assert pacer.take(1.0) == []
    assert pacer.wake_at(1.0) == MARKS_SILENT_S  # the marks' silence is given up on then
    out = pacer.take(MARKS_SILENT_S + 0.01)
    assert [o.frame for o in out] == [2, 3] and pacer.lead() == 2  # on the clock, still two ahead
    assert pacer.wake_at(MARKS_SILENT_S + 0.01) is not None and pacer.wake_at(MARKS_SILENT_S + 0.01) > MARKS_SILENT_S


def test_frames_piling_up_behind_the_lead_are_dropped_oldest_first():
    """Frames come as fast as the carrier plays them: a burst (a stalled step caught up) that waited would
    be a delay for the rest of the call, so what waits past `max_waiting` is dropped, oldest first."""
    pacer = Pacer(lead_frames=2)  # max_waiting: the lead's own 2
    out = []
    for frame in range(6):  # six frames at once, each pushed and pumped as the call does
        pacer.push(frame, frame)
        out += pacer.take(0.0)
    assert sent(out) == [("1", 0), ("2", 1)] and pacer.waiting == 2 and pacer.dropped == 2
    pacer.marked("2", 2 * F)  # both played: the newest two go, not the ones behind them
    assert sent(pacer.take(2 * F)) == [("3", 4), ("4", 5)]
    for frame in range(6, 10):  # then real time: a frame and a mark every 80 ms, nothing dropped
        pacer.marked(str(frame - 3), (frame - 3) * F)
        pacer.push(frame, frame)
        assert [o.frame for o in pacer.take((frame - 3) * F)] == [frame]
    assert pacer.dropped == 2 and pacer.lead() == 2
