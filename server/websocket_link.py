"""A session's link over one accepted WebSocket (`/api/chat`, `/v1/realtime`, `/v1/live/sessions`):
text and binary messages both ways, nothing of any protocol."""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine

from starlette.websockets import WebSocket

from server.runner import CLOSED, Disconnected, Message


class WebSocketLink:
    idle_limited = True  # every message comes on the socket: a silent client has gone
    unopened = "the socket did not open"

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws

    async def opened(self) -> None:
        """The socket is accepted before the session runs."""

    async def receive(self) -> Message:
        try:
            message = await self.ws.receive()
        except CLOSED as exc:
            raise Disconnected from exc
        if message["type"] == "websocket.disconnect":
            raise Disconnected
        text = message.get("text")
        return text if text is not None else message.get("bytes") or b""

    async def send(self, message: Message) -> None:
        try:
            if isinstance(message, bytes):
                await self.ws.send_bytes(message)
            else:
                await self.ws.send_text(message)
        except CLOSED as exc:
            raise Disconnected from exc

    async def flush(self, messages: list[Message]) -> None:
        for message in messages:
            await self.send(message)

    async def close(self, code: int, reason: str) -> None:
        with contextlib.suppress(*CLOSED):  # already closed
            await self.ws.close(code, reason)

    def tasks(self) -> list[Coroutine]:
        return []
