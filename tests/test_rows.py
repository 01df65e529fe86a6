"""A step runs the live sessions' rows only: views of the first rows, a leaving session's hole filled by
the last row, and every session still equal to running alone (kame/frontend/rows.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moshi.modules.streaming import State, StreamingModule

from kame.frontend.engine import BatchedEngine, GenerationConfig
from kame.frontend.oracle import OracleUpdate
from kame.frontend.rows import RowsUnsupported, RowViews, SlotRows, row_buckets
from kame.frontend.sampling import Sampling

from .conftest import noise_frames
from .test_engine import GREEDY, assert_same, run_alone

GREEDY_SLOT = Sampling(text_temperature=0.0, audio_temperature=0.0)


def test_one_session_on_sixteen_slots_steps_one_row(tiny, rng):
    engine = BatchedEngine(tiny, batch_size=16, gen=GREEDY)
    try:
        assert engine.compact
        a = engine.acquire()
        engine.step({a: noise_frames(rng, 1)[0]})
        assert engine.live_rows == 1
        assert engine._state.batch_size == 1 and engine._state.cache.shape[0] == 1
        assert tiny.lm.transformer.layers[0].self_attn._streaming_state.kv_cache.cache.shape[1] == 1
        assert tiny.mimi._streaming_state.batch_size == 1
        b, c = engine.acquire(), engine.acquire()
        engine.step({a: noise_frames(rng, 1)[0], c: noise_frames(rng, 1)[0]})
        assert engine._state.batch_size == 3  # b sent nothing this step: its row is masked, not dropped
        engine.release(b)
        engine.step({a: noise_frames(rng, 1)[0], c: noise_frames(rng, 1)[0]})
        assert engine._state.batch_size == 2
    finally:
        engine.close()


def _schedule_run(frontend, gen, sampling, ticks, joins, leaves, frames, oracles, kv_cache="model"):
    """Occupants (names) join and leave a 4-slot engine at given ticks; each one's outputs in order.
    `joins`: tick -> names; `leaves`: tick -> names; frames[name]: its frames from its own start."""
    engine = BatchedEngine(frontend, batch_size=4, gen=gen, kv_cache=kv_cache)
    slot_of, got, rows_seen = {}, {}, []
    try:
        for tick in range(ticks):
            for name in leaves.get(tick, ()):
                engine.release(slot_of.pop(name))
            for name in joins.get(tick, ()):
                slot_of[name] = engine.acquire(sampling.get(name))
                got[name] = []
            feed = {}
            for name, slot in slot_of.items():
                index = engine.frame_index(slot)
                if index in oracles.get(name, {}):
                    engine.push_oracle(slot, oracles[name][index])
                feed[slot] = frames[name][index]
            for out in engine.step(feed):
                got[next(n for n, s in slot_of.items() if s == out.slot)].append(out)
            rows_seen.append(engine._state.batch_size)
    finally:
        engine.close()
    return got, rows_seen


def test_sessions_that_leave_and_join_each_equal_running_alone(tiny, rng):
    """a, b, c start; b leaves from the middle row (c's row moves into its hole), d joins after, a leaves
    from the front (d's row moves); every occupant's text and audio equal running alone."""
    ticks = 24
    scales = {"a": 1.0, "b": 0.3, "c": 0.6, "d": 0.2}
    frames = {name: noise_frames(rng, ticks, scale=scale) for name, scale in scales.items()}
    oracles = {"a": {0: OracleUpdate.reset(0, (10, 11, 12))}, "c": {2: OracleUpdate.reset(0, (40, 41))},
               "d": {1: OracleUpdate.reset(0, (20, 21, 22, 23))}}
    joins, leaves = {0: "abc", 9: "d"}, {6: "b", 15: "a"}
    got, rows = _schedule_run(tiny, GREEDY, {}, ticks, joins, leaves, frames, oracles)
    assert rows == [3] * 6 + [2] * 3 + [3] * 6 + [2] * 9
    for name, outs in got.items():
        assert len(outs) > 5
        assert_same(outs, run_alone(tiny, frames[name][: len(outs)], oracles.get(name, {})))


def test_a_moved_session_keeps_its_sampling(tiny, rng):
    """Sampled sessions around a greedy one; when the greedy one's row moves, it stays greedy."""
    ticks = 14
    frames = {name: noise_frames(rng, ticks) for name in "abc"}
    hot = Sampling(text_temperature=3.0, text_topk=0, audio_temperature=3.0, audio_topk=0)
    torch.manual_seed(0)
    got, _ = _schedule_run(tiny, GenerationConfig(use_sampling=True), {"a": hot, "b": hot, "c": GREEDY_SLOT},
                           ticks, {0: "abc"}, {5: "a"}, frames, {})
    assert_same(got["c"], run_alone(tiny, frames["c"][: len(got["c"])], {}))


def test_a_free_row_is_reset_before_its_next_session(tiny, rng):
    """A session leaves from the last row (no move) and another takes that row: it starts clean."""
    ticks = 12
    frames = {name: noise_frames(rng, ticks) for name in "abc"}
    got, rows = _schedule_run(tiny, GREEDY, {}, ticks, {0: "ab", 6: "c"}, {4: "b"}, frames, {})
    assert rows == [2] * 4 + [1] * 2 + [2] * 6
    assert_same(got["c"], run_alone(tiny, frames["c"][: len(got["c"])], {}))


def test_guidance_steps_the_whole_batch(tiny, rng):
    engine = BatchedEngine(tiny, batch_size=3, gen=GenerationConfig(use_sampling=False, cfg_coef=2.0))
    try:
        assert not engine.compact
        slot = engine.acquire()
        assert len(engine.step({slot: noise_frames(rng, 1)[0]})) == 1
        assert engine.live_rows == 3
    finally:
        engine.close()


def test_compaction_can_be_turned_off(tiny, rng):
    frames = noise_frames(rng, 6)
    engine = BatchedEngine(tiny, batch_size=4, gen=GREEDY, compact=False)
    try:
        assert not engine.compact
        slot = engine.acquire()
        outs = [out for frame in frames for out in engine.step({slot: frame})]
        assert engine._state.batch_size == 4
    finally:
        engine.close()
    assert_same(outs, run_alone(tiny, frames, {}))


class _OddState(State):
    pass


class _Odd(StreamingModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def _init_streaming_state(self, batch_size: int) -> _OddState:
        state = _OddState(batch_size, torch.device("cpu"))
        state.memory = torch.zeros(batch_size, 3)  # a field rows.py has no batch axis for
        return state


def test_an_unknown_state_is_refused_by_name():
    module = _Odd()
    with module.streaming(2), pytest.raises(RowsUnsupported, match="_OddState"):
        RowViews([module], 2)


CAPTURED = {  # batch size -> the view sizes on CUDA (each with its own graphs): powers of two below it, and it
    1: [1], 4: [1, 2, 4], 8: [1, 2, 4, 8], 16: [1, 2, 4, 8, 16], 48: [1, 2, 4, 8, 16, 32, 48],
    64: [1, 2, 4, 8, 16, 32, 64], 100: [1, 2, 4, 8, 16, 32, 64, 100], 128: [1, 2, 4, 8, 16, 32, 64, 128],
}


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu"])
@pytest.mark.parametrize("batch", list(CAPTURED))
def test_each_count_of_live_rows_steps_the_smallest_view_that_holds_it(batch, cuda):
    """On CUDA the sizes warm_views captures; on a CPU (no graphs to keep) every size, so n rows step n."""
    sizes = SlotRows(batch, None, cuda).sizes()
    assert sizes == (CAPTURED[batch] if cuda else list(range(1, batch + 1)))
    bucket = row_buckets(batch, cuda)
    for live in range(1, batch + 1):  # the smallest size >= live: a size, within the batch, holding the rows
        assert bucket(live) == min(size for size in sizes if size >= live), live
    assert bucket(0) == 1  # no live row: still a view of one


class _RecordingViews:
    """What SlotRows asks of RowViews, recorded."""

    def __init__(self) -> None:
        self.installed: list[int] = []
        self.moves: list[tuple[int, int]] = []

    def install(self, n: int) -> None:
        self.installed.append(n)

    def move_row(self, source: int, target: int) -> None:
        self.moves.append((source, target))

    def sync(self) -> None:
        pass


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu"])
def test_slot_rows_install_the_bucket_of_the_live_rows(cuda):
    """Sessions join one by one, then leave from the middle: the live rows stay the first ones, and each
    view installed is the bucket of their count (or of a row asked for past them, as a reset asks)."""
    views, batch = _RecordingViews(), 16
    rows, bucket = SlotRows(batch, views, cuda), row_buckets(batch, cuda)
    slots = [100 + i for i in range(batch)]  # slots are names, not rows
    for count, slot in enumerate(slots, start=1):
        assert rows.take(slot) == count - 1
        assert rows.view_size() == rows.view() == bucket(count) and views.installed[-1] == bucket(count)
    live = list(slots)
    for slot in slots[3:12]:
        rows.release(slot)
        live.remove(slot)
        assert sorted(rows.row(s) for s in live) == list(range(len(live))) and rows.live == len(live)
        assert rows.view_size() == rows.view() == bucket(rows.live) and views.installed[-1] == bucket(rows.live)
    assert views.moves[0] == (15, 3)  # the last row filled the first hole
    assert rows.live == 7 and rows.view(9) == bucket(9) == (16 if cuda else 9)


def test_a_move_copies_every_row_state(tiny):
    """move_row copies each batched tensor's row (KV caches on their axis 1), nothing else."""
    engine = BatchedEngine(tiny, batch_size=3, gen=GREEDY)
    try:
        views = engine._rows.views
        for tensor, _ in views._tensors:
            if tensor.dtype.is_floating_point:
                tensor.normal_()
            else:
                tensor.random_(0, 5) if tensor.dtype != torch.bool else tensor.fill_(True)
        before = [tensor.clone() for tensor, _ in views._tensors]
        views.move_row(2, 0)
        for (tensor, axis), old in zip(views._tensors, before, strict=True):
            assert torch.equal(tensor.select(axis, 0), old.select(axis, 2))
            assert torch.equal(tensor.select(axis, 1), old.select(axis, 1))
            assert torch.equal(tensor.select(axis, 2), old.select(axis, 2))
        kv = [axis for tensor, axis in views._tensors if tensor.dim() == 5]
        assert kv and set(kv) == {1}
    finally:
        engine.close()


def test_step_time_follows_the_sessions_not_the_slots(tiny, rng):
    """Not a timing test: the work a step does. One session on 16 slots runs the LM on one row."""
    rows = []
    original = tiny.lm.forward_text

    def counting(input_, *args):
        rows.append(input_.shape[0])
        return original(input_, *args)

    tiny.lm.forward_text = counting  # before the engine: moshi's state holds the method it graphs
    engine = BatchedEngine(tiny, batch_size=16, gen=GREEDY)
    try:
        slot = engine.acquire()
        for frame in noise_frames(rng, 3):
            engine.step({slot: np.asarray(frame)})
    finally:
        del tiny.lm.forward_text
        engine.close()
    assert rows == [1, 1, 1]


def copy_through_moves(frontend, kv_cache: str = "model") -> dict[str, tuple[list, list]]:
    """tiny-copy copies its oracle into its text: three sessions on 4 slots, one leaving from the middle
    (the last row moves into its hole) and one joining; each one's (text tokens, oracle tokens). Robust to
    a device's rounding (the copy has wide margins): what the GPU test runs under CUDA graphs too."""
    from kame.frontend.oracle import tokenize_words

    words = {"a": "Paris is the capital", "b": "Spiders have eight legs", "c": "The sky is blue",
             "d": "Jupiter is large"}
    tokens = {name: tuple(tokenize_words(frontend.tokenizer, text)) for name, text in words.items()}
    oracles = {name: {3: OracleUpdate.reset(0, tokens[name])} for name in words}
    oracles["c"] = {15: OracleUpdate.reset(0, tokens["c"])}  # c is copying when its row moves (tick 20)
    ticks = 45
    frames = {name: [np.zeros(1920, np.float32)] * ticks for name in words}
    got, _ = _schedule_run(frontend, GREEDY, {}, ticks, {0: "abc", 22: "d"}, {20: "b"}, frames, oracles,
                           kv_cache=kv_cache)
    return {name: ([o.text_token for o in outs if o.text_token is not None], list(tokens[name]))
            for name, outs in got.items()}


def test_the_oracle_steers_every_session_through_moves(tiny_copy):
    for name, (said, oracle) in copy_through_moves(tiny_copy).items():
        assert said[: len(oracle)] == oracle, name
