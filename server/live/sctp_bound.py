"""A WebRTC data channel's incoming messages, bounded as their fragments arrive: aiortc's SCTP keeps every
fragment of a message until the last one and joins them, whatever the size, before anything can read it
(12 MB: 12 MB held, and a reassembly that rescans every held fragment as each one arrives). Here a message
past the size the SDP announced (`a=max-message-size`) is dropped as it grows, and the rest of it as it
comes; the channel goes on with the next message."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from aiortc.rtcsctptransport import (
    SCTP_DATA_FIRST_FRAG,
    SCTP_DATA_LAST_FRAG,
    SCTP_DATA_UNORDERED,
    DataChunk,
    InboundStream,
    RTCSctpTransport,
)
from aiortc.utils import uint16_add, uint16_gt

logger = logging.getLogger(__name__)

Refused = Callable[[int, int], None]  # (stream id, the bytes of the message held when it was dropped)


class BoundedStream(InboundStream):
    """One SCTP stream's reassembly (aiortc's), refusing a message once its fragments held exceed `limit`.

    An ordered message is its fragments with one stream sequence number: once refused, its number is
    skipped when its turn comes, and any fragment of it that comes later is dropped on arrival (ordered
    fragments behind the stream's next number belong to a message gone). Unordered fragments carry no
    message number: past `limit` held, all of the stream's unordered fragments go, and those that come
    until the next first fragment. Every byte dropped goes back into the receive window the peer is told
    of (aiortc counts a fragment out of it as it arrives and back in only when its message is read)."""

    def __init__(self, stream_id: int, limit: int, release: Callable[[int], None], refused: Refused) -> None:
        super().__init__()
        self.stream_id, self.limit = stream_id, limit
        self._release, self._refused = release, refused
        self._ahead: set[int] = set()  # ordered messages refused before their turn: their sequence numbers
        self._skipping = False  # the rest of a refused unordered message is still coming

    def add_chunk(self, chunk: DataChunk) -> None:
        if self._gone(chunk):
            self._release(len(chunk.user_data))  # (the transport takes it out of the window after this)
            return
        super().add_chunk(chunk)
        held = [c for c in self.reassembly if _same_message(c, chunk)]
        size = sum(len(c.user_data) for c in held)
        if size > self.limit:
            self._refuse(chunk, held, size)

    def pop_messages(self) -> Iterator[tuple[int, int, bytes]]:
        yield from super().pop_messages()
        while self.sequence_number in self._ahead:  # a refused message's turn: the next one's
            self._ahead.discard(self.sequence_number)
            self.sequence_number = uint16_add(self.sequence_number, 1)
            yield from super().pop_messages()
        # a FORWARD TSN may have moved the stream past one: its number comes round again 65536 messages on
        self._ahead = {ssn for ssn in self._ahead if uint16_gt(ssn, self.sequence_number)}

    def _gone(self, chunk: DataChunk) -> bool:
        """A fragment of a message refused (or already read: none comes but a late copy)."""
        if chunk.flags & SCTP_DATA_UNORDERED:
            if not self._skipping or chunk.flags & SCTP_DATA_FIRST_FRAG:
                self._skipping = False
                return False
            self._skipping = not chunk.flags & SCTP_DATA_LAST_FRAG
            return True
        return chunk.stream_seq in self._ahead or uint16_gt(self.sequence_number, chunk.stream_seq)

    def _refuse(self, chunk: DataChunk, held: list[DataChunk], size: int) -> None:
        dropped = {id(c) for c in held}
        self.reassembly = [c for c in self.reassembly if id(c) not in dropped]
        self._release(size)
        if chunk.flags & SCTP_DATA_UNORDERED:
            self._skipping = not chunk.flags & SCTP_DATA_LAST_FRAG
        elif chunk.stream_seq == self.sequence_number:
            self.sequence_number = uint16_add(self.sequence_number, 1)
        else:
            self._ahead.add(chunk.stream_seq)
        self._refused(self.stream_id, size)


def _same_message(held: DataChunk, chunk: DataChunk) -> bool:
    if chunk.flags & SCTP_DATA_UNORDERED:
        return bool(held.flags & SCTP_DATA_UNORDERED)
    return not held.flags & SCTP_DATA_UNORDERED and held.stream_seq == chunk.stream_seq


def bound_messages(sctp: RTCSctpTransport, refused: Refused) -> int | None:
    """Bound the messages `sctp` takes at the size its SDP announces; returns it. Call before the association
    starts. None (with a warning) where this aiortc's transport is not the one this was written for (1.16):
    its messages are reassembled whole, as before.

    The hook is the transport's own factory of inbound streams, on this one transport: the peer connection
    makes its transport itself (no subclass can take its place), and every DATA chunk, FORWARD TSN and
    stream reset reaches a stream through it. Bounding the stream's fragments, not the message read, is
    the point: by the time a message is read, all of it was held."""
    limit = sctp.getCapabilities().maxMessageSize
    streams = getattr(sctp, "_inbound_streams", None)
    if not limit or streams != {} or not isinstance(getattr(sctp, "_advertised_rwnd", None), int) \
            or not callable(getattr(sctp, "_get_inbound_stream", None)):
        logger.warning("aiortc's SCTP transport has changed (no inbound streams where 1.16 had them): "
                       "data channel messages are reassembled whole, whatever their size")
        return None

    def release(size: int) -> None:
        sctp._advertised_rwnd += size

    def stream(stream_id: int) -> InboundStream:  # in place of aiortc's, which makes an unbounded one
        if stream_id not in streams:
            streams[stream_id] = BoundedStream(stream_id, limit, release, refused)
        return streams[stream_id]

    sctp._get_inbound_stream = stream
    return limit
