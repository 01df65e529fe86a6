"""`kame talk`: full-duplex conversation through the local microphone and speakers (sounddevice)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections import deque

import numpy as np

from client.client import AudioMessage, ErrorMessage, EventMessage, KameClient, TextMessage
from client.console import describe_event
from kame.aec import EchoCanceller, EchoCancellerUnavailable
from kame.errors import KameError
from kame.protocol import FRAME_SIZE as FRAME
from kame.protocol import SAMPLE_RATE as RATE
from kame.queues import post


def _sounddevice():
    try:
        import sounddevice
    except (OSError, ImportError) as exc:  # PortAudio's shared library (or sounddevice itself) is missing
        raise KameError("no audio support on this machine: PortAudio is not installed "
                        "(Debian/Ubuntu: apt-get install libportaudio2)") from exc
    return sounddevice


def list_devices() -> str:
    sd = _sounddevice()
    devices = sd.query_devices()
    if not len(devices):
        return "no audio devices found"
    return str(devices)


def _check_devices(sd, device) -> None:
    try:
        sd.check_input_settings(device=device, channels=1, samplerate=RATE)
        sd.check_output_settings(device=device, channels=1, samplerate=RATE)
    except Exception as exc:  # sounddevice raises PortAudioError or ValueError
        raise KameError(f"no usable microphone/speaker ({exc}); see `kame talk --list-devices`") from exc


class _Speaker:
    """A jitter buffer between the websocket and the sound card callback."""

    def __init__(self, prefill_frames: int = 2) -> None:
        self.queue: deque[np.ndarray] = deque()
        self.prefill, self.playing, self.buffer = prefill_frames, False, np.zeros(0, dtype=np.float32)

    def push(self, pcm: np.ndarray) -> None:
        self.queue.append(pcm)

    def pull(self, count: int) -> np.ndarray:
        if not self.playing and len(self.queue) >= self.prefill:
            self.playing = True
        while self.playing and len(self.buffer) < count and self.queue:
            self.buffer = np.concatenate([self.buffer, self.queue.popleft()])
        if len(self.buffer) < count:
            self.playing = bool(self.queue)
            out = np.zeros(count, dtype=np.float32)
            out[: len(self.buffer)] = self.buffer
            self.buffer = np.zeros(0, dtype=np.float32)
            return out
        out, self.buffer = self.buffer[:count], self.buffer[count:]
        return out


def _canceller(aec: bool) -> EchoCanceller | None:
    """The echo canceller that keeps the speakers' sound out of what we send, unless turned off or missing."""
    if not aec:
        print("echo cancellation off (--no-aec): use headphones, or the assistant hears itself", file=sys.stderr)
        return None
    try:
        canceller = EchoCanceller()
    except EchoCancellerUnavailable as exc:
        print(f"{exc}; going on without it: use headphones, or the assistant hears itself", file=sys.stderr)
        return None
    print("echo cancellation on (WebRTC AEC3; --no-aec turns it off)", file=sys.stderr)
    return canceller


def _echo_delay_ms(time_info, latency) -> int | None:
    """How long after its capture the mic block of one callback is played back by the same callback's
    output block (DAC time - ADC time), as the canceller's delay hint; the stream's latencies summed
    where the host reports no times; None: unknown."""
    delay = time_info.outputBufferDacTime - time_info.inputBufferAdcTime
    if delay <= 0 and isinstance(latency, tuple | list):
        delay = sum(latency)
    return round(delay * 1000) if 0 < delay < 1 else None


async def talk(url: str, device: str | None, backend: str | None, aec: bool = True,
               options: dict | None = None) -> int:
    sd = _sounddevice()
    if device is not None and device.isdigit():
        device = int(device)
    _check_devices(sd, device)
    loop = asyncio.get_running_loop()
    # pairs of (mic block, block played by the same callback): the played one is the echo's reference
    mic: asyncio.Queue[tuple[np.ndarray, np.ndarray]] = asyncio.Queue(maxsize=50)
    speaker = _Speaker()
    level = [0.0]
    canceller = _canceller(aec)

    def on_audio(indata, outdata, frames, time_info, status) -> None:
        pcm = indata[:, 0].copy()
        level[0] = float(np.sqrt(np.mean(pcm ** 2)))
        played = speaker.pull(frames)
        outdata[:, 0] = played
        if canceller is not None:
            canceller.delay_ms = _echo_delay_ms(time_info, stream.latency)
        post(loop, lambda: mic.full() or mic.put_nowait((pcm, played)))

    client = await KameClient.connect(url, events=True, backend=backend, options=options or None)
    print("connected; speak (Ctrl-C to stop)", file=sys.stderr)
    assistant = []

    async def send() -> None:
        while True:
            pcm, played = await mic.get()
            await client.send_pcm(pcm if canceller is None else canceller.process_input(pcm, played))

    async def receive() -> None:
        async for message in client:
            if isinstance(message, AudioMessage):
                speaker.push(message.pcm)
            elif isinstance(message, TextMessage):
                assistant.append(message.text)
                print(f"\r\x1b[Kassistant: {''.join(assistant).strip()[-70:]}", end="", flush=True)
            elif isinstance(message, EventMessage):
                line = describe_event(message.event.model_dump(exclude_none=True))
                if line:
                    print(f"\r\x1b[K{line}", flush=True)
            elif isinstance(message, ErrorMessage):
                print(f"\r\x1b[Kerror: {message.text}", flush=True)

    async def meter() -> None:
        while True:
            bars = int(min(1.0, level[0] * 10) * 20)
            print(f"\r\x1b[Kmic [{'#' * bars}{' ' * (20 - bars)}]", end="", flush=True, file=sys.stderr)
            await asyncio.sleep(0.1)

    stream = sd.Stream(samplerate=RATE, blocksize=FRAME, channels=1, dtype="float32", device=device,
                       callback=on_audio)
    helpers = []
    try:
        with stream:
            helpers = [asyncio.create_task(send(), name="talk-send"), asyncio.create_task(meter(), name="talk-meter")]
            await receive()  # until the server closes the session or Ctrl-C cancels us
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        with contextlib.suppress(Exception):
            await client.close()
        print("\nbye", file=sys.stderr)
    return 0
