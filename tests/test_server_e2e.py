"""The real server on loopback: tiny-copy front-end, real Whisper, a scripted OpenAI-compatible LLM."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from client.client import KameClient, ServerBusy
from kame.audio import FRAME_S

from .conftest import QUESTIONS, words
from .server_harness import (
    Recording,
    audio_accounted_for,
    few_dropped,
    received_samples,
    record,
    running_server,
    stream_realtime,
    wait_until,
    wait_until_all_slots_free,
)


def with_silence(pcm: np.ndarray, before_s: float = 0.3, after_s: float = 4.0) -> np.ndarray:
    return np.concatenate([np.zeros(int(before_s * 24000), np.float32), pcm,
                           np.zeros(int(after_s * 24000), np.float32)])


def attempts_running(got: Recording) -> bool:
    """Some LLM attempt has started and not yet ended (an attempt on the final transcript can still
    be streaming when the answer has been heard)."""
    last = {e.epoch: e.phase for e in got.of("llm")}
    return any(phase not in ("done", "cancelled", "failed") for phase in last.values())


async def talk(url: str, pcm: np.ndarray, until: str | None = None, max_after_s: float = 20.0
               ) -> tuple[Recording, float, int]:
    """Speak `pcm`, then keep sending silence in real time until the assistant has said `until`, the
    final transcript came and no LLM attempt is still running (or 4 s when None, or `max_after_s` at
    most): a loaded machine only makes it wait longer. The recording, the wall time the speech ended
    and the samples sent, all on one schedule (a late wake-up delays one frame, not all after it)."""
    client = await KameClient.connect(url + "/api/chat")
    got = Recording()
    receiver = asyncio.create_task(record(client, got))
    question = with_silence(pcm, after_s=0.0)
    start, _ = await stream_realtime(client, question)
    speech_end = start + 0.3 + len(pcm) / 24000
    silence = np.zeros(1920, np.float32)
    sent = len(question)
    for _ in range(int((max_after_s if until else 4.0) / 0.08)):
        heard_final = any(e.final for e in got.of("transcript"))
        if until is not None and until in got.text_stream and heard_final and not attempts_running(got):
            break
        await asyncio.sleep(max(0.0, start + sent / 24000 - time.monotonic()))
        await client.send_pcm(silence)
        sent += len(silence)
    await wait_until(lambda: audio_accounted_for(got, sent), "the audio of the last frames sent")
    await client.close()
    await receiver
    return got, speech_end, sent


@pytest.mark.realtime
def test_spoken_question_end_to_end(tandem_server, scripted_llm, voices):
    url, services = tandem_server
    llm = scripted_llm
    llm.requests.clear()
    llm.received_at.clear()
    pcm = voices["france"]
    got, speech_end, sent = asyncio.run(talk(url, pcm, until="Paris is the capital of France"))

    # the LLM was asked with a *partial* transcript before the question ended
    question = words(QUESTIONS["france"][0])
    early = [(body, at) for body, at in zip(llm.requests, llm.received_at, strict=True) if at < speech_end]
    assert early, "no LLM request before the end of the question"
    asked = early[0][0]["messages"][-1]["content"].split("\n")[-1].removeprefix("user: ")
    partials = {e.text for e in got.of("transcript") if not e.final}
    assert asked in partials  # what the LLM got was a partial transcript ...
    assert 0 < len(words(asked)) < len(question)  # ... of the unfinished question

    # the front-end's text stream (kind 2) speaks the scripted answer
    assert "Paris is the capital of France" in got.text_stream

    # audio comes back at 12.5 frames per second, one frame out per frame in (or reported dropped:
    # a loaded machine skips a lagging session to live)
    samples = sum(len(m.pcm) for m in got.audio)
    stats = got.of("stats")
    assert stats and few_dropped(stats[-1].frames_dropped, stats[-1].frames_in)
    assert abs(samples + stats[-1].frames_dropped * 1920 - sent) <= 3 * 1920
    first, last = got.audio[0].received_s, got.audio[-1].received_s
    assert 11.0 < (samples / 1920 - 1) / (last - first) < 14.0

    # JSON events arrive in order
    types = [m.event.type for m in got.events]
    assert types[0] == "ready"
    transcripts = got.of("transcript")
    assert not transcripts[0].final and transcripts[-1].final
    assert words(transcripts[-1].text) == question
    assert all(a.end_s <= b.end_s for a, b in zip(transcripts, transcripts[1:], strict=False))
    llm_events = got.of("llm")
    for epoch in {e.epoch for e in llm_events}:
        phases = [e.phase for e in llm_events if e.epoch == epoch]
        assert phases[0] == "started"
        assert phases[-1] in ("done", "cancelled", "failed")
        if "first_token" in phases:
            assert phases.index("first_token") == 1
    oracle = got.of("oracle")
    assert oracle[0].op == "reset"
    assert any(o.op == "reset" and o.text == "Paris" for o in oracle)  # once the partial named France
    frames = [o.frame for o in oracle]  # applied in order, at frames the session really stepped ...
    assert frames == sorted(frames) and frames[-1] < stats[-1].frames_out
    # ... after the audio of the first partial transcript (the LLM heard no earlier), less the
    # engine's jitter budget of 3 frames behind the audio received
    assert frames[0] >= transcripts[0].end_s / FRAME_S - 3, (frames[0], transcripts[0])
    assert stats and all(a.frames_in < b.frames_in for a, b in zip(stats, stats[1:], strict=False))
    # the last stats event is a snapshot: up to the jitter budget's 3 frames can still be queued
    # (frames_dropped also counts audio dropped after frames_out counted it: a bound, capped above)
    assert stats[-1].frames_out + stats[-1].frames_dropped >= stats[-1].frames_in - 3
    assert stats[-1].frame_latency_ms is not None


def test_four_sessions_each_hear_their_own_answer_and_a_fifth_is_refused(tandem_server, voices):
    url, services = tandem_server

    async def scenario():
        conversations = [talk(url, voices[key], until=answer) for key, (_, answer) in QUESTIONS.items()]
        tasks = [asyncio.create_task(c) for c in conversations]
        runner = services.runtime.runner
        await wait_until(lambda: runner.free_slots == 0, "the four sessions to hold every slot")
        with pytest.raises(ServerBusy):
            await KameClient.connect(url + "/api/chat")
        return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    for (key, (_, answer)), (got, _, _) in zip(QUESTIONS.items(), results, strict=True):
        assert answer in got.text_stream, f"{key}: {got.text_stream!r}"
        others = [a for k, (_, a) in QUESTIONS.items() if k != key]
        assert not any(other in got.text_stream for other in others)
    assert services.metrics.sessions_refused._value.get() >= 1


def test_moshi_protocol_client_without_extensions_gets_only_moshi_messages(tandem_server):
    url, _ = tandem_server

    async def scenario():
        client = await KameClient.connect(url + "/api/chat", events=False)
        got = Recording()
        receiver = asyncio.create_task(record(client, got))
        await stream_realtime(client, np.zeros(24000, np.float32))
        await client.close()
        await receiver
        return got

    got = asyncio.run(scenario())
    assert got.audio and not got.events


def test_disconnect_frees_the_slot(tiny_copy):
    with running_server(asr="none", max_sessions=1) as (url, services):
        async def scenario():
            first = await KameClient.connect(url + "/api/chat")
            await stream_realtime(first, np.zeros(12000, np.float32))
            first.ws.transport.abort()  # no closing handshake: the client just vanishes
            await wait_until(lambda: services.runtime.runner.free_slots == 1, "the vanished client's slot to be freed")
            second = await KameClient.connect(url + "/api/chat")
            got = Recording()
            receiver = asyncio.create_task(record(second, got))
            await stream_realtime(second, np.zeros(9600, np.float32))
            await wait_until(lambda: received_samples(got) >= 3 * 1920, "3 frames of audio back")  # it is served
            await second.close()
            await receiver

        asyncio.run(scenario())
        wait_until_all_slots_free(services, limit_s=5)
