"""The step policies' decisions (`TickPolicy`, `EagerPolicy`) on a manual time: a simulated engine and
simulated real-time sessions, no thread and no sleep. What each test promises is about time (phase,
waits, catch-up after a stall, the eager window), so it is checked here exactly rather than on this VM's
noisy real clock."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import pytest

from kame.frontend.slots import SlotInbox, Stamped
from kame.frontend.step_policy import EagerPolicy, StepPolicy, TickPolicy, make_policy

FRAME_S = 0.08


@dataclass
class Run:
    steps: int = 0
    frames_in: int = 0
    skipped: int = 0
    waits: list[float] = field(default_factory=list)  # arrival -> the start of the step that took it
    backlog: list[tuple[float, int]] = field(default_factory=list)  # (step start, most frames a live slot held)
    reasons: list[str] = field(default_factory=list)


def simulate(arrivals: list[list[float]], step_s=lambda index, t: 0.015, jitter_frames: int = 3,
             live: list[bool] | None = None, policy: StepPolicy | None = None) -> Run:
    """Drive a policy (the tick's unless given) as EngineRunner does: `arrivals[i]` are session i's push
    times; each step takes `step_s(step index, start)` and takes one frame of every slot that holds one."""
    policy = TickPolicy(FRAME_S) if policy is None else policy
    inboxes = [SlotInbox(1, lambda out: None, None, True if live is None else live[i]) for i in range(len(arrivals))]
    events = sorted((t, i) for i, times in enumerate(arrivals) for t in times)
    run, now, index = Run(frames_in=len(events)), 0.0, 0
    while index < len(events) or any(inbox.frames for inbox in inboxes):
        while index < len(events) and events[index][0] <= now:
            at, slot = events[index]
            inboxes[slot].frames.append(Stamped(1, at))
            policy.arrived(inboxes[slot], at)
            index += 1
        reason = policy.reason(inboxes, now) if isinstance(policy, TickPolicy) else "eager"  # why: recorded here only
        at = policy.next_step(inboxes, sum(bool(inbox.frames) for inbox in inboxes), now)
        if at is not None and at <= now:
            run.reasons.append(reason)
            run.backlog.append((now, max(len(inbox.frames) for inbox in inboxes if inbox.live)))
            for inbox in inboxes:
                if inbox.live and len(inbox.frames) > jitter_frames:
                    while len(inbox.frames) > jitter_frames:
                        inbox.frames.popleft()
                        run.skipped += 1
                if inbox.frames:
                    run.waits.append(now - inbox.frames.popleft().value)
            now += step_s(run.steps, now)
            run.steps += 1
            continue
        following = events[index][0] if index < len(events) else math.inf
        now = min(following, at if at is not None else math.inf)
    return run


def periodic(phase_s: float, seconds: float, every: int = 1) -> list[float]:
    """A real-time client: a frame every FRAME_S from `phase_s` on (or `every` frames at once)."""
    frames = round(seconds / FRAME_S)
    return [phase_s + (k - k % every + every - 1) * FRAME_S for k in range(frames)]


def best_mean_wait(phases: list[float]) -> float:
    """The least mean wait one step per frame can give these arrival phases: the step just after one."""
    return min(statistics.mean((s - p) % FRAME_S for p in phases) for s in phases)


def test_out_of_phase_sessions_get_one_step_per_frame_placed_just_after_their_arrivals():
    phases = [0.0, 0.007, 0.046]  # a cluster and a loner: stepping after the loner would wait 30 ms more
    run = simulate([periodic(p, 8.0) for p in phases])
    assert run.skipped == 0 and len(run.waits) == run.frames_in
    assert run.steps / (run.frames_in / len(phases)) <= 1.02  # one batched step per frame
    settled = run.waits[len(run.waits) // 4:]  # once the phases are learnt
    assert statistics.mean(settled) <= best_mean_wait(phases) + 0.006  # within the "just after" margin


def test_eight_sessions_spread_over_the_frame_wait_no_more_than_the_spread_forces():
    phases = [i * 0.01 for i in range(8)]
    run = simulate([periodic(p, 6.0) for p in phases])
    assert run.steps / (run.frames_in / 8) <= 1.02
    assert statistics.mean(run.waits[len(run.waits) // 4:]) <= best_mean_wait(phases) + 0.006  # 35 ms + margin


def test_after_a_stall_every_slot_is_caught_up_within_a_few_ticks_and_no_audio_is_lost():
    phases = [0.0, 0.021, 0.052]
    stalled: list[float] = []

    def step_s(index: int, start: float) -> float:
        if start >= 3.0 and not stalled:  # one step held up for 0.21 s (a decode holding the CPU)
            stalled.append(start + 0.21)
            return 0.21
        return 0.015

    run = simulate([periodic(p, 6.0) for p in phases], step_s)
    assert run.skipped == 0 and len(run.waits) == run.frames_in  # the backlog fits jitter_frames: caught up
    behind = [(t, held) for t, held in run.backlog if t >= stalled[0]]
    assert behind[0][1] >= 3  # the stall left frames waiting ...
    caught_up = next(t for t, held in behind if held <= 1)
    assert caught_up - stalled[0] <= 3 * FRAME_S  # ... and within three ticks no slot is behind
    assert all(held <= 1 for t, held in behind if t > caught_up + FRAME_S)  # for good: no standing backlog
    assert "behind" in run.reasons
    assert run.steps / (run.frames_in / 3) <= 1.1  # the catch-up steps stand in for the ticks the stall missed


def test_a_standing_late_frame_does_not_stay_late():
    # session 1 sends one frame late (at 2 s), then on time: under the old rule it stayed a frame
    # behind for good; now the frame after it finds it holding two, and both are stepped at once
    arrivals = [periodic(0.0, 5.0), sorted(periodic(0.03, 5.0)[:25] + [2.0 + 0.03 + 0.05] + periodic(0.03, 5.0)[26:])]
    run = simulate(arrivals)
    assert run.skipped == 0
    assert max(run.waits[-20:]) < FRAME_S  # no frame of either session waits a whole frame at the end


def test_a_client_that_stops_sending_holds_nobody_up():
    # three sessions; the third sends for 2 s and then goes quiet (muted) while the others go on
    arrivals = [periodic(0.0, 6.0), periodic(0.01, 6.0), periodic(0.05, 2.0)]
    run = simulate(arrivals)
    late_waits = run.waits[-30:]  # the two left: stepped once both have their frame, not at an old tick
    assert statistics.mean(late_waits) <= best_mean_wait([0.0, 0.01]) + 0.006


def test_an_engine_slower_than_real_time_skips_to_live_and_stays_there():
    run = simulate([periodic(0.0, 4.0), periodic(0.04, 4.0)], step_s=lambda index, t: 0.12)  # 1.5 frames a step
    assert run.skipped > 0.2 * run.frames_in  # it cannot keep up on average: audio is dropped, counted ...
    assert max(run.waits) <= 4 * 0.12  # ... and the latency stays bounded by the jitter budget
    assert run.steps <= (4.0 + 4 * 0.12) / 0.12 + 1  # back to back (the last backlog too), no more


def test_a_self_paced_slot_is_never_caught_up_on_its_own():
    # a client sending faster than real time (live=False) holds many frames: that is not "behind"
    fast = [0.0] * 30
    run = simulate([periodic(0.0, 2.0), fast], live=[True, False])
    assert run.reasons.count("behind") == 0
    assert run.skipped == 0


def test_the_phase_follows_the_sessions_and_sleeps_while_idle():
    schedule = TickPolicy(FRAME_S)
    inbox = SlotInbox(1, lambda out: None, None)
    assert schedule.reason([inbox], 0.0) is None  # no frame: nothing to do, whenever
    for k in range(10):  # a client at phase 30 ms
        t = 100 * FRAME_S + 0.03 + k * FRAME_S
        inbox.frames.append(Stamped(1, None))
        schedule.arrived(inbox, t)
        reason = schedule.reason([inbox], t)
        assert reason in ("due", "ready")  # alone and ready: stepped at once
        schedule.stepped(reason, [inbox], t)
        inbox.frames.popleft()
    assert schedule.phase_s == pytest.approx(0.03 + schedule.margin_s, abs=1e-6)
    assert schedule.next_tick % FRAME_S == pytest.approx(0.03 + schedule.margin_s, abs=1e-6)
    schedule.idle()
    inbox.frames.append(Stamped(1, None))
    assert schedule.reason([inbox], 1e6) == "due"  # after idle the next frame goes at once


# ------------------------------------------------------------------ the eager policy

WINDOW_S = 0.02


def test_eager_steps_once_every_sending_slot_has_its_frame_or_when_the_window_closes():
    policy = EagerPolicy(FRAME_S, WINDOW_S)
    a, b, quiet = (SlotInbox(1, lambda out: None, None) for _ in range(3))
    slots = [a, b, quiet]
    assert policy.next_step(slots, 0, 10.0) is None  # no frame: sleep until a push
    quiet.last_arrival = 10.0 - 3 * FRAME_S  # went quiet three frames ago: nobody waits for it
    for inbox, at in ((a, 10.0), (b, 10.0)):
        inbox.frames.append(Stamped(1, None))
        policy.arrived(inbox, at)
    b.frames.clear()  # b sent lately but holds nothing now: the first frame waits for it
    assert policy.next_step(slots, 1, 10.0) == pytest.approx(10.0 + WINDOW_S)
    assert policy.next_step(slots, 1, 10.005) == pytest.approx(10.0 + WINDOW_S)  # the window does not move
    assert policy.next_step(slots, 2, 10.008) == 10.008  # b's frame came: step now
    assert policy.next_step(slots, 1, 10.1) == pytest.approx(10.1 + WINDOW_S)  # a new window
    assert policy.next_step(slots, 1, 10.1 + WINDOW_S) <= 10.1 + WINDOW_S  # closed: the lone frame goes
    assert policy.wakes(a, slots, 10.2)  # every push may be the frame the window waits for


def test_eager_steps_what_it_gathered_before_a_command_and_the_tick_lets_it_go_first():
    policy = EagerPolicy(FRAME_S, WINDOW_S)
    a, b = SlotInbox(1, lambda out: None, None), SlotInbox(1, lambda out: None, None)
    a.frames.append(Stamped(1, None))
    policy.arrived(a, 5.0)
    policy.arrived(b, 5.0)  # b is sending, its frame not in yet
    assert policy.next_step([a, b], 1, 5.0) > 5.0
    assert policy.interrupt()  # a release came in the window: a's frame is stepped first ...
    assert not policy.interrupt()  # ... once: the window is closed
    assert not TickPolicy(FRAME_S).interrupt()


def test_eager_gives_out_of_phase_sessions_their_own_steps_each_within_the_window():
    phases = [i * 0.01 for i in range(8)]
    tick = simulate([periodic(p, 6.0) for p in phases])
    eager = simulate([periodic(p, 6.0) for p in phases], policy=EagerPolicy(FRAME_S, WINDOW_S))
    assert eager.skipped == 0 and len(eager.waits) == eager.frames_in
    assert eager.steps > 1.3 * tick.steps  # arrival-driven: the price of the shorter wait
    assert max(eager.waits) <= WINDOW_S + 0.015 + 1e-9  # the window, plus a step in progress
    assert statistics.mean(eager.waits) < statistics.mean(tick.waits[len(tick.waits) // 4:])


def test_eager_steps_sessions_in_phase_together_at_once():
    run = simulate([periodic(0.0, 6.0) for _ in range(4)], policy=EagerPolicy(FRAME_S, WINDOW_S))
    assert run.steps == run.frames_in / 4  # one batched step per frame
    assert max(run.waits) == 0.0  # the last of them completes the batch: no window waited out


def test_eager_does_not_wait_for_a_client_that_stopped_sending():
    arrivals = [periodic(0.0, 6.0), periodic(0.01, 6.0), periodic(0.05, 2.0)]
    run = simulate(arrivals, policy=EagerPolicy(FRAME_S, WINDOW_S))
    assert max(run.waits[-30:]) <= 0.01 + 1e-9  # the two left wait for each other only


def test_the_policy_is_named_once_and_auto_is_resolved_before():
    assert isinstance(make_policy("tick", FRAME_S, WINDOW_S), TickPolicy)
    eager = make_policy("eager", FRAME_S, WINDOW_S)
    assert isinstance(eager, EagerPolicy) and eager.batch_window_s == WINDOW_S
    with pytest.raises(ValueError, match="'tick' or 'eager'"):
        make_policy("auto", FRAME_S, WINDOW_S)  # type: ignore[arg-type]  # kame/runtime.py resolves it
