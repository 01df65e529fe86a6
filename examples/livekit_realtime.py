"""LiveKit Agents with KAME as its realtime model: the OpenAI plugin's RealtimeModel, its base_url at KAME.

Written for livekit-agents[openai]==1.8.9 (installs beside KAME's pins). The model's configuration was run
against a KAME server here; this worker was not, as it needs a LiveKit server and a room. See examples/README.md.

    KAME_URL=http://127.0.0.1:8998/v1 LIVEKIT_URL=ws://localhost:7880 LIVEKIT_API_KEY=devkey \
        LIVEKIT_API_SECRET=secret python examples/livekit_realtime.py dev
"""

from __future__ import annotations

import os

from livekit.agents import Agent, AgentServer, AgentSession, JobContext, cli
from livekit.plugins import openai
from openai.types.realtime import AudioTranscription
from openai.types.realtime.realtime_audio_input_turn_detection import ServerVad

INSTRUCTIONS = "You are a helpful assistant. Answer in one or two sentences."


def kame_model() -> openai.realtime.RealtimeModel:
    return openai.realtime.RealtimeModel(
        # the HTTP base of the API: LiveKit turns it into ws://HOST:PORT/v1/realtime?model=kame
        base_url=os.environ.get("KAME_URL", "http://127.0.0.1:8998/v1"),
        # sent as "Authorization: Bearer ..."; LiveKit refuses an empty one, KAME wants none on loopback
        api_key=os.environ.get("KAME_TOKEN", "unused"),
        model="kame",  # KAME serves one model whatever the name
        modalities=["audio"],  # audio/pcm at 24 kHz both ways (LiveKit's only format), words as transcript deltas
        # KAME's turn detection is its ASR's endpointing, reported as server_vad (semantic_vad maps to it too)
        turn_detection=ServerVad(type="server_vad", create_response=True, interrupt_response=True),
        input_audio_transcription=AudioTranscription(model="kame"),  # any name: KAME uses its own ASR
    )


server = AgentServer()


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    session = AgentSession(llm=kame_model())  # no stt/tts/vad: the realtime model hears and speaks
    await session.start(room=ctx.room, agent=Agent(instructions=INSTRUCTIONS))  # instructions: session.update
    # No session.generate_reply() greeting: KAME echoes the metadata LiveKit matches its response.create by,
    # but ignores the reply's instructions (the front-end speaks when it has something to say), so a greeting
    # is whatever the model says first, or an empty response after [realtime] response_timeout_s.


if __name__ == "__main__":
    cli.run_app(server)
