"""The `kyutai-stt` ASR engine: Kyutai's streaming speech-to-text model, batched over sessions.

The model (e.g. `kyutai/stt-1b-en_fr`) is a Moshi-style LM with no depformer: Mimi codes in,
text tokens out, a fixed `audio_delay_seconds` behind the audio, after a silence prefix of
`audio_silence_prefix_seconds` (both from its config's `stt_config`). Some checkpoints have extra
heads that predict the end of a turn ("semantic VAD"); some may not (Kyutai's own `--vad` example
switches from `kyutai/stt-1b-en_fr` to `kyutai/stt-1b-en_fr-candle`, which suggests the PyTorch repo
lacks them; unverified here), and then a turn ends after a pause that Silero VAD hears on the input,
judged by Smart Turn where pipecat-ai is installed (`end_of_turn.py`: a pause in mid-sentence goes on).
Which one a checkpoint is comes from its own header and config, and start-up says. It loads through
the front-end loader (same layouts) and runs on its own engine thread, all sessions' streams
stepped in one batch per frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Literal

import numpy as np
import torch
from moshi.models.lm import LMGen
from moshi.utils.compile import no_compile
from pydantic import Field

from kame.asr.end_of_turn import FramePauseJudge, load_turn_model
from kame.asr.events import AsrFailure, FinalTranscript, PartialTranscript, TranscriptEvent, drain_events
from kame.asr.vad import SilenceEndOfTurn, silero_session
from kame.errors import EngineError
from kame.frontend.engine import FRAME_RATE, FRAME_SIZE
from kame.frontend.loader import Frontend, load_frontend
from kame.frontend.oracle import PieceDecoder
from kame.frontend.rows import SlotRows, row_views
from kame.frontend.runner import EngineRunner
from kame.queues import post

SETTLE_FRAMES = 5  # frames without text (0.4 s) after a word: a pause, and its words settled (stable_text.py)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SttOptions:
    """Kyutai's STT's options; also the schema of the server's [kyutai_stt] table (server/settings.py, less the
    model, device and batch size set elsewhere), so each field's bounds are written here."""

    model: str = "kyutai/stt-1b-en_fr"  # hub repo, local directory, or the `tiny-stt` preset
    device: str = "auto"
    max_sessions: int = 8  # batch size of the STT engine
    eot_head: Annotated[int, Field(ge=0)] = 2  # which extra head predicts the end of a turn (Kyutai's STT 1B: 2)
    eot_threshold: Annotated[float, Field(gt=0, lt=1)] = 0.5  # end-of-turn probability that ends an utterance
    # without an end-of-turn head: a pause this long (and at least the model's delay) ends the turn
    min_silence_s: Annotated[float, Field(gt=0, le=5)] = 0.6
    # Silero speech probability that counts as speech (the pause rule)
    vad_threshold: Annotated[float, Field(gt=0, lt=1)] = 0.5
    # without a head, "smart-turn": a pause of min_silence_s ends the turn only if Smart Turn calls it complete
    # (eot_threshold; asked on a worker thread); "silence": the pause alone does (docs/turn-taking.md)
    end_of_turn: Literal["smart-turn", "silence"] = "smart-turn"
    # smart-turn: how much of the pause the model hears (as whisper's)
    eot_tail_s: Annotated[float, Field(gt=0, le=2)] = 0.1
    # smart-turn: this much silence ends a turn whatever the model said
    eot_fallback_s: Annotated[float, Field(gt=0, le=10)] = 2.5
    smart_turn_model: str | None = None  # smart-turn: an ONNX file; None: the one pipecat-ai ships


@dataclass(frozen=True)
class SttFrame:
    slot: int
    frame: int
    text_token: int | None
    end_of_turn: float  # from the end-of-turn head, or the pause rule where the model has none


