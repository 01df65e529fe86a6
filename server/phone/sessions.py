"""The protocol session inside a phone call (server/phone/carrier.py): GPT-Live's, or for a SIP call that the
Realtime call control accepted (`POST /v1/realtime/calls/{call_id}/accept`), the Realtime API's. Either takes the
caller's audio (`hear`) and plays the assistant's through the call (`play`), keeps its events for the call's
sidebands and the recording (the line carries audio only), and says what the keypad did in its own words:
GPT-Live's `transport.dtmf.received`, Realtime's `input_audio_buffer.dtmf_event_received`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine

import numpy as np
from openai.types.live import SessionConfig
from pydantic import ValidationError

from kame.session import TandemSession
from kame.session_events import SessionEvent
from server.live.adapter import LiveCarrier, live_facts
from server.live.client_events import LiveError
from server.live.mapping import LiveMapping
from server.realtime.adapter import RealtimeCarrier
from server.realtime.client_events import RealtimeError
from server.runner import SessionRunner

logger = logging.getLogger(__name__)

Play = Callable[[np.ndarray, int], None]


class NothingToTheCaller:
    """A Live session's events stay on the server: the caller's line carries audio only."""

    def may_send(self, kind: object) -> bool:
        return False

    def may_get(self, event: dict) -> bool:
        return False


def live_session(params: dict[str, str], default_profile: str) -> SessionConfig:
    """The Live session a call asks for with its parameters (TwiML `<Parameter>`s, ...): `instructions`, `llm`
    (a backend profile, or a model one serves; the server's default otherwise), `voice`; Responses delegation
    (KAME's planner answers). LiveError naming the parameter at fault."""
    session: dict = {"model": "gpt-live", "delegation": {
        "type": "responses", "responses": {"model": params.get("llm") or default_profile}}}
    if params.get("instructions"):
        session["instructions"] = params["instructions"]
    if params.get("voice"):
        session["audio"] = {"output": {"voice": params["voice"]}}
    try:
        return SessionConfig.model_validate(session)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise LiveError("invalid_value", f"the call's parameters: {'.'.join(map(str, error['loc']))}: "
                        f"{error['msg']}") from None


class _CallSession:
    """What both protocols' call sessions do alike: their carrier's (`LiveCarrier` or `RealtimeCarrier`) session
    events, limits, tasks and sidebands, and GPT-Live's `transport.dtmf.sent` for a key pressed on the line."""

    protocol = ""

    def __init__(self, carrier, runner: SessionRunner, tandem: TandemSession) -> None:
        self.carrier, self.tandem, self.clock = carrier, tandem, runner.clock

    async def on_event(self, event: SessionEvent) -> None:
        await self.carrier.on_event(event)

    def report(self, code: str, message: str) -> None:
        self.carrier.report(code, message)

    def tasks(self) -> list[Coroutine]:
        return self.carrier.tasks()

    async def aclose(self) -> None:
        await self.carrier.aclose()

    @property
    def sidebands(self) -> set:
        return self.carrier.sidebands

    def replayed(self) -> list[dict]:
        return self.carrier.replayed()

    def steer(self, text: str | None, sideband) -> None:
        self.carrier.steer(text, sideband)

    def digit_sent(self, digit: str, client_event_id: str | None) -> None:
        """`transport.dtmf.sent` (GPT-Live's; the Realtime API has no event of its own for it, and a Realtime
        call's sideband gets this one)."""
        self.carrier.mapping.outbox.emit("transport.dtmf.sent", client_event_id=client_event_id, event=digit)
        self.carrier.carry_out()


class LiveCall(_CallSession):
    """GPT-Live inside the call: what every carrier's call runs, and a SIP call GPT-Live's call control accepted."""

    protocol = "live"

    def __init__(self, runner: SessionRunner, tandem: TandemSession, play: Play) -> None:
        mapping = LiveMapping(live_facts(runner, tandem, "phone", False))
        super().__init__(LiveCarrier(runner, tandem, mapping, play=play, permissions=NothingToTheCaller()),
                         runner, tandem)

    def start(self, call_id: str, params: dict[str, str]) -> None:
        mapping = self.carrier.mapping
        default = mapping.facts.default_profile
        try:
            mapping.start(live_session(params, default), self.clock.now())
        except LiveError as exc:  # a parameter this server cannot serve: the caller still gets an answer
            logger.warning("call %s: %s; the call goes on with the server's defaults", call_id, exc)
            mapping.start(live_session({}, default), self.clock.now())
        self.carrier.carry_out()

    def hear(self, pcm: np.ndarray) -> None:
        self.carrier.hear(pcm)

    def digit_received(self, digit: str) -> None:
        self.carrier.mapping.outbox.emit("transport.dtmf.received", event=digit)
        self.carrier.carry_out()

    def refuse(self, sideband, code: str, message: str, param: str | None, client_event_id: str | None) -> None:
        """A sideband's event refused: the error to that sideband alone."""
        error = LiveError(code, message, param, client_event_id)
        sideband.put(self.carrier.mapping.outbox.error_event(error), False)


class RealtimeCall(_CallSession):
    """The Realtime API inside a SIP call its call control accepted: the session configured by the accept's body
    (a Realtime session, as `session.update` takes it), the caller's audio as the input audio buffer, the
    responses' audio played on the line (no `response.output_audio.delta`: the call carries it), its events
    to the call's sidebands (`/v1/realtime?call_id=`)."""

    protocol = "realtime"

    def __init__(self, runner: SessionRunner, tandem: TandemSession, play: Play, session: dict) -> None:
        model = session.get("model") if isinstance(session.get("model"), str) else ""
        super().__init__(RealtimeCarrier(runner, tandem, model, False, to_client=False), runner, tandem)
        self.carrier.mapping.speech.play = play
        self.session = session

    def start(self, call_id: str, params: dict[str, str]) -> None:
        mapping = self.carrier.mapping
        mapping.greet()
        try:
            mapping.configure(self.session, self.clock.now())
        except RealtimeError as exc:  # the accept checked it: a field the server cannot serve after all
            logger.warning("call %s: %s; the call goes on with the server's defaults", call_id, exc)
            mapping.refuse(exc)
        self.carrier.carry_out()

    def hear(self, pcm: np.ndarray) -> None:
        self.carrier.mapping.hear(pcm)
        self.carrier.carry_out()

    def digit_received(self, digit: str) -> None:
        self.carrier.mapping.digit(digit)
        self.carrier.carry_out()

    def refuse(self, sideband, code: str, message: str, param: str | None, client_event_id: str | None) -> None:
        self.carrier.refuse_to(sideband, RealtimeError(code, message, param, client_event_id))
