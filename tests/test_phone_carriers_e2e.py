"""A Telnyx, a Vonage and a Plivo call end to end, on the real server on loopback (tiny front-end, Whisper, the
scripted LLM), each carrier's side played by the test caller (tests/phone_caller.py) with its wire
(tests/phone_wires.py): the spoken question reaches the LLM, the answer's audio comes back paced a small lead
ahead of what the caller has heard, a keypad digit reaches the LLM, and the hang-up frees the slot."""

from __future__ import annotations

import asyncio

import pytest

from kame.audio import SAMPLE_RATE
from tests.conftest import words
from tests.phone_caller import Caller
from tests.phone_wires import PlivoWire, TelnyxWire, VonageWire
from tests.server_harness import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.realtime]

MAX_LEAD_S = 0.25  # the pacer's two 80 ms frames, and a frame of slack for the loopback's scheduling


def asked(llm, *needles: str) -> bool:
    """A request to the LLM whose newest message names every needle."""
    return any(all(n in words(body["messages"][-1]["content"]) for n in needles) for body in llm.requests)


@pytest.mark.parametrize("wire", [TelnyxWire, VonageWire, PlivoWire], ids=lambda w: w.name)
def test_a_call_hears_the_question_answers_paced_takes_a_digit_and_hangs_up(tandem_server, scripted_llm, voices,
                                                                              wire):
    url, services = tandem_server
    runner, slots = services.runtime.runner, services.runtime.engine.batch_size
    line = wire()

    async def call() -> Caller:
        async with Caller.dial(f"{url}/{line.name}/media", line, {"keypad": "llm"}) as caller:
            await caller.say(voices["spider"], SAMPLE_RATE)
            await wait_until(lambda: asked(scripted_llm, "many", "legs"), "the question at the LLM", 30)
            await wait_until(lambda: caller.frames_heard >= 10, "the answer's audio", 20)
            await caller.press("5")
            await caller.press("#")
            await wait_until(lambda: asked(scripted_llm, "pressed", "keypad"), "the digits at the LLM", 10)
            await wait_until(lambda: runner.free_slots < slots, "the call's slot in use", 1)
            if isinstance(line, TelnyxWire):  # Telnyx says stop; Vonage and Plivo hang up by closing the socket
                await caller.hang_up()
            else:
                await caller.ws.close()
        await wait_until(lambda: runner.free_slots == slots, "the slot given back", 10)
        return caller

    caller = asyncio.run(call())
    assert not caller.faults, caller.faults
    assert 0 < caller.max_lead <= MAX_LEAD_S, caller.leads
