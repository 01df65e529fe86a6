"""The OpenAI Realtime API (`/v1/realtime`, GA event names, beta names for beta clients) as a
transport over one TandemSession.

The front-end speaks continuously; the Realtime protocol thinks in responses. A response is a
burst of assistant speech: it opens when the front-end starts producing text (or, with
`[realtime] activity = "text+audio"`, audio energy) after quiet, and closes after `quiet_s`
without it. The user's side comes from the session's streaming ASR. Tools the client declares
become function calls the backend LLM may make. docs/realtime.md has the whole mapping.

    client_events.py  the client's events, parsed into one pydantic union
    mapping.py        the protocol as a state machine: events and time in, actions out
      config.py         session.update, the session object
      responses.py      the assistant's speech as responses (bursts, quiet, cancel, barge-in)
      conversation.py   the items, the user's turns from the ASR
      outbox.py         numbered server events (beta names), in order with the session calls
    actions.py        what the mapping asks for
    adapter.py        the carrier that runs a mapping on a session (server/runner.py)
"""

from server.realtime.adapter import RealtimeCarrier
from server.realtime.client_events import RealtimeError
from server.realtime.mapping import RealtimeMapping

__all__ = ["RealtimeCarrier", "RealtimeError", "RealtimeMapping"]
