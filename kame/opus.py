"""libopus called directly (ctypes), for the WebRTC paths' per-packet coding: one call a packet, at the
session's own 24 kHz, mono. Through PyAV a peer's packet went through FFmpeg's wrapper, which decodes
only at 48 kHz stereo (downmixed and halved afterwards): ~3.5x the decoding's cost (docs/benchmarks-history.md,
"libopus called directly");
encoding costs about the same either way. ctypes lets go of the GIL for each call.

The library is the system's libopus, else the copy PyAV's wheel carries; `library()` is None where
neither loads, and callers keep PyAV's path."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import logging
import os

import numpy as np

logger = logging.getLogger(__name__)

VOIP, AUDIO = 2048, 2049  # OPUS_APPLICATION_*
_SET_BITRATE, _SET_COMPLEXITY, _SET_SIGNAL = 4002, 4010, 4024  # OPUS_SET_*_REQUEST
_SIGNAL_VOICE = 3001
MAX_PACKET_MS = 120  # the longest an Opus packet lasts
MAX_PACKET_BYTES = 1500  # an RTP payload that fits one datagram
# the server's defaults for WebRTC ([realtime] webrtc_opus_complexity, webrtc_uplink_ptime_ms):
# libopus's effort on the assistant's voice: 5 costs 0.53-0.66 of 10's CPU
# (docs/benchmarks-history.md, "libopus called directly")
VOICE_COMPLEXITY = 5
PEER_PTIME_MS = 40  # the packets a peer is asked for (a=ptime): half 20 ms's per-packet work, ~10 ms more delay


class OpusError(RuntimeError):
    pass


def _candidates() -> list[str]:
    found = [name] if (name := ctypes.util.find_library("opus")) else []
    try:
        import av
    except ImportError:
        return found
    here = os.path.dirname(os.path.dirname(av.__file__))
    for folder in ("av.libs", os.path.join("av", ".dylibs")):  # Linux and macOS wheels
        found += sorted(glob.glob(os.path.join(here, folder, "libopus*")))
    return found


@functools.cache
def library() -> ctypes.CDLL | None:
    """libopus, loaded once per process; None (logged once) where none loads."""
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            lib.opus_decoder_create  # noqa: B018 (a library of that name, but libopus?)
        except (OSError, AttributeError):
            continue
        _declare(lib)
        logger.debug("libopus %s from %s", lib.opus_get_version_string().decode(), path)
        return lib
    logger.info("no libopus to call directly: Opus goes through PyAV")
    return None


def _declare(lib: ctypes.CDLL) -> None:
    c_int, ptr, c_int32 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int32
    lib.opus_get_version_string.restype = ctypes.c_char_p
    lib.opus_strerror.restype, lib.opus_strerror.argtypes = ctypes.c_char_p, [c_int]
    lib.opus_encoder_create.restype = ptr
    lib.opus_encoder_create.argtypes = [c_int32, c_int, c_int, ctypes.POINTER(c_int)]
    lib.opus_encode.restype = c_int32
    lib.opus_encode.argtypes = [ptr, ptr, c_int, ptr, c_int32]
    lib.opus_encoder_destroy.argtypes = [ptr]
    lib.opus_encoder_ctl.restype = c_int
    lib.opus_encoder_ctl.argtypes = [ptr, c_int]  # and one variadic int: declared so, arm64 passes it as such
    lib.opus_decoder_create.restype = ptr
    lib.opus_decoder_create.argtypes = [c_int32, c_int, ctypes.POINTER(c_int)]
    lib.opus_decode_float.restype = c_int
    lib.opus_decode_float.argtypes = [ptr, ctypes.c_char_p, c_int32, ptr, c_int, c_int]
    lib.opus_decoder_destroy.argtypes = [ptr]
    lib.opus_packet_get_nb_samples.restype = c_int
    lib.opus_packet_get_nb_samples.argtypes = [ctypes.c_char_p, c_int32, c_int32]


def _check(lib: ctypes.CDLL, code: int, what: str) -> int:
    if code < 0:
        raise OpusError(f"{what}: {lib.opus_strerror(code).decode()}")
    return code


class Encoder:
    """Mono int16 PCM at `rate` to Opus packets, one `encode` call a packet (2.5 to 60 ms of audio:
    the packet lasts what it is given)."""

    def __init__(self, rate: int, bitrate: int, complexity: int = 10, application: int = VOIP) -> None:
        lib = library()
        if lib is None:
            raise OpusError("no libopus to call")
        error = ctypes.c_int()
        self._lib, self._state = lib, lib.opus_encoder_create(rate, 1, application, ctypes.byref(error))
        _check(lib, error.value, "opus_encoder_create")
        for request, value in ((_SET_BITRATE, bitrate), (_SET_COMPLEXITY, complexity), (_SET_SIGNAL, _SIGNAL_VOICE)):
            _check(lib, lib.opus_encoder_ctl(self._state, request, ctypes.c_int(value)),
                   f"opus_encoder_ctl({request}, {value})")
        self._out = ctypes.create_string_buffer(MAX_PACKET_BYTES)

    def encode(self, pcm: np.ndarray) -> bytes:
        pcm = np.ascontiguousarray(pcm, np.int16)
        size = self._lib.opus_encode(self._state, pcm.ctypes.data, len(pcm), self._out, MAX_PACKET_BYTES)
        return self._out.raw[:_check(self._lib, size, "opus_encode")]

    def __del__(self) -> None:
        if getattr(self, "_state", None):
            self._lib.opus_encoder_destroy(self._state)


class Decoder:
    """Opus packets (of any rate, mode or length) to mono float32 PCM at `rate`; `conceal` makes up
    audio for lost packets (libopus's loss concealment)."""

    def __init__(self, rate: int) -> None:
        lib = library()
        if lib is None:
            raise OpusError("no libopus to call")
        error = ctypes.c_int()
        self._lib, self.rate = lib, rate
        self._state = lib.opus_decoder_create(rate, 1, ctypes.byref(error))
        _check(lib, error.value, "opus_decoder_create")
        self._pcm = np.zeros(rate * MAX_PACKET_MS // 1000, np.float32)
        self.last_samples = rate // 50  # the last packet's length: what a lost one is assumed to last

    def decode(self, payload: bytes) -> np.ndarray:
        """One packet's audio (a copy); OpusError for a packet that does not decode."""
        count = self._lib.opus_decode_float(self._state, payload, len(payload), self._pcm.ctypes.data,
                                            len(self._pcm), 0)
        self.last_samples = _check(self._lib, count, "opus_decode_float")
        return self._pcm[:count].copy()

    def conceal(self, packets: int) -> np.ndarray:
        """Audio for `packets` lost packets, each as long as the last one received."""
        out = []
        for _ in range(packets):
            count = self._lib.opus_decode_float(self._state, None, 0, self._pcm.ctypes.data, self.last_samples, 0)
            out.append(self._pcm[:_check(self._lib, count, "opus_decode_float (concealment)")].copy())
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def __del__(self) -> None:
        if getattr(self, "_state", None):
            self._lib.opus_decoder_destroy(self._state)
