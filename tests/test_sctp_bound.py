"""The data channel's bound on a message (`server/live/sctp_bound.py`), on aiortc's own SCTP transport: DATA
chunks go in through its receive path as they would from the wire (out of order where said), and what it
reads, what it holds and the receive window it advertises are checked."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiortc.rtcsctptransport import (
    SCTP_DATA_FIRST_FRAG,
    SCTP_DATA_LAST_FRAG,
    SCTP_DATA_UNORDERED,
    DataChunk,
    RTCSctpTransport,
)

from server.live.sctp_bound import bound_messages

STREAM = 1
FRAGMENT = 1200  # user data in one DATA chunk, as aiortc sends them (its USERDATA_MAX_LENGTH is close)
FIRST_TSN = 1000


class Wire:
    """An SCTP transport with the bound, its association taken as established: DATA chunks in, messages out
    (made on a running loop, as aiortc's transport wants)."""

    def __init__(self) -> None:
        self.sctp = RTCSctpTransport(SimpleNamespace(state="new"))
        self.window = self.sctp._advertised_rwnd
        self.refused: list[tuple[int, int]] = []
        self.limit = bound_messages(self.sctp, lambda stream, held: self.refused.append((stream, held)))
        self.sctp._last_received_tsn = FIRST_TSN - 1
        self.read: list[tuple[int, int]] = []  # each message read: (its sequence number, its size)
        self.most_held = 0
        self._tsn = FIRST_TSN

        async def receive(stream_id: int, pp_id: int, data: bytes) -> None:
            self.read.append((data[0], len(data)))

        self.sctp._receive = receive

    def message(self, ssn: int, size: int, unordered: bool = False) -> list[DataChunk]:
        """The DATA chunks of one message of `size` bytes (its bytes are its sequence number), TSNs in turn."""
        data = bytes([ssn % 256]) * size
        pieces = [data[i:i + FRAGMENT] for i in range(0, size, FRAGMENT)]
        chunks = []
        for i, piece in enumerate(pieces):
            flags = (SCTP_DATA_FIRST_FRAG if i == 0 else 0) | (SCTP_DATA_LAST_FRAG if i == len(pieces) - 1 else 0)
            chunk = DataChunk(flags | (SCTP_DATA_UNORDERED if unordered else 0))
            chunk.tsn, chunk.stream_id, chunk.stream_seq, chunk.protocol = self._tsn, STREAM, ssn, 51
            chunk.user_data = piece
            chunks.append(chunk)
            self._tsn += 1
        return chunks

    async def arrive(self, chunks: list[DataChunk]) -> None:
        for chunk in chunks:
            await self.sctp._receive_data_chunk(chunk)
            held = sum(len(c.user_data) for s in self.sctp._inbound_streams.values() for c in s.reassembly)
            self.most_held = max(self.most_held, held)

    @property
    def window_whole(self) -> bool:
        """Nothing held: the receive window the peer is told of is back where it started."""
        return self.sctp._advertised_rwnd == self.window


def test_a_message_past_the_limit_is_dropped_as_it_grows_and_the_next_one_is_read():
    async def go() -> None:
        wire = Wire()
        big, after = wire.message(0, 4 * wire.limit), wire.message(1, 3000)
        await wire.arrive(big + after)
        assert wire.read == [(1, 3000)]
        assert wire.most_held <= wire.limit + FRAGMENT  # never more than one message's worth
        assert wire.refused == [(STREAM, FRAGMENT * (wire.limit // FRAGMENT + 1))]  # once, as it passed the limit
        assert wire.window_whole

    asyncio.run(go())


def test_a_message_at_the_limit_is_read_whole():
    async def go() -> None:
        wire = Wire()
        await wire.arrive(wire.message(0, wire.limit))
        assert wire.read == [(0, wire.limit)] and not wire.refused and wire.window_whole

    asyncio.run(go())


def test_a_message_refused_before_its_turn_is_skipped_when_it_comes():
    """Message 0 waits for its first fragment (lost, sent again); 1 grows past the limit meanwhile; 2 is
    whole: when 0 comes, 0 and 2 are read; 1's last fragment, come late, is dropped."""
    async def go() -> None:
        wire = Wire()
        first, big, last = wire.message(0, 3000), wire.message(1, 2 * wire.limit), wire.message(2, 100)
        await wire.arrive(first[1:] + big[:-1] + last)
        assert wire.read == [] and len(wire.refused) == 1
        await wire.arrive(first[:1] + big[-1:])
        assert wire.read == [(0, 3000), (2, 100)]
        assert len(wire.refused) == 1 and wire.window_whole

    asyncio.run(go())


def test_an_unordered_message_past_the_limit_is_dropped_up_to_the_next_one():
    async def go() -> None:
        wire = Wire()
        await wire.arrive(wire.message(0, 3 * wire.limit, unordered=True) + wire.message(0, 500, unordered=True))
        assert wire.read == [(0, 500)]
        assert len(wire.refused) == 1 and wire.most_held <= wire.limit + FRAGMENT and wire.window_whole

    asyncio.run(go())