class SttBatch:
    """The synchronous batched step of the STT model (the shape `EngineRunner` drives)."""

    def __init__(self, model: Frontend, batch_size: int, eot_head: int,
                 pause_rule: Callable[[], SilenceEndOfTurn] | None = None, compact: bool = True) -> None:
        """`pause_rule`: where the model has no end-of-turn head, a new rule per stream. `compact`: a step
        runs the streams' rows only, not every slot (kame/frontend/rows.py)."""
        self.model, self.batch_size, self.eot_head = model, batch_size, eot_head
        self._pause_rule = pause_rule
        self._pauses: dict[int, SilenceEndOfTurn] = {}
        self.device = model.device
        self.lm_gen = LMGen(model.lm, use_sampling=False, temp=0.0, temp_text=0.0, support_out_of_sync=True)
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(model.mimi.streaming(batch_size))
        self._stack.enter_context(self.lm_gen.streaming(batch_size))
        views = row_views([model.mimi, self.lm_gen, model.lm], batch_size, compact, "kyutai-stt")
        self._rows = SlotRows(batch_size, views, self.device.type == "cuda")
        self._active: set[int] = set()
        self._frames = [0] * batch_size
        self._skip = {model.lm.text_padding_token_id, model.lm.end_of_text_padding_id}

    @property
    def free_slots(self) -> int:
        return self.batch_size - len(self._active)

    def acquire(self) -> int:
        free = [s for s in range(self.batch_size) if s not in self._active]
        if not free:
            raise EngineError(f"all {self.batch_size} ASR slots are in use")
        self._rows.take(free[0])
        self._active.add(free[0])
        self.reset_slot(free[0])
        return free[0]

    def reset_slot(self, slot: int) -> None:
        """A clean start for the slot: on acquire, and after a failed step (the runner calls it)."""
        self._rows.reset(slot, [self.model.mimi, self.lm_gen], self.device)
        self._frames[slot] = 0
        if self._pause_rule is not None:
            self._pauses[slot] = self._pause_rule()

    def release(self, slot: int) -> None:
        if slot in self._active:
            self._active.discard(slot)
            self._rows.release(slot)  # the last live row moves into its hole (the pause rules are by slot)

    def push_oracle(self, slot: int, update) -> None:
        raise EngineError("the STT model takes no oracle")

    @torch.no_grad()
    def step(self, frames: Mapping[int, np.ndarray], timings: dict | None = None) -> list[SttFrame]:
        n = self._rows.view()
        rows = {slot: self._rows.row(slot) for slot in frames}
        mask = torch.zeros(n, dtype=torch.bool)
        mask[list(rows.values())] = True
        mask = mask.to(self.device)
        pcm = torch.zeros(n, 1, FRAME_SIZE)
        for slot, frame in frames.items():
            pcm[rows[slot], 0] = torch.from_numpy(np.asarray(frame, dtype=np.float32))
        try:
            with no_compile():
                self.model.mimi.set_exec_mask(mask)
                codes = self.model.mimi.encode(pcm.to(self.device))
                self.lm_gen.set_exec_mask(mask)
                tokens, heads = self.lm_gen.step_with_extra_heads(codes)
        finally:
            self._rows.sync()
        text = tokens[:, 0, 0].cpu().tolist()
        eot = heads[self.eot_head][:, 0, 0].float().cpu().tolist() if len(heads) > self.eot_head else None
        outputs = []
        for slot in sorted(frames):
            token = text[rows[slot]]
            end = eot[rows[slot]] if eot else self._pauses[slot](frames[slot]) if self._pauses else 0.0
            outputs.append(SttFrame(slot, self._frames[slot], None if token < 0 or token in self._skip else token,
                                    end))
            self._frames[slot] += 1
        return outputs

    def close(self) -> None:
        self._stack.close()


