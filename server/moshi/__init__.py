"""Moshi's websocket protocol (`/api/chat`): binary messages with a kind byte, Opus or PCM16 audio, and
KAME's JSON extensions. `mapping.py` is the protocol with no I/O; `carrier.py` runs it on a session."""
