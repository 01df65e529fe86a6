"""The front-end: a Moshi LM with an oracle input stream, its loader and its batched engine."""

from kame.frontend.engine import FRAME_SIZE, SAMPLE_RATE, BatchedEngine, FrameOutput, GenerationConfig
from kame.frontend.loader import DEFAULT_SOURCE, Frontend, load_frontend
from kame.frontend.oracle import OracleUpdate

__all__ = [
    "DEFAULT_SOURCE", "FRAME_SIZE", "SAMPLE_RATE", "BatchedEngine", "FrameOutput", "Frontend",
    "GenerationConfig", "OracleUpdate", "load_frontend",
]
