"""`GET /v1/live/sessions/{id}/content` (the openai SDK's `live.sessions.download_recording`): a finished
session's recording, where the server records (`--record DIR`, server/recorder.py), as one WAV of two
channels at 24 kHz: the user's audio on the left, the assistant's on the right, on one timeline."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path

import numpy as np
import soundfile
from starlette.requests import Request
from starlette.responses import Response

from kame.audio import SAMPLE_RATE
from server import recorder
from server.access import AccessControl
from server.http_errors import error_response

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what this server's session ids are: never a path


async def download(request: Request, session_id: str, record_dir: Path | None, access: AccessControl) -> Response:
    # a download opens no session: the address's session limit is not this request's business
    if (refusal := access.credentials(request)) is not None or not access.trusted(request):
        reason = refusal.reason if refusal else "a recording needs the server's token, not a client secret"
        status = refusal.status if refusal else 401
        code = "origin_not_allowed" if status == 403 else "invalid_api_key"
        return error_response(status, "invalid_request_error", code, reason)
    if record_dir is None:
        return error_response(404, "invalid_request_error", "recording_disabled", "This server does not record "
                              "sessions (kame serve --record DIR turns it on).")
    folder = record_dir / session_id
    if not SESSION_ID.fullmatch(session_id) or not (folder / "events.jsonl").is_file():
        return error_response(404, "invalid_request_error", "session_not_found",
                              f"No recording of session {session_id!r}.")
    state = await asyncio.to_thread(_state, folder)
    if state == "running":
        return error_response(409, "invalid_request_error", "session_active",
                              f"Session {session_id!r} is still running: its recording comes once it ends.")
    if state == "incomplete":  # the recorder failed or the server stopped during it: it will not end
        return error_response(404, "invalid_request_error", "recording_incomplete",
                              f"The recording of session {session_id!r} was never finished (its writing failed or "
                              "the server stopped during it).")
    body = await asyncio.to_thread(stereo_wav, folder)
    return Response(body, media_type="audio/wav",
                    headers={"Content-Disposition": f'attachment; filename="{session_id}.wav"'})


def _state(folder: Path) -> str:
    """"finished" (the recorder wrote its `end` event once the WAV files were final), "running" (a recorder
    holds the events file: this server or another on the host) or "incomplete" (neither: it never will)."""
    lines = (folder / "events.jsonl").read_text().splitlines()
    try:
        if lines and json.loads(lines[-1]).get("type") == "end":
            return "finished"
    except ValueError:  # a line cut short by a crash
        pass
    return "running" if recorder.running(folder / "events.jsonl") else "incomplete"


def stereo_wav(folder: Path) -> bytes:
    """input.wav and output.wav as the two channels of one WAV (the shorter padded with silence)."""
    user, _ = soundfile.read(folder / "input.wav", dtype="int16")
    assistant, _ = soundfile.read(folder / "output.wav", dtype="int16")
    both = np.zeros((max(len(user), len(assistant)), 2), dtype=np.int16)
    both[: len(user), 0], both[: len(assistant), 1] = user, assistant
    out = io.BytesIO()
    soundfile.write(out, both, SAMPLE_RATE, subtype="PCM_16", format="WAV")
    return out.getvalue()
