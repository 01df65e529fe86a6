"""`kame doctor`'s LLM lines: each profile's key, endpoint or embedded model, without a chat request."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from server.doctor.check import Check, Level

if TYPE_CHECKING:
    from kame.backend.profiles import BackendProfile
    from server.settings import ServerSettings

HTTP_TIMEOUT_S = 3.0
OPENAI_URL = "https://api.openai.com/v1"  # the openai package's default, where a profile has no base_url


def llm_checks(settings: ServerSettings) -> list[Check]:
    default, why = settings.default_profile_and_reason()
    profiles = list(settings.all_profiles().values())
    with ThreadPoolExecutor(max_workers=len(profiles)) as pool:  # a few seconds at worst, not per profile
        found = list(pool.map(lambda p: profile_check(p, p.name == default), profiles))
    return [Check("ok", "llm", f"default profile {default} ({why})"), *found]


def profile_check(profile: BackendProfile, default: bool) -> Check:
    """Only the default profile blocks kame serve; the others are warnings (a session may pick them)."""
    name, bad = f"llm:{profile.name}", "FAIL" if default else "warn"
    if profile.kind == "embedded":
        return _embedded_check(profile, name, bad)
    if profile.api_key_env and not os.environ.get(profile.api_key_env):
        return Check(bad, name, f"{profile.api_key_env} is not set (the key for {profile.model})")
    if profile.base_url is None:
        return _openai_check(profile, name)
    return _endpoint_check(profile, name, bad)


def _embedded_check(profile: BackendProfile, name: str, bad: Level) -> Check:
    # how EmbeddedLLM locates its model (the bundled GGUF's sha256 checked), without loading it
    from kame.backend.embedded import BUNDLED, resolve_model
    from kame.backend.llm import LLMError

    try:
        folder, gguf = resolve_model(profile.model)
    except LLMError as exc:
        return Check(bad, name, f"{profile.model}: {exc}")
    found = Path(folder, gguf) if gguf else Path(folder)
    return Check("ok", name, f"{profile.model}: {found}{', sha256 checked' if profile.model == BUNDLED else ''}")


def _openai_check(profile: BackendProfile, name: str) -> Check:
    """OpenAI's own endpoint: the key is set; whether the network reaches it (no request is made)."""
    from kame.frontend.checkpoint import hub_reachable  # a TCP check of any URL, proxies honoured

    url = os.environ.get("OPENAI_BASE_URL") or OPENAI_URL  # what the openai package uses then
    key = f"{profile.api_key_env} is set" if profile.api_key_env else "no key needed"
    if hub_reachable(url, HTTP_TIMEOUT_S):
        return Check("ok", name, f"{key}; {urlsplit(url).hostname} reachable (model {profile.model})")
    return Check("warn", name, f"{key}, but {urlsplit(url).hostname} is unreachable from here")


def _endpoint_check(profile: BackendProfile, name: str, bad: Level) -> Check:
    import httpx2  # the HTTP client the openai package uses

    url = profile.base_url.rstrip("/") + "/models"
    shown = _without_credentials(url)
    headers = {"Authorization": f"Bearer {os.environ[profile.api_key_env]}"} if profile.api_key_env else {}
    try:
        status = httpx2.get(url, headers=headers, timeout=HTTP_TIMEOUT_S).status_code
    except (httpx2.HTTPError, httpx2.InvalidURL) as exc:
        return Check(bad, name, f"{shown} does not answer ({type(exc).__name__})")
    if status == 200:
        return Check("ok", name, f"{shown} answers (HTTP 200), model {profile.model}")
    key = f"check the key in {profile.api_key_env}" if profile.api_key_env else "it may want a key"
    hint = {401: key, 403: key, 404: "check the base_url"}.get(status, "see its logs")
    # the endpoint is up; some never serve GET /models, so this alone does not block kame serve
    return Check("warn", name, f"{shown} answers HTTP {status}, not 200 ({hint}; some endpoints have no /models)")


def _without_credentials(url: str) -> str:
    """The URL as printed: a user:password@ in it is never shown."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl() if "@" in parts.netloc else url
