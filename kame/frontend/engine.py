"""The batched front-end step: PCM frames and oracle tokens of many slots in, audio and text out.

One `BatchedEngine` owns the streaming state of Mimi and the LM for `batch_size` slots. Each
call to `step` runs Mimi encode, one LM step with every slot's oracle embedding added to its
input, and Mimi decode, for all the slots given a frame at once; the others are paused with
moshi's exec mask. It is synchronous and knows nothing of sockets, LLMs or threads.

A step costs what the sessions cost, not the slots: each acquired slot holds a row of the batch, the
live rows are kept at the front (a leaving session's row is filled by the last one), and a step runs
on views of the first rows only (kame/frontend/rows.py), their number rounded up to a few sizes on
CUDA so that each size keeps its CUDA graphs. Slots are the sessions' stable names; rows move.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from moshi.models.lm import LMGen
from moshi.utils.compile import no_compile
from moshi.utils.sampling import sample_token

from kame.audio import FRAME_SIZE, SAMPLE_RATE
from kame.errors import EngineError, SlotsBusy
from kame.frontend.int8_attention import install_fused_attention, remove_fused_attention
from kame.frontend.kv_cache import KvCacheKind, int8_kv_caches
from kame.frontend.loader import Frontend
from kame.frontend.oracle import AppliedUpdate, OracleTimeline, OracleUpdate
from kame.frontend.rows import SlotRows, row_views
from kame.frontend.sampling import GenerationConfig, Sampling, SlotSampler

logger = logging.getLogger(__name__)

FRAME_RATE = SAMPLE_RATE / FRAME_SIZE


@dataclass(frozen=True)
class FrameOutput:
    """What one slot produced for one input frame."""

    slot: int
    frame: int  # the slot's frame index (0 = first frame after acquire)
    pcm: np.ndarray  # float32 [FRAME_SIZE]; silence while audio_ready is False
    audio_ready: bool  # False for the slot's first frame(s): the LM's acoustic delay
    text_token: int | None  # None for padding or before the first generated token
    oracle_token: int  # the oracle token this frame's LM step received
    applied: tuple[AppliedUpdate, ...] = ()  # oracle updates applied just before this frame


@dataclass(frozen=True, eq=False)
class PromptFrame:
    """One frame a slot is stepped through with every stream given (a persona's prompt, as PersonaPlex's
    reference runs it): the text token and the assistant's codebooks win over what the LM samples, the user's
    codebooks are its input.

    A voice given as PersonaPlex's `.pt` holds no tokens but each step's summed input embedding: such a frame
    (`embedding`, [dim]) steps the LM on it as it is (its tokens are placeholders, never written). `restore`: the
    token of every stream (text, the assistant's, the user's) at this frame's position, put back before it is
    stepped, as the reference restores its token cache after replaying a voice's embeddings."""

    text: int
    assistant: tuple[int, ...]
    user: tuple[int, ...]
    embedding: torch.Tensor | None = None
    restore: tuple[int, ...] | None = None


