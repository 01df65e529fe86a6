"""`GET /v1/live/sessions/{id}/content` through the openai SDK's `download_recording`: a finished session's
recording as a two-channel WAV (the user left, the assistant right), 409 while it runs, 404 for a session never
recorded or a server that does not record."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import openai
import pytest
import soundfile

from kame.pcm import pcm16_encode

from .server_harness import running_server
from .test_live import LIVE_EVENT, sdk
from .test_realtime import Events

pytestmark = pytest.mark.slow
TONE = (0.3 * np.sin(2 * np.pi * 440 * np.arange(24000) / 24000)).astype(np.float32)  # 1 s


def test_a_finished_session_downloads_as_two_channels(tmp_path):
    with running_server(asr="none", record_dir=tmp_path) as (url, _):
        async def go():
            async with sdk(url) as client:  # closed on this loop (collected unclosed, it fails on another's)
                return await download(client)

        async def download(client):
            async with client.live.connect() as conn:
                events = Events(conn, LIVE_EVENT)
                await conn.session.start(session={"model": "gpt-live-1", "delegation": {"type": "client"}})
                started = await events.type("session.started")
                session_id = started["session"]["id"]
                for chunk in np.array_split(TONE, 10):
                    await conn.session.input_audio.append(audio=base64.b64encode(pcm16_encode(chunk)).decode())
                await events.wait_for(lambda e: len(events.of("session.output_audio.delta")) >= 10, 20,
                                      "the assistant's audio")
                with pytest.raises(openai.APIStatusError) as running:
                    await client.live.sessions.download_recording(session_id)
                await conn.session.close()
                await events.type("session.closed", 10)
                events.close()
            for _ in range(100):  # the recorder finishes its files once the session is over
                try:
                    return running.value, await client.live.sessions.download_recording(session_id)
                except openai.ConflictError:
                    await asyncio.sleep(0.1)
            raise AssertionError("the recording never became available")

        running, content = asyncio.run(go())
    assert running.status_code == 409
    audio, rate = soundfile.read(io.BytesIO(content.content), dtype="float32")
    assert rate == 24000 and audio.ndim == 2 and audio.shape[1] == 2
    user, assistant = audio[:, 0], audio[:, 1]
    loud = np.flatnonzero(np.abs(user) > 0.1)
    assert 0.98 < (loud[-1] - loud[0]) / 24000 < 1.02  # the tone, once, whole (silence fed around it)
    assert np.abs(assistant).max() > 0  # tiny-copy's noise


def test_unknown_sessions_and_a_server_that_does_not_record_are_404(tandem_server, tmp_path):
    url, _ = tandem_server

    async def missing(base: str, session_id: str) -> openai.APIStatusError:
        async with sdk(base) as client:
            with pytest.raises(openai.NotFoundError) as caught:
                await client.live.sessions.download_recording(session_id)
        return caught.value

    off = asyncio.run(missing(url, "anysession"))
    assert off.body["code"] == "recording_disabled"
    with running_server(asr="none", record_dir=tmp_path) as (recording_url, _):
        unknown = asyncio.run(missing(recording_url, "nosuchsession"))
        traversal = asyncio.run(missing(recording_url, "..%2F.."))
    assert unknown.body["code"] == "session_not_found" and traversal.body["code"] == "session_not_found"
