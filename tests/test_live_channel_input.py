"""What a WebRTC data channel's permission check reads of a message before the mapping does: a message
nested too deep for json is refused as an error event, the session going on (it ended the session as an
internal error); one over the size limit is not parsed for the check at all (the mapping refuses it unread)."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.live import SessionConfig

from kame.clock import ManualClock
from kame.session import TandemSession
from server.live.adapter import LiveCarrier
from server.live.client_events import LiveError
from server.live.config import LiveFacts
from server.live.mapping import LiveMapping
from server.live.webrtc import ChannelPermissions
from tests.mapping_rig import bare_runner

LIMIT = 4096


class Tandem:
    def configure(self, backend=None, system_prompt=None):
        pass

    def use_llm(self, llm):
        pass

    apply = TandemSession.apply


class OnlyClose(ChannelPermissions):
    def __init__(self) -> None:
        self.sends, self.gets = {"session.close"}, None


def carrier() -> LiveCarrier:
    mapping = LiveMapping(LiveFacts("s1", {"scripted": "m"}, "scripted", "Be brief.", LIMIT, 0, transport="webrtc"))
    made = LiveCarrier(bare_runner(ManualClock()), Tandem(), mapping, permissions=OnlyClose())
    mapping.start(SessionConfig(model="gpt-live-1"), 0.0)
    return made


@pytest.mark.parametrize(("message", "code"), [("[" * 3000, "event_not_allowed"),
                                               (json.dumps({"type": "session.update", "x": "y" * LIMIT}),
                                                "event_too_large")])
def test_a_message_too_deep_or_too_large_is_an_error_not_the_sessions_end(message, code):
    async def go():
        made = carrier()
        with pytest.raises(LiveError) as refused:
            await made.on_message(message)
        return refused.value

    assert asyncio.run(go()).code == code