class BatchedEngine:
    """Steps up to `batch_size` independent sessions (slots) of one front-end together."""

    def __init__(
        self,
        frontend: Frontend,
        batch_size: int,
        gen: GenerationConfig | None = None,
        compile: bool | None = None,
        compact: bool = True,
        kv_cache: KvCacheKind = "model",
    ) -> None:
        if batch_size < 1:
            raise EngineError("batch_size must be at least 1")
        if frontend.lm.dep_q == 0:
            raise EngineError(f"{frontend.source} generates no speech (a speech-to-text model)")
        self.frontend, self.batch_size = frontend, batch_size
        self.gen = gen or GenerationConfig.from_dict(frontend.lm_gen_config)
        self.device = frontend.device
        # torch.compile costs ~20 s per shape on a CPU for little gain: GPU only by default.
        self._compile = self.device.type == "cuda" if compile is None else compile
        lm = frontend.lm
        self.sampler = SlotSampler(batch_size, self.device, Sampling.of(self.gen), lm.text_padding_token_id)
        # each step, the sampler tells moshi what to sample with (temperature 1, no top-k once it has
        # shaped each slot's logits itself)
        self.lm_gen = _SlotLMGen(
            self.sampler, lm, use_sampling=self.gen.use_sampling, temp=1.0, temp_text=1.0, top_k=0, top_k_text=0,
            cfg_coef=self.gen.cfg_coef, cfg_is_no_text=self.gen.cfg_coef != 1.0 and lm.fuser is None,
            support_out_of_sync=True,
        )
        self._text_skip = {lm.text_padding_token_id, lm.end_of_text_padding_id}
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(frontend.mimi.streaming(batch_size))
        if kv_cache not in ("model", "int8"):
            raise EngineError(f"kv_cache must be 'model' or 'int8', not {kv_cache!r}")
        self.kv_cache = kv_cache
        with int8_kv_caches(lm) if kv_cache == "int8" else contextlib.nullcontext():
            self._stack.enter_context(self.lm_gen.streaming(batch_size))
        if kv_cache == "int8" and self.device.type == "cuda":  # the attention reads the int8 ring itself
            install_fused_attention(lm)
            self._stack.callback(remove_fused_attention, lm)
        self._base_condition = self._state.condition_sum  # a conditioned model's own sum, if any
        guided = self.gen.cfg_coef != 1.0  # guidance doubles the LM's batch: its rows are not the first n
        if guided:
            logger.info("classifier-free guidance: each step runs all %d slots", batch_size)
        views = None if guided else row_views([frontend.mimi, self.lm_gen, lm], batch_size, compact, "the front-end")
        self._rows = SlotRows(batch_size, views, self.device.type == "cuda")
        self._timelines = [
            OracleTimeline(lm.text_initial_token_id, lm.text_padding_token_id) for _ in range(batch_size)
        ]
        self._frames = [0] * batch_size
        self._pending: list[deque[OracleUpdate]] = [deque() for _ in range(batch_size)]
        self._active: set[int] = set()

    @property
    def _state(self):
        """The LM generator's streaming state now installed (a view of the first rows, or the batch)."""
        return self.lm_gen._streaming_state

    @property
    def compact(self) -> bool:
        """True when a step costs the live rows only (False: the whole batch)."""
        return self._rows.views is not None

    # -------------------------------------------------------------- slots

    @property
    def free_slots(self) -> int:
        return self.batch_size - len(self._active)

    @property
    def live_rows(self) -> int:
        """Rows a step runs now: the sessions, rounded up to a view size (the batch without views)."""
        return self._rows.view_size()

    def acquire(self, sampling: Sampling | None = None) -> int:
        """Take a free slot, reset to a clean start (codec, LM and oracle state), sampling as asked
        (None: the checkpoint's settings)."""
        free = [s for s in range(self.batch_size) if s not in self._active]
        if not free:
            raise SlotsBusy(f"all {self.batch_size} slots are in use")
        slot = free[0]
        row = self._rows.take(slot)
        self._active.add(slot)
        self.reset_slot(slot)
        self.sampler.set(row, sampling)
        return slot

    def release(self, slot: int) -> None:
        self._check_slot(slot)
        self._active.discard(slot)
        self._pending[slot].clear()
        self._timelines[slot].clear()
        moved = self._rows.release(slot)
        if moved is not None:
            self.sampler.move_row(*moved)

    def reset_slot(self, slot: int) -> None:
        self._rows.reset(slot, [self.frontend.mimi, self.lm_gen], self.device)
        self._timelines[slot].clear()
        self._pending[slot].clear()
        self._frames[slot] = 0

    @torch.no_grad()
    def warm_views(self) -> list[int]:
        """Capture each view size's CUDA graphs before any session comes: every size a step can use is
        run twice with all its rows masked (moshi leaves a masked row's state as it was); the sizes
        warmed. Nothing to capture on a CPU, or without views, or while a session holds a slot."""
        if not self.compact or self.device.type != "cuda" or self._active:
            return []
        padding = self.lm_gen.lm_model.text_padding_token_id
        for n in self._rows.sizes():
            self._rows.views.install(n)
            mask = torch.zeros(n, dtype=torch.bool, device=self.device)
            pcm = torch.zeros(n, 1, FRAME_SIZE, dtype=torch.float32, device=self.device)
            try:
                with contextlib.nullcontext() if self._compile else no_compile():
                    for _ in range(2):  # moshi's CUDAGraphed runs once, then captures
                        codes = self._encode(pcm, mask)
                        self._state.condition_sum = self.oracle_condition([padding] * n)
                        self.lm_gen.set_exec_mask(mask)
                        self._decode(self.lm_gen.step(codes), mask)
            finally:
                self._rows.sync()
        return self._rows.sizes()

    def sampling(self, slot: int) -> Sampling:
        """The sampling settings the slot was acquired with."""
        self._check_slot(slot)
        return self.sampler.settings(self._rows.row(slot))

    def frame_index(self, slot: int) -> int:
        """The slot's own frame counter: the index of the next frame it will step."""
        return self._frames[slot]

    def push_oracle(self, slot: int, update: OracleUpdate) -> None:
        """Queue an oracle update; it takes effect at the slot's next frame."""
        self._check_slot(slot)
        self._pending[slot].append(update)

    def _check_slot(self, slot: int) -> None:
        if slot not in self._active:
            raise EngineError(f"slot {slot} is not acquired")

    # -------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, frames: Mapping[int, np.ndarray], timings: dict[str, float] | None = None) -> list[FrameOutput]:
        """Step every slot in `frames` (slot -> FRAME_SIZE float32 samples) once, together.

        With `timings`, the device is synchronised after each phase (encode, lm, decode) and
        their durations in seconds are added to it: for benchmarks, not for serving.
        """
        if not frames:
            return []
        slots = sorted(frames)
        for slot in slots:
            self._check_slot(slot)
        n = self._rows.view()
        rows = [self._rows.row(slot) for slot in slots]
        pcm = self._pcm_batch(frames, n)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[rows] = True
        mask = mask.to(self.device)
        applied = {slot: self._apply_pending(slot) for slot in slots}
        padding = self.lm_gen.lm_model.text_padding_token_id
        oracle = [padding] * n
        for slot, row in zip(slots, rows, strict=True):
            oracle[row] = self._timelines[slot].token_at(self._frames[slot])
        clock = _PhaseClock(self.device, timings)
        try:
            with contextlib.nullcontext() if self._compile else no_compile():
                codes = self._encode(pcm, mask)
                clock.lap("encode")
                tokens = self._lm_step(codes, mask, oracle, slots)
                audio_ready = (tokens[:, 1:, 0] >= 0).all(dim=1) & mask
                clock.lap("lm")
                pcm_out = self._decode(tokens, audio_ready) if bool(audio_ready.any()) else None
                clock.lap("decode")
        finally:
            self._rows.sync()
        return self._outputs(slots, tokens.cpu(), audio_ready.cpu(), pcm_out, oracle, applied)

    @torch.no_grad()
    def prefill(self, slot: int, frames: Sequence[PromptFrame], begin: int = 0, end: int | None = None) -> None:
        """Step `slot` alone through `frames[begin:end]` of its prompt `frames` (its row only executes: the other
        rows keep their state), no Mimi either way; what the LM samples of the given streams is replaced, as the
        reference's "provided" tokens replace its samples, so the next frames see the prompt. Prefill before the
        slot's first frame; in parts (`begin`, `end`) as long as they follow each other."""
        self._check_slot(slot)
        end = len(frames) if end is None else end
        if begin >= end:
            return
        lm = self.lm_gen.lm_model
        n, row = self._rows.view(), self._rows.row(slot)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[row] = True
        mask = mask.to(self.device)
        state = self._state
        start = int(state.offsets[row]) - begin  # where the prompt's first frame is (was) stepped
        delays = lm.delays[: lm.dep_q + 1]
        streams = torch.tensor([[f.text, *f.assistant[: lm.dep_q]] for f in frames], dtype=torch.long)
        padding = lm.text_padding_token_id
        try:
            with contextlib.nullcontext() if self._compile else no_compile():
                for frame in frames[begin:end]:
                    if frame.restore is not None:
                        state = self._state
                        at = int(state.offsets[row]) % state.cache.shape[2]
                        state.cache[row, :, at] = torch.tensor(frame.restore, device=state.cache.device)
                    codes = torch.zeros(n, len(frame.user), 1, dtype=torch.long)
                    codes[row, :, 0] = torch.tensor(frame.user)
                    self._state.condition_sum = self.oracle_condition([padding] * n)
                    self.lm_gen.set_exec_mask(mask)
                    with self._given_input(row, frame.embedding):
                        self.lm_gen.step(codes.to(self.device))
                    self._frames[slot] += 1
                    state = self._state
                    position = int(state.offsets[row])  # the position this step wrote
                    for stream, delay in enumerate(delays):
                        index = position - delay - start  # the prompt frame whose token sits there
                        if 0 <= index < len(frames) and frames[index].embedding is None:
                            state.cache[row, stream, position % state.cache.shape[2]] = streams[index, stream]
        finally:
            self._rows.sync()

    @contextlib.contextmanager
    def _given_input(self, row: int, embedding: torch.Tensor | None):
        """Within it, an LM step takes `embedding` as `row`'s summed input embedding instead of the one its tokens
        make: moshi's `forward_text` with the row's input given (the other rows' as moshi sums them), run
        uncaptured (a prompt's few frames; CUDA graphs captured it without the override)."""
        if embedding is None:
            yield
            return
        lm, state = self.lm_gen.lm_model, self._state
        given = embedding.to(self.device, lm.dtype).reshape(1, -1)

        def main(sequence, sum_condition=None, cross_attention_src=None):
            input_ = None  # summed as moshi sums it: the audio codebooks, then the text
            for cb_index in range(lm.num_audio_codebooks):
                audio = lm.emb[cb_index](sequence[:, cb_index + lm.audio_offset])
                input_ = audio if input_ is None else input_ + audio
            text = lm.text_emb(sequence[:, 0])
            input_ = text if input_ is None else input_ + text
            if sum_condition is not None:
                input_ = input_ + sum_condition.to(input_)
            input_ = input_.clone()
            input_[row] = given
            if cross_attention_src is not None:
                cross_attention_src = cross_attention_src.to(input_)
            out = lm.transformer(input_, cross_attention_src=cross_attention_src)
            if lm.out_norm:
                out = lm.out_norm(out)
            return out, lm.text_linear(out)[:, None]

        captured, state.graphed_main = state.graphed_main, main
        try:
            yield
        finally:
            state.graphed_main = captured

    def _pcm_batch(self, frames: Mapping[int, np.ndarray], n: int) -> torch.Tensor:
        pcm = torch.zeros(n, 1, FRAME_SIZE, dtype=torch.float32)
        for slot, frame in frames.items():
            array = np.asarray(frame, dtype=np.float32)
            if array.shape != (FRAME_SIZE,):
                raise EngineError(f"slot {slot}: a frame must be {FRAME_SIZE} samples, got shape {array.shape}")
            pcm[self._rows.row(slot), 0] = torch.from_numpy(array)
        return pcm.to(self.device)

    def _apply_pending(self, slot: int) -> tuple[AppliedUpdate, ...]:
        results = []
        while self._pending[slot]:
            results.append(self._timelines[slot].apply(self._pending[slot].popleft(), self._frames[slot]))
        return tuple(results)

    def _encode(self, pcm: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.frontend.mimi.set_exec_mask(mask)
        return self.frontend.mimi.encode(pcm)  # [n, K, 1]

    def _lm_step(self, codes: torch.Tensor, mask: torch.Tensor, oracle: list[int], slots: list[int]) -> torch.Tensor:
        self._state.condition_sum = self.oracle_condition(oracle)
        self.lm_gen.set_exec_mask(mask)
        tokens = self.lm_gen.step(codes)  # [n, 1 + dep_q, 1]; never None with out-of-sync support
        assert tokens is not None
        for slot in slots:
            self._frames[slot] += 1
        return tokens

    def oracle_condition(self, oracle: list[int]) -> torch.Tensor | None:
        """The per-row sum added to the LM input: oracle embedding (+ the model's own condition). A front-end
        without an oracle (PersonaPlex's checkpoints) gets its own condition only (None: nothing): it runs as
        its reference does."""
        rows = len(oracle) * (2 if self.gen.cfg_coef != 1.0 else 1)
        condition = None
        if self.frontend.oracle_emb is not None:
            ids = torch.tensor(oracle, dtype=torch.long, device=self.device)
            condition = self.frontend.oracle_emb(ids)[:, None, :]  # [n, 1, dim]
            if self.gen.cfg_coef != 1.0:
                condition = condition.repeat(2, 1, 1)
        base = self._base_condition
        if base is not None:
            if base.shape[0] > 1 and base.shape[0] != rows:
                base = base[:rows]
            condition = base if condition is None else condition + base.to(condition)
        return condition

    def _decode(self, tokens: torch.Tensor, ready: torch.Tensor) -> torch.Tensor:
        mimi = self.frontend.mimi
        mimi.set_exec_mask(ready)
        return mimi.decode(tokens[:, 1:].clamp(min=0))[:, 0].float().cpu()  # [n, FRAME_SIZE]

    def _outputs(self, slots, tokens, audio_ready, pcm_out, oracle, applied) -> list[FrameOutput]:
        outputs = []
        for slot in slots:
            row = self._rows.row(slot)
            ready = bool(audio_ready[row])
            pcm = pcm_out[row].numpy() if ready else np.zeros(FRAME_SIZE, dtype=np.float32)
            text = int(tokens[row, 0, 0])
            text_token = None if text < 0 or text in self._text_skip else text
            self.sampler.record_text(row, text_token)
            frame = self._frames[slot] - 1
            outputs.append(FrameOutput(slot, frame, pcm, ready, text_token, oracle[row], applied[slot]))
        return outputs

    def close(self) -> None:
        self._stack.close()


class NullEngine(BatchedEngine):
    """A batch whose step computes nothing: each slot's input frame comes back as its output, at half
    the level, with no text; the slots, their frame counts and oracle timelines are kept as the real
    engine keeps them. The front-end preset `null` runs on it, so that a benchmark measures the host
    side of the server (websocket I/O, Opus, the ASR feed, the planners) without a model's compute."""

    def step(self, frames: Mapping[int, np.ndarray], timings: dict[str, float] | None = None) -> list[FrameOutput]:
        outputs = []
        for slot in sorted(frames):
            self._check_slot(slot)
            applied = self._apply_pending(slot)
            oracle = self._timelines[slot].token_at(self._frames[slot])
            self._frames[slot] += 1
            pcm = np.asarray(frames[slot], dtype=np.float32) * 0.5
            outputs.append(FrameOutput(slot, self._frames[slot] - 1, pcm, True, None, oracle, applied))
        return outputs


class _SlotLMGen(LMGen):
    """moshi's LMGen sampling each slot with its own settings (text: through moshi's logits hook;
    audio: in this depformer step, which moshi graphs on CUDA)."""

    def __init__(self, sampler: SlotSampler, *args, **kwargs) -> None:
        super().__init__(*args, on_text_logits_hook=self._on_text_logits, **kwargs)
        self._sampler = sampler
        self._graphed = self.lm_model.device.type == "cuda"  # moshi graphs the depformer on CUDA only

    def _on_text_logits(self, logits: torch.Tensor) -> None:
        self.temp_text, self.top_k_text = self._sampler.text_logits(logits)

    def depformer_step(self, text_token: torch.Tensor, transformer_out: torch.Tensor) -> torch.Tensor:
        lm = self.lm_model
        guided = self.cfg_coef != 1.0
        batch = text_token.shape[0]
        previous, tokens = text_token, []
        with lm.depformer.streaming(2 * batch if guided else batch):
            for codebook in range(lm.dep_q):
                sequence = previous[:, None, None]
                logits = lm.forward_depformer(codebook, sequence.repeat(2, 1, 1) if guided else sequence,
                                              transformer_out)
                if guided:
                    conditioned, unconditioned = logits.chunk(2)
                    logits = unconditioned + (conditioned - unconditioned) * self.cfg_coef
                logits, temperature, top_k = self._sampler.audio_logits(logits.float(), self._graphed)
                previous = sample_token(logits, self.use_sampling, temperature, top_k)[:, 0, 0]
                tokens.append(previous)
        return torch.stack(tokens, dim=1)


class _PhaseClock:
    """Adds the duration of each phase to `timings` (synchronising the device), or does nothing."""

    def __init__(self, device: torch.device, timings: dict[str, float] | None) -> None:
        self.device, self.timings = device, timings
        self.last = time.perf_counter() if timings is not None else 0.0

    def lap(self, phase: str) -> None:
        if self.timings is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self.last
        self.last = now