class KyutaiSttAsr:
    name = "kyutai-stt"
    languages = ("en", "fr")  # kyutai/stt-1b-en_fr; it tells them apart itself

    def __init__(self, options: SttOptions = SttOptions()) -> None:
        self.options = options
        self.model = load_frontend(options.model, options.device, role="stt")
        if self.model.tokenizer is None:
            raise EngineError(f"STT model {options.model!r} has no tokenizer")
        if self.model.model_type != "stt":
            logger.warning("kyutai-stt: %s says model_type %r, not 'stt'", options.model, self.model.model_type)
        stt = self.model.stt_config
        # whole frames of silence first, rounded up as Kyutai's scripts round them
        self.prefix_frames = math.ceil(float(stt.get("audio_silence_prefix_seconds", 0.0)) * FRAME_RATE)
        self.delay_s = float(stt.get("audio_delay_seconds", 0.5))
        self.end_of_turn = "head" if len(self.model.lm.extra_heads) > options.eot_head else "pause"
        pause_rule, self.turn_model, self._judges = None, None, None
        if self.end_of_turn == "pause":
            frames = SilenceEndOfTurn.frames_for(options.min_silence_s, self.delay_s, FRAME_RATE)
            self.turn_model, why = load_turn_model(options.end_of_turn, options.smart_turn_model)
            if self.turn_model is not None:
                self._judges = ThreadPoolExecutor(1, thread_name_prefix="kame-smart-turn")
            pause_rule = partial(SilenceEndOfTurn, silero_session(), frames, options.vad_threshold)
            logger.warning("kyutai-stt: %s has no end-of-turn head (extra_heads[%d]): a turn ends after %.2f s of "
                           "silence (Silero VAD) instead; judged by %s", options.model, options.eot_head,
                           frames / FRAME_RATE, why)
        self.batch = SttBatch(self.model, options.max_sessions, options.eot_head,
                              pause_rule and partial(self._pause_rule, pause_rule))
        # up to 60 s of backlog per stream; beyond it the oldest audio is dropped
        self.runner = EngineRunner(self.batch, batch_window_s=0.02, max_pending_frames=750, clock="eager",
                                   jitter_frames=None).start()
        logger.info("ASR kyutai-stt: %s, %d slots, text %.2f s behind the audio",
                    options.model, options.max_sessions, self.delay_s)

    def _pause_rule(self, rule: Callable[..., SilenceEndOfTurn]) -> SilenceEndOfTurn:
        """A stream's pause rule (made on the engine thread when a slot is reset), with its own judge."""
        if self.turn_model is None:
            return rule()
        o = self.options
        # asked as soon as it has heard its bit of the pause: the answer (~0.1 s) is back well before the
        # pause rule's own frames have passed, and the engine never waits for it
        return rule(FramePauseJudge(self.turn_model, self._judges, FRAME_SIZE * 2 // 3,
                                    math.ceil(o.eot_tail_s * FRAME_RATE), math.ceil(o.eot_fallback_s * FRAME_RATE),
                                    o.eot_threshold, o.eot_tail_s))

    def open_stream(self) -> KyutaiSttStream:
        return KyutaiSttStream(self)

    def warm_up(self) -> None:
        self.runner.warm_up()

    def close(self) -> None:
        self.runner.stop()
        self.batch.close()
        if self._judges is not None:
            self._judges.shutdown(cancel_futures=True)


    def describe(self) -> dict:
        """What a front process needs to run this batch's streams through the engine process (`RemoteKyutaiStt`)."""
        return {"tokenizer": self.model.tokenizer.serialized_model_proto(), "prefix_frames": self.prefix_frames,
                "delay_s": self.delay_s, "eot_threshold": self.options.eot_threshold, "end_of_turn": self.end_of_turn}


@dataclass(frozen=True)
class _Tokenizer:
    tokenizer: object  # what a stream's PieceDecoder reads (`asr.model.tokenizer`)


@dataclass(frozen=True)
class _Threshold:
    eot_threshold: float  # what a stream reads of the options


class RemoteKyutaiStt:
    """kyutai-stt in a front process, its batch in the engine process (kame/frontend/remote.py): the streams
    are the same `KyutaiSttStream`s, their frames go to the host's runner (`describe()` made `info`)."""

    name = "kyutai-stt"
    languages = ("en", "fr")

    def __init__(self, runner, info: Mapping) -> None:
        import sentencepiece

        self.runner = runner
        self.model = _Tokenizer(sentencepiece.SentencePieceProcessor(model_proto=info["tokenizer"]))
        self.prefix_frames, self.delay_s = info["prefix_frames"], info["delay_s"]
        self.options = _Threshold(info["eot_threshold"])
        self.end_of_turn = info["end_of_turn"]

    def open_stream(self) -> KyutaiSttStream:
        return KyutaiSttStream(self)

    def warm_up(self) -> None:
        """The engine process warmed the batch."""

    def close(self) -> None:
        """The batch is the engine process's."""


