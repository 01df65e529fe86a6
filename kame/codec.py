"""Audio on the wire: Ogg/Opus streams (via sphn) and raw PCM16, cut into 1920-sample frames."""

from __future__ import annotations

import numpy as np
import sphn

from kame.protocol import FRAME_SIZE, SAMPLE_RATE, ProtocolError

OGG_HEADER = 27  # bytes before a page's segment table


def split_ogg_pages(data: bytes) -> tuple[list[bytes], bytes]:
    """Whole Ogg pages in `data`, and the incomplete rest (to prepend to the next bytes)."""
    pages, offset = [], 0
    while offset < len(data):
        if not (b"OggS".startswith(data[offset:offset + 4]) or data[offset:offset + 4] == b"OggS"):
            raise ProtocolError("corrupt Ogg/Opus audio: no Ogg page where one should start")
        if len(data) - offset < OGG_HEADER:
            break
        segments = data[offset + 26]
        if len(data) - offset < OGG_HEADER + segments:
            break
        length = OGG_HEADER + segments + sum(data[offset + OGG_HEADER:offset + OGG_HEADER + segments])
        if len(data) - offset < length:
            break
        pages.append(data[offset:offset + length])
        offset += length
    return pages, data[offset:]


class OpusDecoder:
    """Ogg/Opus bytes in, float32 PCM out. A corrupt stream raises ProtocolError and is reset.

    Bytes go to the decoder one Ogg page at a time: sphn's reader fails on a single call that
    would decode more than ~5 s, and a page may be split across messages.
    """

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        self.sample_rate = sample_rate
        self._reader = sphn.OpusStreamReader(sample_rate)
        self._rest = b""

    def decode(self, data: bytes) -> np.ndarray:
        try:
            pages, self._rest = split_ogg_pages(self._rest + data)
            pcm = [np.asarray(self._reader.append_bytes(page), dtype=np.float32) for page in pages]
        except (ValueError, ProtocolError) as exc:
            self._reader, self._rest = sphn.OpusStreamReader(self.sample_rate), b""  # start over
            raise ProtocolError(f"corrupt Ogg/Opus audio: {exc}") from exc
        return np.concatenate(pcm) if pcm else np.zeros(0, dtype=np.float32)


class OpusEncoder:
    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        self._writer = sphn.OpusStreamWriter(sample_rate)

    def encode(self, pcm: np.ndarray) -> bytes:
        return self._writer.append_pcm(np.asarray(pcm, dtype=np.float32))


class FrameSplitter:
    """Re-cuts PCM of any chunk size into whole frames of FRAME_SIZE samples."""

    def __init__(self, frame_size: int = FRAME_SIZE) -> None:
        self.frame_size = frame_size
        self._buffer = np.zeros(0, dtype=np.float32)

    def push(self, pcm: np.ndarray) -> list[np.ndarray]:
        self._buffer = np.concatenate([self._buffer, np.asarray(pcm, dtype=np.float32)])
        count = len(self._buffer) // self.frame_size
        frames = [self._buffer[i * self.frame_size:(i + 1) * self.frame_size] for i in range(count)]
        self._buffer = self._buffer[count * self.frame_size:]
        return frames

    @property
    def buffered(self) -> int:
        """Samples waiting for the rest of their frame."""
        return len(self._buffer)

    def padding(self) -> np.ndarray:
        """The silence that completes the waiting frame (none when no sample waits)."""
        return np.zeros(-self.buffered % self.frame_size, dtype=np.float32)
