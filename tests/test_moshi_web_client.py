"""What Kyutai's Moshi web client sends and expects: sampling query parameters and the kind-4 metadata."""

from __future__ import annotations

import asyncio

import pytest

from client.client import KameClient, ServerRefused

from .server_harness import wait_until_all_slots_free

# the query string the Moshi web client builds from its sliders
MOSHI_QUERY = {"text_temperature": "0.3", "text_topk": "10", "audio_temperature": "0.5", "audio_topk": "50",
               "pad_mult": "1.5", "repetition_penalty": "1.2", "repetition_penalty_context": "32",
               "text_seed": "776919", "audio_seed": "278161"}


async def metadata_of(client: KameClient) -> dict:
    async with asyncio.timeout(10):
        async for _ in client:
            if client.metadata is not None:
                return client.metadata
    raise AssertionError("the session ended before its metadata came")


def test_sampling_parameters_are_honoured_per_session_and_reported(tandem_server):
    url, services = tandem_server
    sampler = services.runtime.engine.sampler

    async def go():
        tuned = await KameClient.connect(f"{url}/api/chat", options=MOSHI_QUERY)
        plain = await KameClient.connect(f"{url}/api/chat")
        try:
            info, plain_info = await metadata_of(tuned), await metadata_of(plain)
            topks = set(sampler.text_topk.tolist())
            return info, plain_info, topks, [sampler.settings(s) for s in range(len(sampler.text_topk))]
        finally:
            await tuned.close()
            await plain.close()

    info, plain_info, topks, settings = asyncio.run(go())
    assert info["text_temperature"] == 0.3 and info["text_topk"] == 10
    assert info["audio_temperature"] == 0.5 and info["audio_topk"] == 50
    assert info["pad_mult"] == 1.5 and info["repetition_penalty"] == 1.2
    assert info["repetition_penalty_context"] == 32
    assert info["ignored_parameters"] == ["text_seed", "audio_seed"]
    assert info["lm_model_file"] == "tiny-copy" and info["backend"] == "scripted"
    assert info["session_id"] != plain_info["session_id"]
    # the neighbour keeps the checkpoint's own settings, in the same batch
    assert (plain_info["text_topk"], plain_info["audio_topk"], plain_info["pad_mult"]) == (25, 250, 0.0)
    assert plain_info["ignored_parameters"] == []
    assert {10, 25} <= topks  # both slots' settings were in the engine at once
    assert any(s.audio_topk == 50 and s.repetition_penalty == 1.2 for s in settings)
    wait_until_all_slots_free(services)


@pytest.mark.parametrize(("query", "reason"), [
    ({"text_topk": "many"}, "text_topk must be an integer"),
    ({"audio_temperature": "-1"}, "audio_temperature must be between 0.0 and 10.0"),
])
def test_a_bad_sampling_parameter_is_refused_with_its_name(tandem_server, query, reason):
    url, services = tandem_server

    async def go():
        with pytest.raises(ServerRefused, match=reason):
            await KameClient.connect(f"{url}/api/chat", options=query)

    asyncio.run(go())
    wait_until_all_slots_free(services)
