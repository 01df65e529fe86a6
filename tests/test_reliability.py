"""Bad input, upstream faults and limits never take the server down or touch another session."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import urllib.request

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from client.client import EventMessage, KameClient, ServerBusy
from kame.asr.events import FinalTranscript, PartialTranscript
from kame.protocol import Kind, encode
from kame.testing.fakes import ScriptedAsr
from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply
from server.settings import ProfileSettings

from .server_harness import (
    Recording,
    audio_accounted_for,
    few_dropped,
    received_samples,
    record,
    running_server,
    stream_realtime,
    wait_until,
)

SECOND = np.zeros(24000, np.float32)


def events_of(got: Recording, kind: str) -> list:
    return got.of(kind)


async def open_recording(url: str, **kw) -> tuple[KameClient, Recording, asyncio.Task]:
    client = await KameClient.connect(url + "/api/chat", **kw)
    got = Recording()
    return client, got, asyncio.create_task(record(client, got))


async def finish(client: KameClient, task: asyncio.Task) -> None:
    await client.close()
    await task


async def audio_back(got: Recording, samples: int) -> None:
    """Wait for the audio of what was sent, less the last two frames (the codecs' look-ahead, in flight): every
    frame's, for the tests that run alone (realtime)."""
    await wait_until(lambda: received_samples(got) >= samples - 2 * 1920, f"{samples} samples of audio back")


async def served(got: Recording, samples: int) -> None:
    """The session kept serving what was sent: each frame came back as audio or was reported dropped (a loaded
    machine skips a lagging live session to live: by design, and told in the stats events), at most a quarter
    of them dropped, less the last two frames in flight. For tests that share the machine with a worker."""
    await wait_until(lambda: audio_accounted_for(got, samples), f"{samples} samples back or reported dropped")
    dropped = got.of("stats")[-1].frames_dropped if got.of("stats") else 0
    assert few_dropped(dropped, samples // 1920), f"{dropped} of {samples // 1920} frames dropped"


async def stats_where(got: Recording, predicate, what: str, timeout_s: float = 10.0):
    """The first stats event (one a second) that satisfies `predicate`."""
    def found():
        return next((s for s in events_of(got, "stats") if predicate(s)), None)
    await wait_until(found, what, timeout_s)
    return found()


def llm_failed(got: Recording) -> bool:
    return any(e.phase == "failed" for e in events_of(got, "llm"))


def test_bad_messages_get_errors_and_harm_no_one(caplog):
    with running_server(asr="none", max_sessions=4, max_message_bytes=8192) as (url, services):
        async def scenario():
            bad, bad_got, bad_task = await open_recording(url)
            good, good_got, good_task = await open_recording(url)
            streaming = asyncio.create_task(stream_realtime(good, np.zeros(24000 * 3, np.float32)))
            for garbage in (b"", bytes([42]) + b"x", b"\x03control", encode(Kind.CLIENT_JSON, b"{nope"),
                            encode(Kind.CLIENT_JSON, b'{"type": "configure", "backend": "nope"}'),
                            encode(Kind.CLIENT_JSON, b'{"type": "dance"}'),
                            encode(Kind.AUDIO, b"OggS" + bytes(60)), encode(Kind.AUDIO, b"not ogg at all"),
                            encode(Kind.PCM, b"\x01\x02\x03"), encode(Kind.PCM, bytes(10000))):
                await bad.send_raw(garbage)
            await bad.send_raw("a text frame")
            await wait_until(lambda: len(events_of(bad_got, "error")) >= 11, "an error event for each bad message")
            await stream_realtime(bad, SECOND)  # the bad client still gets served
            await streaming
            await served(bad_got, 24000)
            await served(good_got, 3 * 24000)
            await finish(bad, bad_task)
            await finish(good, good_task)
            return bad_got, good_got

        bad_got, good_got = asyncio.run(scenario())
        errors = [e.message for e in events_of(bad_got, "error")]
        assert len(errors) == 11, errors  # and no more came while it went on
        for expected in ("empty message", "unknown message kind 42", "may not send message kind 3",
                         "not JSON", "unknown backend profile 'nope'", "bad control message", "corrupt Ogg/Opus",
                         "even number of bytes", "exceeds 8192", "text frames"):
            assert any(expected in e for e in errors), (expected, errors)
        assert sum(len(m.pcm) for m in bad_got.audio) >= 24000 - 2 * 1920
        assert abs(sum(len(m.pcm) for m in good_got.audio) - 3 * 24000) <= 2 * 1920
        assert not events_of(good_got, "error")
        assert services.metrics.protocol_errors._value.get() == 11
    assert "Exception in ASGI" not in caplog.text


@pytest.mark.realtime
def test_audio_faster_than_real_time_is_bounded(tiny_copy):
    with running_server(asr="none", max_sessions=2, max_pending_frames=10) as (url, services):
        async def scenario():
            client, got, task = await open_recording(url)
            await client.send_pcm(np.zeros(24000 * 10, np.float32))  # 10 s at once: 125 frames
            burst = await stats_where(got, lambda s: s.frames_in == 125 and s.frames_out + s.frames_dropped == 125,
                                      "the burst to be stepped or dropped")
            await stream_realtime(client, SECOND)  # then 12.5 frames at real-time pace
            after = await stats_where(got, lambda s: s.frames_in >= burst.frames_in + 12,
                                      "the real-time second to reach the session")
            await finish(client, task)
            return burst, after

        burst, after = asyncio.run(scenario())
        assert burst.frames_dropped > 0  # the oldest frames beyond the bound were dropped ...
        assert burst.frames_out <= 10 and services.metrics.frames_dropped.labels("in")._value.get() > 0
        fed = after.frames_in - burst.frames_in
        assert after.frames_out - burst.frames_out >= fed - 1  # ... and the session went on, a frame out per
        assert after.frames_dropped == burst.frames_dropped  # frame in (the last may be in flight), none dropped


def test_flood_of_tiny_messages_is_cut_off():
    with running_server(asr="none", max_sessions=2, max_messages_per_s=50) as (url, _):
        async def scenario():
            client, got, task = await open_recording(url)
            started = time.monotonic()
            while time.monotonic() - started < 9 and client.close_code is None:
                for _ in range(20):
                    await client.send_raw(encode(Kind.PING))
                await asyncio.sleep(0.05)  # the flood's pace: 400 messages/s, over the limit of 50
            await task
            return got, client.close_code

        got, code = asyncio.run(scenario())
        assert code == 1008
        assert any("messages/s" in e.message for e in events_of(got, "error"))


def test_idle_and_session_time_limits():
    with running_server(asr="none", idle_timeout_s=1.0, max_session_s=30) as (url, _):
        async def idle():
            client, got, task = await open_recording(url)
            await task  # the server closes it
            return got, client.close_code

        got, code = asyncio.run(idle())
        assert code == 1001 and [(e.code, "no message" in e.message) for e in events_of(got, "error")] == [
            ("limit", True)]  # a limit, not a shutdown, though both close with 1001
    with running_server(asr="none", max_session_s=1.5) as (url, _):
        async def long_session():
            client, got, task = await open_recording(url)
            with contextlib.suppress(ConnectionClosed):  # the server ends it mid-stream
                await stream_realtime(client, np.zeros(24000 * 3, np.float32))
            await task
            return got, client.close_code

        got, code = asyncio.run(long_session())
        assert code == 1000 and any("1 s limit" in e.message or "2 s limit" in e.message
                                    for e in events_of(got, "error"))


def test_auth_tokens_origins_and_per_address_limit():
    with running_server(asr="none", max_sessions=4, auth_tokens=["tok-A", "tok-B"], max_connections_per_ip=2,
                        allowed_origins=["https://voice.example"]) as (url, _):
        async def scenario():
            statuses = {}
            for name, kw in {"none": {}, "wrong": {"additional_headers": {"Authorization": "Bearer nope"}},
                             "evil-origin": {"additional_headers": {"Authorization": "Bearer tok-A",
                                                                    "Origin": "https://evil.example"}}}.items():
                try:
                    ws = await __import__("websockets").connect(url + "/api/chat", **kw)
                    await ws.close()
                    statuses[name] = 101
                except InvalidStatus as exc:
                    statuses[name] = exc.response.status_code
            first = await KameClient.connect(url + "/api/chat?token=tok-B")
            import websockets

            second = await websockets.connect(url + "/api/chat", additional_headers={
                "Authorization": "Bearer tok-A", "Origin": "https://voice.example"})
            try:
                await KameClient.connect(url + "/api/chat?token=tok-A")
            except ServerBusy as exc:
                statuses["third"] = exc.status
            await first.close()
            await second.close()
            return statuses

        assert asyncio.run(scenario()) == {"none": 401, "wrong": 401, "evil-origin": 403, "third": 429}


def test_non_loopback_bind_needs_a_token():
    from server.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="--auth-token"):
        load_settings(None, host="0.0.0.0")
    assert load_settings(None, host="0.0.0.0", auth_tokens=["t"]).auth_required


def test_llm_faults_degrade_to_plain_moshi_and_open_the_circuit(caplog):
    script = [(0.5, PartialTranscript("what is the capital", 0.0, 0.5)),
              (1.0, PartialTranscript("what is the capital of France", 0.0, 1.0)),
              (1.5, FinalTranscript("what is the capital of France", 0.0, 1.5))]
    llm = ScriptedOpenAIServer(default=ScriptedReply(status=500))
    llm.start_in_thread()
    profiles = {"flaky": ProfileSettings(base_url=llm.base_url, model="m", api_key_env=None)}
    try:
        with running_server(asr="none", llm="flaky", profiles=profiles, breaker_failures=2,
                            breaker_cooldown_s=60) as (url, services):
            services.runtime.asr = ScriptedAsr(script)

            async def scenario():
                results = []
                for _ in range(2):  # two sessions: the circuit is per profile, shared
                    client, got, task = await open_recording(url)
                    await stream_realtime(client, np.zeros(24000 * 3, np.float32))
                    await wait_until(lambda got=got: llm_failed(got), "a failed LLM attempt")
                    await served(got, 3 * 24000)  # audio never stopped
                    await finish(client, task)
                    results.append(got)
                return results

            first, second = asyncio.run(scenario())
    finally:
        llm.stop_thread()
    failed = [e for e in events_of(first, "llm") if e.phase == "failed"]
    assert failed and failed[0].error_kind == "server" and failed[0].retry_in_s > 0
    later = [e for e in events_of(second, "llm") if e.phase == "failed"]
    assert later and all(e.error_kind == "unavailable" for e in later)  # fail fast: circuit open
    assert len(llm.requests) == 2  # the dead backend was not hammered


@pytest.mark.realtime  # every frame's audio back within a bound: a step of 744 ms beside a worker skipped frames
def test_asr_failure_and_stall_leave_the_session_running():
    for asr, expected in ((ScriptedAsr(fail_at_s=0.5), "scripted ASR failure"), (ScriptedAsr(stall=True), "behind")):
        with running_server(asr="none", asr_stall_s=1.0) as (url, services):
            services.runtime.asr = asr

            async def scenario():
                client, got, task = await open_recording(url)
                await stream_realtime(client, np.zeros(24000 * 3, np.float32))
                await wait_until(lambda: events_of(got, "asr"), "an asr event")
                await audio_back(got, 3 * 24000)
                await finish(client, task)
                return got

            got = asyncio.run(scenario())
        messages = [e.message for e in events_of(got, "asr")]
        assert messages and expected in messages[0]
        assert sum(len(m.pcm) for m in got.audio) >= 3 * 24000 - 2 * 1920


# every frame's audio back after the failure: a step of 590 ms beside a worker starting a Ray replica
# skipped frames to live (2026-12-04)
@pytest.mark.realtime
def test_engine_failure_ends_the_session_with_an_error_and_the_engine_goes_on(monkeypatch):
    with running_server(asr="none", max_sessions=2) as (url, services):
        original = services.runtime.engine.step
        calls = {"n": 0}

        def failing_once(frames, timings=None):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("simulated device fault")
            return original(frames, timings)

        monkeypatch.setattr(services.runtime.engine, "step", failing_once)

        async def scenario():
            client, got, task = await open_recording(url)
            with contextlib.suppress(ConnectionClosed):  # the server ends it mid-stream
                await stream_realtime(client, SECOND)
            await task
            after, after_got, after_task = await open_recording(url)
            await stream_realtime(after, SECOND)
            await audio_back(after_got, 24000)
            await finish(after, after_task)
            return got, client.close_code, after_got

        got, code, after_got = asyncio.run(scenario())
        assert code == 1011 and any("simulated device fault" in e.message for e in events_of(got, "error"))
        assert sum(len(m.pcm) for m in after_got.audio) >= 24000 - 2 * 1920


def test_out_of_memory_at_start_names_the_setting(monkeypatch):
    import torch

    from kame import runtime as runtime_module
    from kame.errors import FrontendLoadError
    from server import services as services_module
    from server.settings import load_settings

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(runtime_module, "BatchedEngine", no_memory)
    with pytest.raises(FrontendLoadError, match="--max-sessions"):
        services_module.Services.start(load_settings(None, frontend="tiny-copy", device="cpu", asr="none"))


def test_secrets_never_leak(caplog, monkeypatch, capfd):
    secret_key, secret_token = "sk-live-SECRET-0123456789", "tok-SECRET-9876543210"
    monkeypatch.setenv("KAME_TEST_SECRET_KEY", secret_key)
    llm = ScriptedOpenAIServer(default=ScriptedReply(status=401))
    llm.start_in_thread()
    profiles = {"keyed": ProfileSettings(base_url=llm.base_url, model="m", api_key_env="KAME_TEST_SECRET_KEY")}
    script = [(0.5, FinalTranscript("hello there", 0.0, 0.5))]
    caplog.set_level(logging.DEBUG)
    try:
        with running_server(asr="none", llm="keyed", profiles=profiles, auth_tokens=[secret_token]) as (url, services):
            services.runtime.asr = ScriptedAsr(script)

            async def session():
                client = await KameClient.connect(f"{url}/api/chat?token={secret_token}")
                got = Recording()
                task = asyncio.create_task(record(client, got))
                await stream_realtime(client, SECOND)
                await wait_until(lambda: llm_failed(got), "the LLM attempt with the bad key to fail")
                await finish(client, task)
                return got

            got = asyncio.run(session())
            http = url.replace("ws://", "http://")
            health = urllib.request.urlopen(http + "/healthz").read().decode()
            metrics = urllib.request.urlopen(http + "/metrics").read().decode()
    finally:
        llm.stop_thread()
    assert llm.headers and llm.headers[0]["Authorization"] == f"Bearer {secret_key}"  # it was used ...
    events = json.dumps([m.event.model_dump() for m in got.events if isinstance(m, EventMessage)])
    assert any(e.phase == "failed" and e.error_kind == "auth" for e in events_of(got, "llm"))
    captured = capfd.readouterr()
    server_logs = "\n".join(r.getMessage() for r in caplog.records
                            if r.name.split(".")[0] in ("kame", "server", "uvicorn", "openai", "httpx2"))
    # uvicorn's access log (off in these tests) would print the query string: it is redacted
    from server.app import RedactTokens, install_log_redaction

    install_log_redaction()
    access = logging.getLogger("uvicorn.access")
    assert any(isinstance(f, RedactTokens) for f in access.filters)
    access_line = access.makeRecord("uvicorn.access", logging.INFO, __file__, 0, '%s - "WebSocket %s" [accepted]',
                               ("127.0.0.1", f"/api/chat?token={secret_token}&events=1"), None)
    assert access.filter(access_line)
    server_logs += "\n" + access_line.getMessage()
    assert "/api/chat?token=***&events=1" in server_logs
    for where, text in {"logs": server_logs, "healthz": health, "metrics": metrics, "events": events,
                        "stdout": captured.out, "stderr": captured.err, "settings": repr(services.settings)}.items():
        assert secret_key not in text, where  # ... and shown nowhere
        assert secret_token not in text, where
    assert "KAME_TEST_SECRET_KEY" in health  # the variable's name is fine to show
    assert os.environ["KAME_TEST_SECRET_KEY"] == secret_key
