"""Runs Moshi's mapping on one tandem session: messages to the runner's queue and the recording,
Opus through the session's codec stream (in the shared codec process), commands to the session."""

from __future__ import annotations

import logging
from collections.abc import Coroutine

import kame
from kame.commands import SESSION_COMMANDS, PushAudio
from kame.session import TandemSession
from kame.session_events import SessionEvent
from server.codec_process import CodecError, OpusStream
from server.moshi.mapping import (
    DecodeOpus,
    EncodeOpus,
    End,
    MoshiFacts,
    MoshiMapping,
    Record,
    Send,
    SessionOptions,
)
from server.runner import Ended, Message, SessionRunner

logger = logging.getLogger(__name__)


def moshi_facts(runner: SessionRunner, tandem: TandemSession, options: SessionOptions) -> MoshiFacts:
    runtime = runner.services.runtime
    asr = runtime.asr.name if options.asr else "none"
    metadata = {
        **tandem.sampling.as_dict(),  # what this session samples with, after its query parameters
        "lm_model_file": runtime.frontend.source,
        "instance_name": f"kame {kame.__version__}",
        "build_info": {"version": kame.__version__, "device": str(runtime.engine.device)},
        "session_id": runner.id,
        "asr": asr,
        "backend": tandem.backend,
        "max_sessions": runtime.engine.batch_size,
        "ignored_parameters": list(options.ignored),
    }
    return MoshiFacts(runner.id, runtime.frontend.source, runtime.asr.name, tandem.backend, tuple(runtime.profiles),
                      tandem.system_prompt, metadata, runner.settings.replica)


class MoshiCarrier:
    def __init__(self, runner: SessionRunner, tandem: TandemSession, options: SessionOptions,
                 opus: OpusStream) -> None:
        self.runner, self.tandem, self.options = runner, tandem, options
        self.mapping = MoshiMapping(options, runner.settings.max_message_bytes)
        self._opus = opus  # its Opus decoder and encoder, in a codec process

    async def greet(self) -> None:
        self.mapping.greet(moshi_facts(self.runner, self.tandem, self.options))
        await self._carry_out()

    async def on_message(self, message: Message) -> None:
        self.mapping.on_client(message)
        await self._carry_out()

    def refuse(self, exc: Exception) -> None:
        self.mapping.error("protocol", str(exc))
        self._send_queued()

    def report(self, code: str, message: str) -> None:
        self.mapping.error(code, message)
        self._send_queued()

    async def on_event(self, event: SessionEvent) -> None:
        self.mapping.on_session(event, self.runner.outbox.dropped)
        await self._carry_out()

    def tasks(self) -> list[Coroutine]:
        return []

    async def aclose(self) -> None:
        self._opus.close()

    # ---------------------------------------------------------------- carrying out

    async def _carry_out(self) -> None:
        for action in self.mapping.take():
            match action:
                case DecodeOpus(payload=payload):
                    try:
                        self.tandem.apply(PushAudio(await self._opus.decode(payload)))
                    except CodecError as exc:  # the codec process is being restarted: this frame is lost
                        logger.warning("session %s: %s; an audio message dropped", self.runner.id, exc)
                case EncodeOpus(pcm=pcm):
                    try:
                        self.mapping.encoded(await self._opus.encode(pcm))
                    except CodecError as exc:  # as for decoding: a frame of the answer lost, not the session
                        logger.warning("session %s: %s; a frame of audio dropped", self.runner.id, exc)
                    await self._carry_out()
                case _:
                    self._do(action)

    def _send_queued(self) -> None:
        """An error's messages (they need no codec)."""
        for action in self.mapping.take():
            self._do(action)

    def _do(self, action) -> None:
        match action:
            case Send(message=message, droppable=droppable):
                self.runner.send(message, droppable)
            case Record(event=event):
                self.runner.record(event)
            case End(reason=reason):
                raise Ended(reason)
            case command if isinstance(command, SESSION_COMMANDS):
                self.tandem.apply(command)
            case _:
                raise TypeError(f"{type(action).__name__} needs the codec: not from an error")
