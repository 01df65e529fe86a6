"""The sessions' Opus in child processes (server/codec_process.py): the same bytes and PCM as the codec
in process, in order per stream, corrupt audio refused without losing the stream, a child that dies
restarted without losing the pool."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kame.codec import OpusDecoder, OpusEncoder
from kame.protocol import FRAME_SIZE, ProtocolError
from server.codec_process import CodecError, CodecPool


@pytest.fixture(scope="module")
def pool():
    pool = CodecPool(processes=2)
    asyncio.run(pool.ready())  # both children answer once started
    yield pool
    pool.close()


def _frames(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(FRAME_SIZE) * 0.1).astype(np.float32) for _ in range(count)]


def test_streams_encode_and_decode_as_the_codec_in_process_does_in_order(pool):
    frames = _frames(12)
    local = OpusEncoder()
    expected = [local.encode(frame) for frame in frames]

    async def scenario():
        streams = [pool.stream() for _ in range(3)]  # spread over both children
        # every frame of every stream sent at once: each stream's answers must keep its order
        encoded = await asyncio.gather(*(asyncio.gather(*(s.encode(f) for f in frames)) for s in streams))
        decoder = pool.stream()
        decoded = [await decoder.decode(packet) for packet in encoded[0]]
        for stream in [*streams, decoder]:
            stream.close()
        return encoded, decoded

    encoded, decoded = asyncio.run(scenario())
    assert all(packets == expected for packets in encoded)
    reference = OpusDecoder()
    assert all(np.array_equal(got, reference.decode(packet)) for got, packet in zip(decoded, expected, strict=True))
    assert sum(len(pcm) for pcm in decoded) > 0


def test_corrupt_audio_is_refused_and_the_stream_goes_on(pool):
    packets = [OpusEncoder().encode(frame) for frame in _frames(6, seed=1)]

    async def scenario():
        stream = pool.stream()
        with pytest.raises(ProtocolError, match="corrupt Ogg/Opus"):
            await stream.decode(b"this is not an Ogg page at all")
        pcm = [await stream.decode(packet) for packet in packets]  # a fresh stream, from its header on
        stream.close()
        return pcm

    assert sum(len(p) for p in asyncio.run(scenario())) > 0


def test_a_child_that_dies_is_started_again():
    pool = CodecPool(processes=1)
    try:
        async def scenario():
            stream = pool.stream()
            first = await stream.encode(_frames(1)[0])
            pool._children[0].process.kill()
            pool._children[0].process.wait(5)
            for _ in range(100):  # the reader notices the child is gone
                if not pool._children[0].alive:
                    break
                await asyncio.sleep(0.02)
            with pytest.raises(CodecError):
                future = asyncio.get_running_loop().create_future()
                pool._children[0].submit(1, "encode", stream.id, _frames(1)[0], future)
            again = await stream.encode(_frames(1)[0])  # a new child: the stream starts over, header and all
            return first, again

        first, again = asyncio.run(scenario())
    finally:
        pool.close()
    assert pool.restarts == 1
    assert first[:4] == again[:4] == b"OggS"
