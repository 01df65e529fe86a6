"""OpenAI-style error bodies for the HTTP endpoints (the WebRTC offer, client secrets)."""

from __future__ import annotations

from starlette.responses import JSONResponse


def error_response(status: int, kind: str, code: str, message: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "code": code, "message": message, "param": param}},
                        status_code=status, headers=headers)
