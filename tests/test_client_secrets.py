"""Short-lived client secrets: minted with the server's token (the openai SDK's
`client.realtime.client_secrets.create`), they open sessions until they expire, and they can
neither mint more secrets nor attach a sideband."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI, AuthenticationError
from websockets.exceptions import InvalidStatus

from server.client_secrets import MAX_S, PREFIX, ClientSecrets

from .server_harness import running_server


def test_a_secret_is_valid_until_it_expires_and_only_as_signed():
    now = [1_000_000.0]
    secrets = ClientSecrets([b"server-token"], now=lambda: now[0])
    value, expires_at = secrets.mint(60)
    assert value.startswith(PREFIX) and expires_at == 1_000_060
    assert secrets.valid(value)
    assert ClientSecrets([b"server-token"], now=lambda: now[0]).valid(value)  # another replica, same tokens
    assert not ClientSecrets([b"rotated"], now=lambda: now[0]).valid(value)  # rotating the tokens revokes
    payload, _, signature = value.rpartition(".")
    later = payload.replace(str(expires_at), str(expires_at + 3600))
    assert not secrets.valid(f"{later}.{signature}")  # a longer life cannot be written in
    assert not secrets.valid("server-token") and not secrets.valid(PREFIX)
    now[0] += 60
    assert not secrets.valid(value)
    with pytest.raises(ValueError):
        secrets.mint(MAX_S + 1)


@pytest.mark.slow
def test_a_browser_opens_sessions_with_a_secret_its_backend_minted():
    with running_server(asr="none", auth_tokens=["server-token"]) as (url, _):
        base = url.replace("ws://", "http://") + "/v1"

        async def go():
            async with AsyncOpenAI(base_url=base, api_key="server-token") as backend:
                secret = await backend.realtime.client_secrets.create(expires_after={"anchor": "created_at",
                                                                                     "seconds": 60})
            async with AsyncOpenAI(base_url=base, api_key=secret.value) as browser:
                return await as_the_browser(browser, secret)

        async def as_the_browser(browser, secret):
            async with browser.live.connect() as conn:
                await conn.session.start(session={"model": "gpt-live-1"})
                started = await conn.recv()
                with pytest.raises(InvalidStatus) as sideband:
                    async with browser.live.sideband.connect(session_id=started.session.id, max_retries=0) as band:
                        await band.recv()
            with pytest.raises(AuthenticationError):  # a secret mints no secrets
                await browser.realtime.client_secrets.create()
            forgery = secret.value[:-1] + ("1" if secret.value.endswith("0") else "0")
            with pytest.raises(InvalidStatus) as forged:
                async with AsyncOpenAI(base_url=base, api_key=forgery).live.connect(
                        max_retries=0) as conn:
                    await conn.recv()
            return secret, started, sideband.value, forged.value

        secret, started, sideband, forged = asyncio.run(go())
    assert secret.value.startswith(PREFIX) and secret.expires_at > 0
    assert started.type == "session.started"
    assert sideband.response.status_code == 401 and forged.response.status_code == 401
