"""KAME: a tandem speech-to-speech voice assistant server (Moshi front-end + LLM oracle backend)."""

__version__ = "0.1.0"
