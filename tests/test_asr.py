"""Streaming ASR: real Whisper tiny.en on synthesised speech, the kyutai-stt plumbing, `none`."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from kame.asr import FinalTranscript, NoAsr, PartialTranscript, build_asr
from kame.asr.transcribe import transcribe_pcm
from kame.asr.whisper import AsrError, WhisperAsr, WhisperOptions, bundled_tiny_en, resolve_model
from kame.audio import SAMPLE_RATE
from kame.cli import main
from kame.pcm import Resampler
from kame.testing.speech import speech

QUESTION = "What is the capital of France, and why is it so famous?"


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


@pytest.fixture(scope="module")
def whisper() -> WhisperAsr:
    asr = WhisperAsr(WhisperOptions())
    yield asr
    asr.close()


@pytest.fixture(scope="module")
def question_pcm(tmp_path_factory) -> np.ndarray:
    pcm = speech(QUESTION, tmp_path_factory.mktemp("tts"))
    assert len(pcm) / 24000 > 3.0  # a question of more than three seconds
    return np.concatenate([np.zeros(12000, np.float32), pcm, np.zeros(24000, np.float32)])


@pytest.mark.realtime
def test_real_time_partials_arrive_before_the_question_ends(whisper, question_pcm):
    speech_end_s = (len(question_pcm) - 24000) / 24000

    async def scenario():
        stream = whisper.open_stream()
        seen: list[tuple[float, object]] = []
        started = time.monotonic()

        async def collect():
            async for event in stream:
                seen.append((time.monotonic() - started, event))

        task = asyncio.create_task(collect())
        for start in range(0, len(question_pcm), 1920):
            stream.push_pcm(question_pcm[start:start + 1920])
            await asyncio.sleep(0.08)
        await stream.flush()
        await stream.aclose()
        await task
        return seen

    seen = asyncio.run(scenario())
    partials = [(t, e) for t, e in seen if isinstance(e, PartialTranscript)]
    finals = [e for _, e in seen if isinstance(e, FinalTranscript)]
    assert partials and partials[0][1].end_s < speech_end_s - 0.5  # heard mid-question ...
    assert partials[0][0] < speech_end_s  # ... and delivered before the question ended (wall time)
    assert len(finals) == 1 and words(finals[0].text) == words(QUESTION)
    assert 0.2 < finals[0].start_s < 0.7 and finals[0].end_s <= len(question_pcm) / 24000 + 0.05
    assert all(a.end_s <= b.end_s for (_, a), (_, b) in zip(seen, seen[1:], strict=False))


def test_two_utterances_give_two_finals(whisper, question_pcm, tmp_path):
    second = speech("Thank you very much.", tmp_path)
    pcm = np.concatenate([question_pcm, second, np.zeros(24000, np.float32)])
    events = asyncio.run(transcribe_pcm(build_asr("whisper", realtime=False), pcm))
    finals = [e for e in events if isinstance(e, FinalTranscript)]
    assert [words(f.text) for f in finals] == [words(QUESTION), ["thank", "you", "very", "much"]]
    assert finals[1].start_s > finals[0].end_s


def test_model_resolution_and_checksum(tmp_path, monkeypatch):
    bundled = bundled_tiny_en()
    assert bundled is not None and resolve_model("tiny.en") == str(bundled)
    assert resolve_model("small.en") == "small.en"  # left to faster-whisper's download
    (tmp_path / "model.bin").write_bytes(b"x")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(AsrError, match="no model.bin"):
        resolve_model(str(tmp_path / ".."))
    import kame.asr.whisper as whisper_module

    monkeypatch.setitem(whisper_module.BUNDLED_TINY_EN_SHA256, "model.bin", "0" * 64)
    with pytest.raises(AsrError, match="sha256"):
        bundled_tiny_en()


def test_missing_model_offline_is_a_clear_error(tmp_path):
    with pytest.raises(AsrError, match="cannot load Whisper model"):
        WhisperAsr(WhisperOptions(model=str(tmp_path / "nowhere" / "model")))


def test_kyutai_stt_plumbing_batches_streams(rng):
    asr = build_asr("kyutai-stt", "tiny-stt", "cpu", max_sessions=2)
    pcm = (rng.standard_normal(24000 * 2) * 0.1).astype(np.float32)

    async def scenario():
        return await asyncio.gather(transcribe_pcm(asr, pcm), transcribe_pcm(asr, pcm * 0.5))

    try:
        first, second = asyncio.run(scenario())
        frames = 2 * (3 + 25 + 3)  # each stream: silence prefix + 2 s of audio + the delay tail
        assert asr.runner.steps < frames  # the two streams shared steps
    finally:
        asr.close()
    for events in (first, second):
        assert events and isinstance(events[-1], FinalTranscript)
        partials = [e for e in events if isinstance(e, PartialTranscript)]
        assert partials and all(a.end_s <= b.end_s for a, b in zip(partials, partials[1:], strict=False))
        assert events[-1].text.startswith(partials[0].text.split()[0])


def test_no_asr_emits_nothing():
    async def scenario():
        stream = NoAsr().open_stream()
        stream.push_pcm(np.zeros(1920, np.float32))
        await stream.flush()
        await stream.aclose()
        return [e async for e in stream]

    assert asyncio.run(scenario()) == []


def test_resampler_is_chunk_invariant_and_keeps_the_pitch():
    t = np.arange(24000) / 24000
    x = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    whole = Resampler(SAMPLE_RATE, 16000)(x)
    chunked = Resampler(SAMPLE_RATE, 16000)
    pieces = np.concatenate([chunked(x[i:i + 700]) for i in range(0, len(x), 700)])
    assert len(whole) == 16000 and np.allclose(whole, pieces[: len(whole)], atol=1e-5)
    spectrum = np.abs(np.fft.rfft(whole[1000:]))
    peak_hz = np.argmax(spectrum) * 16000 / len(whole[1000:])
    assert abs(peak_hz - 440) < 2


def test_transcribe_cli(capsys):
    fixture = Path(__file__).parent / "fixtures" / "question.wav"
    assert main(["transcribe", "--json", str(fixture)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[-1]["type"] == "final" and words(lines[-1]["text"]) == words("What is the capital of France?")
    assert any(line["type"] == "partial" for line in lines)
    assert all(0 <= line["start_s"] <= line["end_s"] <= 1.8 for line in lines)


def test_kyutai_stt_steps_its_streams_rows_only_and_a_moved_stream_hears_as_alone(rng):
    """The STT batch runs its streams' rows only (kame/frontend/rows.py): a stream whose row moves when
    another leaves gets the text tokens it gets alone (b starts 3 frames after a: the random model's
    tokens follow each row's own position, so a stream left on the other's row would show)."""
    from kame.asr.kyutai_stt import SttBatch
    from kame.frontend.loader import load_frontend

    model = load_frontend("tiny-stt", "cpu", role="stt")
    frames = {name: [(rng.standard_normal(1920) * scale).astype(np.float32) for _ in range(20)]
              for name, scale in (("a", 0.3), ("b", 0.1))}

    def run(batch_size: int, joins: dict, leaves: dict) -> tuple[list, list]:
        batch = SttBatch(model, batch_size, eot_head=0)
        try:
            slots, heard, got, sizes = {}, {"a": 0, "b": 0}, [], []
            for tick in range(16):
                for name in leaves.get(tick, ""):
                    batch.release(slots.pop(name))
                for name in joins.get(tick, ""):
                    slots[name] = batch.acquire()
                outs = batch.step({slot: frames[name][heard[name]] for name, slot in slots.items()})
                for name in slots:
                    heard[name] += 1
                got += [o.text_token for o in outs if "b" in slots and o.slot == slots["b"]]
                sizes.append(batch.lm_gen._streaming_state.batch_size)
            return got, sizes
        finally:
            batch.close()

    together, sizes = run(4, {0: "a", 3: "b"}, {8: "a"})
    alone, _ = run(1, {3: "b"}, {})
    assert sizes == [1] * 3 + [2] * 5 + [1] * 8  # the rows of the streams, not the 4 slots
    assert together == alone
