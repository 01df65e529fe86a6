"""The backend: LLM clients behind one small protocol, and the planner that turns partial
transcripts into oracle updates."""

from kame.backend.llm import LLMClient, OpenAICompatibleLLM
from kame.backend.profiles import BackendProfile


def make_llm(profile: BackendProfile) -> LLMClient:
    """The client a profile describes: an OpenAI-compatible endpoint, or the embedded model."""
    if profile.kind == "embedded":
        from kame.backend.embedded import EmbeddedLLM, EmbeddedOptions

        options = EmbeddedOptions(model=profile.model, max_new_tokens=profile.max_tokens,
                                  temperature=profile.temperature, first_token_timeout_s=profile.first_token_timeout_s,
                                  token_timeout_s=profile.token_timeout_s)
        return EmbeddedLLM(options, name=profile.name)
    return OpenAICompatibleLLM(profile)
