"""Who may download a recording (`GET /v1/live/sessions/{id}/content`), in process: the server's token, from
an allowed origin, whatever number of sessions the caller's address has open (a backend running sessions
fetches their recordings); a client secret or no token is 401, another origin 403. And when: 409 while a
recorder (of any process) writes it, 404 `recording_incomplete` when none does and it never ended."""

from __future__ import annotations

import json
import types

import numpy as np
import soundfile
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route
from starlette.testclient import TestClient

from server.access import AccessControl
from server.live import recording

URL = "/v1/live/sessions/sess_1/content"
TOKEN = {"Authorization": "Bearer tok"}


def serving(root):
    settings = types.SimpleNamespace(auth_tokens=[SecretStr("tok")], allowed_origins=[], max_connections_per_ip=2)
    access = AccessControl(settings)

    async def route(request):
        return await recording.download(request, request.path_params["session_id"], root, access)

    return access, TestClient(Starlette(routes=[Route("/v1/live/sessions/{session_id}/content", route)]))


def test_the_servers_token_downloads_whatever_sessions_its_address_has_open(tmp_path):
    settings = types.SimpleNamespace(auth_tokens=[SecretStr("tok")], allowed_origins=[], max_connections_per_ip=2)
    access = AccessControl(settings)
    folder = tmp_path / "sess_1"
    folder.mkdir()
    for name in ("input.wav", "output.wav"):
        soundfile.write(folder / name, np.zeros(2400, np.float32), 24000, subtype="PCM_16")
    (folder / "events.jsonl").write_text("\n".join(json.dumps(e) for e in ({"type": "session"}, {"type": "end"})))

    async def route(request):
        return await recording.download(request, request.path_params["session_id"], tmp_path, access)

    client = TestClient(Starlette(routes=[Route("/v1/live/sessions/{session_id}/content", route)]))
    token = {"Authorization": "Bearer tok"}
    access.connections["testclient"] = 2  # this address's two sessions: no place for a third
    scope = {"type": "http", "method": "GET", "path": URL, "query_string": b"", "client": ("testclient", 50000),
             "headers": [(b"authorization", b"Bearer tok")]}
    assert access.check(Request(scope)).status == 429  # a session would not open
    reply = client.get(URL, headers=token)
    assert reply.status_code == 200 and reply.headers["content-type"] == "audio/wav"
    assert client.get(URL).status_code == 401
    foreign = client.get(URL, headers={**token, "Origin": "https://elsewhere.example"})
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "origin_not_allowed"


def test_a_recording_being_written_is_409_and_one_that_never_ended_is_not_found(tmp_path):
    from kame.clock import ManualClock
    from server.recorder import SessionRecorder

    _, client = serving(tmp_path)
    live = SessionRecorder(tmp_path, "sess_1", ManualClock(), {"transport": "live"})
    live.on_input(np.zeros(2400, np.float32))
    live.write_event({"type": "note"})
    live._writer.submit(lambda: None).result()  # its files are open
    assert client.get(URL, headers=TOKEN).status_code == 409
    live.close()
    assert client.get(URL, headers=TOKEN).status_code == 200
    crashed = tmp_path / "sess_2"  # a server that stopped mid-session: no `end`, nobody writing
    crashed.mkdir()
    for name in ("input.wav", "output.wav"):
        soundfile.write(crashed / name, np.zeros(2400, np.float32), 24000, subtype="PCM_16")
    (crashed / "events.jsonl").write_text(json.dumps({"type": "session"}) + "\n" + '{"type": "te')
    gone = client.get("/v1/live/sessions/sess_2/content", headers=TOKEN)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "recording_incomplete"