class KyutaiSttStream:
    """One session on the shared STT engine; frames are re-cut to 1920 samples."""

    def __init__(self, asr: KyutaiSttAsr) -> None:
        self.asr = asr
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[TranscriptEvent | None] = asyncio.Queue()
        self._pending = np.zeros(0, dtype=np.float32)
        self._handle = None
        self._words: list[str] = []
        self._quiet = 0  # frames without text since the utterance's last piece
        self._pieces = PieceDecoder(asr.model.tokenizer)
        self._utterance_start: float | None = None
        self._frames_out = 0
        self._flushed: asyncio.Event | None = None
        self._flush_until = 0
        self._frames_in = 0
        self._closed = False
        self._opening = asyncio.ensure_future(self._open())

    async def _open(self) -> None:
        try:
            self._handle = await self.asr.runner.acquire_async(self._on_output_threadsafe, self._on_error_threadsafe)
        except EngineError as exc:
            self._events.put_nowait(AsrFailure(str(exc)))
            return
        prefix = np.zeros(self.asr.prefix_frames * FRAME_SIZE, dtype=np.float32)
        self._pending = np.concatenate([prefix, self._pending])  # the silence the model expects first
        self._push_frames(np.zeros(0, dtype=np.float32))

    def push_pcm(self, pcm: np.ndarray) -> None:
        if not self._closed:
            self._push_frames(np.asarray(pcm, dtype=np.float32))

    def _push_frames(self, pcm: np.ndarray) -> None:
        self._pending = np.concatenate([self._pending, pcm])
        if self._handle is None:
            return
        while len(self._pending) >= FRAME_SIZE:
            self._handle.push_frame(self._pending[:FRAME_SIZE])
            self._pending = self._pending[FRAME_SIZE:]
            self._frames_in += 1

    async def flush(self) -> None:
        await self._opening
        if self._handle is None:
            return
        tail = int(np.ceil(self.asr.delay_s * FRAME_RATE)) + 1
        self._push_frames(np.zeros(tail * FRAME_SIZE - len(self._pending) % FRAME_SIZE, dtype=np.float32))
        self._flush_until = self._frames_in - self._handle.dropped_frames
        self._flushed = asyncio.Event()
        if self._frames_out < self._flush_until:
            await self._flushed.wait()
        self._final()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._opening
        if self._handle is not None:
            self._handle.release()
        self._events.put_nowait(None)

    def __aiter__(self) -> AsyncIterator[TranscriptEvent]:
        return drain_events(self._events)

    # engine thread -> loop
    def _on_output_threadsafe(self, out: SttFrame) -> None:
        post(self._loop, self._on_output, out)

    def _on_error_threadsafe(self, exc: BaseException) -> None:
        post(self._loop, self._events.put_nowait, AsrFailure(f"kyutai-stt failed: {exc}"))

    def _audio_time(self, frame: int) -> float:
        return max(0.0, (frame - self.asr.prefix_frames) / FRAME_RATE - self.asr.delay_s)

    def _on_output(self, out: SttFrame) -> None:
        self._frames_out += 1
        now = self._audio_time(out.frame + 1)
        try:
            if out.text_token is not None:
                self._quiet = 0
                self._word_piece(out, now)
            elif self._words and out.end_of_turn >= self.asr.options.eot_threshold:
                self._final(now)  # on a frame without text: a word's pieces come on frames in a row
            elif self._words:
                self._quiet += 1
                if self._quiet == SETTLE_FRAMES:  # a pause, though the turn may go on: its words are said
                    self._events.put_nowait(PartialTranscript(" ".join(self._words).strip(), self._utterance_start,
                                                              now, settled=True))
        finally:  # a flush waits for this frame whatever became of it
            if self._flushed is not None and self._frames_out >= self._flush_until:
                self._flushed.set()

    def _word_piece(self, out: SttFrame, now: float) -> None:
        piece = self._pieces.push(out.text_token)
        if not piece:
            return  # part of a character: its bytes are still coming
        if self._utterance_start is None:
            self._utterance_start = self._audio_time(out.frame)
        if piece.startswith(" ") or not self._words:
            self._words.append(piece.strip())
        else:
            self._words[-1] += piece
        self._events.put_nowait(PartialTranscript(" ".join(self._words).strip(), self._utterance_start, now))

    def _final(self, end_s: float | None = None) -> None:
        text = " ".join(self._words).strip()
        if text:
            end = end_s if end_s is not None else self._audio_time(self._frames_out)
            self._events.put_nowait(FinalTranscript(text, self._utterance_start or 0.0, end))
        self._words, self._utterance_start = [], None
