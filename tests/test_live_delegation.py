"""Client delegation on a manual clock: the real planner with the client as its LLM. Each attempt is a
delegation; its first commentary resets the oracle, later ones append; a superseded delegation's
commentary is dropped by epoch; a delegation ends when its commentary stops; commentary with no
delegation open starts one."""

from __future__ import annotations

import asyncio

from kame.asr.events import PartialTranscript
from kame.backend.planner import Planner, PlannerConfig
from kame.clock import ManualClock, settle
from kame.frontend.oracle import OracleOp
from kame.session import TandemSession
from kame.session_events import LLMAttempt
from server.live.adapter import LiveCarrier
from server.live.config import LiveFacts
from server.live.delegation import ClientBackend
from server.live.mapping import LiveMapping
from tests.mapping_rig import bare_runner, sent


class Rig:
    def __init__(self, tokenizer, idle_s: float = 2.0) -> None:
        self.clock = ManualClock()
        self.created: list[str] = []
        self.backend = ClientBackend(self.clock, self.created.append, idle_s=idle_s)
        self.updates, self.events = [], []
        self.planner = Planner(self.backend, tokenizer, self.updates.append, self.events.append,
                               PlannerConfig(), self.clock)

    def partial(self, text: str) -> None:
        self.planner.on_transcript(PartialTranscript(text, 0.0, 1.0))

    def phases(self, epoch: int) -> list[str]:
        return [e.phase for e in self.events if isinstance(e, LLMAttempt) and e.epoch == epoch]


def test_first_commentary_resets_later_ones_append_and_the_delegation_ends_when_it_stops(tiny_copy):
    async def go():
        rig = Rig(tiny_copy.tokenizer)
        rig.partial("what is")
        await settle()
        (first,) = rig.created
        assert rig.updates == []  # a delegation waits for the client
        rig.backend.commentary(first, "Zebras sing")
        await settle()
        rig.backend.commentary(first, "in Oslo.")
        await settle()
        await rig.clock.advance(1.9)
        running = rig.planner.running_streams
        await rig.clock.advance(0.2)  # idle_s after the last commentary: done
        return rig, running

    rig, running = asyncio.run(go())
    assert [(u.op, u.text) for u in rig.updates] == [(OracleOp.RESET, "Zebras sing"), (OracleOp.APPEND, "in Oslo.")]
    assert running == [1] and rig.planner.running_streams == []
    assert rig.phases(1) == ["started", "first_token", "done"]


def test_a_newer_delegation_with_words_supersedes_and_the_older_ones_words_are_dropped(tiny_copy):
    async def go():
        rig = Rig(tiny_copy.tokenizer)
        rig.partial("what is")
        await settle()
        rig.partial("what is the capital")
        await settle()
        old, new = rig.created
        rig.backend.commentary(new, "Paris is the capital.")
        await settle()
        assert rig.backend.commentary(old, "Let me think.")  # acknowledged, goes nowhere
        await settle()
        return rig, old

    rig, old = asyncio.run(go())
    assert [(u.op, u.text) for u in rig.updates] == [(OracleOp.RESET, "Paris is the capital.")]
    assert rig.phases(1) == ["started", "cancelled"]
    assert rig.backend.known(old)


def test_commentary_for_no_delegation_goes_to_the_newest_or_starts_one(tiny_copy):
    """Through the adapter's carrier: with none open, the planner starts an attempt that begins with it."""
    async def go():
        clock = ManualClock()
        tokenizer = tiny_copy.tokenizer
        mapping = LiveMapping(LiveFacts("s1", {"scripted": "m"}, "scripted", "Be brief.", 1 << 20, 0))
        updates = []

        class Tandem:
            planner = Planner(None, tokenizer, updates.append, lambda e: None, PlannerConfig(), clock)

            def configure(self, backend=None, system_prompt=None):
                pass

            def use_llm(self, llm):
                self.planner.set_llm(llm)

            def request_attempt(self):
                self.planner.request_attempt()

            apply = TandemSession.apply  # the session's own dispatch, onto these methods

        runner = bare_runner(clock)
        carrier = LiveCarrier(runner, Tandem(), mapping)
        from openai.types.live import SessionConfig

        mapping.start(SessionConfig(model="gpt-live-1"), clock.now())
        carrier.carry_out()
        assert isinstance(Tandem.planner.llm, type(carrier.backend))
        mapping.on_client('{"type": "session.commentary.append", "delegation_id": null, "content": "Hello there."}',
                          clock.now())
        carrier.carry_out()
        await settle()
        return updates, sent(runner)

    updates, events = asyncio.run(go())
    types = [e["type"] for e in events]
    assert types == ["session.started", "session.commentary.appended", "session.delegation.created"]
    assert [(u.op, u.text) for u in updates] == [(OracleOp.RESET, "Hello there.")]
