"""Named LLM backend profiles: where an OpenAI-compatible endpoint is, which model, which key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field


@dataclass(frozen=True)
class BackendProfile:
    """One OpenAI-compatible chat-completions endpoint. The key itself is read from the env at use. Also the
    schema of the server's [profiles.NAME] tables (server/settings.py), so each field's bounds are written here."""

    name: str
    base_url: str | None  # None: the openai package's default (api.openai.com)
    model: str
    api_key_env: str | None = "OPENAI_API_KEY"  # None: the endpoint needs no key
    connect_timeout_s: Annotated[float, Field(gt=0)] = 3.0  # TCP + TLS
    first_token_timeout_s: Annotated[float, Field(gt=0)] = 5.0  # request sent -> first streamed token
    token_timeout_s: Annotated[float, Field(gt=0)] = 3.0  # the longest silence allowed between two chunks
    max_tokens: Annotated[int, Field(gt=0)] = 120  # a spoken answer of ~30 words needs far fewer
    temperature: Annotated[float, Field(ge=0, le=2)] = 0.3
    kind: Literal["openai", "embedded"] = "openai"  # embedded: `model` is run in-process (see embedded.py)
    tools: bool = True  # offer it the session's tools (false: an endpoint that refuses `tools`); embedded: never

    def public(self) -> dict:
        """What may be shown to clients and in logs: never the key, only the variable's name."""
        return {"name": self.name, "kind": self.kind, "base_url": self.base_url, "model": self.model,
                "api_key_env": self.api_key_env}


DEFAULT_PROFILES: dict[str, BackendProfile] = {
    "openai": BackendProfile("openai", None, "gpt-4.1", "OPENAI_API_KEY"),
    "anthropic": BackendProfile("anthropic", "https://api.anthropic.com/v1/", "claude-opus-4-1", "ANTHROPIC_API_KEY"),
    "gemini": BackendProfile(
        "gemini", "https://generativelanguage.googleapis.com/v1beta/openai/", "gemini-2.5-flash", "GEMINI_API_KEY"),
    "local": BackendProfile("local", "http://127.0.0.1:8000/v1", "local-model", None),
    # SmolLM2-135M-Instruct inside the server process: no key, no network; a demo, not a knowledge source
    "embedded": BackendProfile("embedded", None, "bundled:smollm2-135m", None, first_token_timeout_s=15.0,
                               token_timeout_s=5.0, max_tokens=60, temperature=0.0, kind="embedded"),
}
