"""LiveKit Agents with KAME as its GPT-Live model: the OpenAI plugin's GPTLiveModel, its base_url at KAME.

Written for livekit-agents[openai]==1.8.9 (GPTLiveModel first ships in livekit-plugins-openai 1.8.1), which
KAME's dev extra installs. tests/test_livekit_live.py runs the same model against a KAME server without a
room; this worker was not run, as it needs a LiveKit server and a room.

    KAME_URL=http://127.0.0.1:8998/v1 LIVEKIT_URL=ws://localhost:7880 LIVEKIT_API_KEY=devkey \
        LIVEKIT_API_SECRET=secret python examples/livekit_live.py dev

KAME_DELEGATION=responses (the default): KAME's planner and LLM answer, KAME_PROFILE naming the server's LLM
profile. KAME_DELEGATION=client: KAME calls no LLM; each delegation is answered here, by the
OpenAI-compatible LLM at BACKEND_URL (model BACKEND_MODEL), and KAME's front-end says what it answered.
"""

from __future__ import annotations

import asyncio
import os

from livekit.agents import Agent, AgentServer, AgentSession, JobContext, cli
from livekit.plugins.openai.realtime import GPTLiveModel
from openai import AsyncOpenAI

INSTRUCTIONS = "You are a helpful assistant. Answer in one or two sentences."


def kame_model() -> GPTLiveModel:
    delegation = os.environ.get("KAME_DELEGATION", "responses")
    return GPTLiveModel(
        # the HTTP base of the API: LiveKit turns it into ws://HOST:PORT/v1/live/sessions
        base_url=os.environ.get("KAME_URL", "http://127.0.0.1:8998/v1"),
        # sent as "Authorization: Bearer ...": LiveKit refuses an empty one, KAME wants none on loopback
        api_key=os.environ.get("KAME_TOKEN", "unused"),
        delegation=delegation,
        # responses delegation's model names one of KAME's LLM profiles (others get its default profile)
        responses_options={"model": os.environ.get("KAME_PROFILE", "default")} if delegation == "responses" else {},
    )


async def answer(backend: AsyncOpenAI, transcript: str) -> str:
    """Client delegation's backend: a delegation names no task, so the LLM is given the conversation."""
    reply = await backend.chat.completions.create(
        model=os.environ.get("BACKEND_MODEL", "gpt-4.1-mini"),
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": f"{transcript}\n\nAnswer the user's latest request."}])
    return reply.choices[0].message.content or ""


server = AgentServer()


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    session = AgentSession(llm=kame_model())  # no stt/tts/vad: the duplex model hears and speaks
    agent = Agent(instructions=INSTRUCTIONS)  # session.start's instructions: added to KAME's planner prompt
    await session.start(room=ctx.room, agent=agent)
    if os.environ.get("KAME_DELEGATION") != "client":
        return
    backend = AsyncOpenAI(base_url=os.environ.get("BACKEND_URL"))  # key from OPENAI_API_KEY
    duplex = agent.duplex_session
    replies: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references

    @duplex.on("delegation_created")
    def on_delegation(delegation) -> None:
        lines = [f"{m.role}: {m.text_content}" for m in session.history.messages() if m.text_content]
        if delegation.pending_transcript:  # the caller's turn so far, not yet in the history
            lines.append(f"user: {delegation.pending_transcript}")

        async def reply() -> None:
            # commentary is what KAME's front-end says. KAME delegates again as the user's words grow
            # (each of its planner's attempts is a delegation); the newest answered one is spoken.
            duplex.append_commentary(await answer(backend, "\n".join(lines)), delegation_id=delegation.id)

        replies.add(task := asyncio.create_task(reply()))
        task.add_done_callback(replies.discard)


if __name__ == "__main__":
    cli.run_app(server)
