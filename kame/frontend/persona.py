"""A persona for a PersonaPlex-layout front-end: the prompt its reference (NVIDIA/personaplex) steps the model
through before the conversation, as `PromptFrame`s for `BatchedEngine.prefill`.

The reference's order: the voice prompt's Mimi codes as the assistant's audio (text: padding), 0.5 s of silence
(6 frames), the role text wrapped in `<system>` tags one SentencePiece token a frame (assistant: silence), 0.5 s
of silence; the user's stream is a 440 Hz tone throughout. The silence and the tone are the reference's fixed
Mimi codes (`SILENCE_CODES`, `SINE_CODES`: what the released Mimi makes of them).
"""

from __future__ import annotations

from dataclasses import dataclass

from kame.errors import SessionError
from kame.frontend.engine import PromptFrame
from kame.frontend.voices import VoiceEmbeddings, VoiceLibrary

PAD = 3  # the text stream's padding token during the voice prompt and the silences
SILENCE_FRAMES = 6  # 0.5 s at 12.5 frames a second
SILENCE_CODES = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)  # the assistant's audio while it is silent
SINE_CODES = (430, 1268, 381, 1611, 1095, 1495, 56, 472)  # the user's: a 440 Hz tone
MAX_TEXT_TOKENS = 1024  # a role text beyond this is refused (it costs a frame a token, and the context)


@dataclass(frozen=True)
class Persona:
    """What a session asks its front-end to be: a role text, and a voice (its Mimi codes, a frame each, or a
    PersonaPlex `.pt` voice's embeddings)."""

    text: str | None = None
    voice: tuple[tuple[int, ...], ...] | VoiceEmbeddings = ()


def wrap_system(text: str) -> str:
    """The role text as the reference gives it to the tokenizer: between `<system>` tags (plain text)."""
    text = text.strip()
    if text.startswith("<system>") and text.endswith("<system>"):
        return text
    return f"<system> {text} <system>"


def prompt_frames(persona: Persona, tokenizer, silence_frames: int = SILENCE_FRAMES,
                  delays: tuple[int, ...] | None = None) -> list[PromptFrame]:
    """The frames the reference steps through for `persona` (an empty role text: none of the text part,
    where the reference fails); `delays`: the LM's, every stream's (for a `.pt` voice)."""
    if isinstance(persona.voice, VoiceEmbeddings):
        frames = embedding_frames(persona.voice, delays)
    else:
        frames = [PromptFrame(PAD, tuple(codes), SINE_CODES) for codes in persona.voice]
    quiet = [PromptFrame(PAD, SILENCE_CODES, SINE_CODES)] * silence_frames
    frames += quiet
    if persona.text and persona.text.strip():
        if tokenizer is None:
            raise SessionError("this front-end has no tokenizer: it cannot take a role text")
        tokens = tokenizer.encode(wrap_system(persona.text))
        if len(tokens) > MAX_TEXT_TOKENS:
            raise SessionError(f"the role text is {len(tokens)} tokens long; at most {MAX_TEXT_TOKENS}")
        frames += [PromptFrame(int(token), SILENCE_CODES, SINE_CODES) for token in tokens] + quiet
    return frames


def embedding_frames(voice: VoiceEmbeddings, delays) -> list[PromptFrame]:
    """A `.pt` voice's frames: one per embedding (the LM stepped on it: the reference's `step_embeddings`), then
    its last frame, whose tokens come out of the voice's cache and are put back before it is stepped (the
    reference's `cache.copy_`). The reference reads a step's input one position behind KAME's moshi: its
    embedding i is KAME's step i - 1, and its ring holds the voice's last frame at the position after the last
    embedding, with each stream's delay."""
    if delays is None:
        raise SessionError("a .pt voice needs the model's stream delays")
    cache, last = voice.cache, len(voice.embeddings)
    size = cache.shape[1]
    if len(delays) != cache.shape[0]:
        raise SessionError(f"voice {voice.name}: {cache.shape[0]} streams in its cache, the model has {len(delays)}")
    frames = [PromptFrame(PAD, SILENCE_CODES, SINE_CODES, embedding=e) for e in voice.embeddings]
    tokens = [int(cache[k, (last + delay) % size]) for k, delay in enumerate(delays)]
    half = (len(tokens) - 1) // 2
    restore = tuple(int(v) for v in cache[:, last % size])
    frames.append(PromptFrame(tokens[0], tuple(tokens[1:1 + half]), tuple(tokens[1 + half:]), restore=restore))
    return frames


def persona_prompt(frontend, text: str | None, voice: str | None = None,
                   voices: VoiceLibrary | None = None) -> list[PromptFrame]:
    """A session's persona prompt for `frontend` (none without a role text or a voice), or SessionError where the
    front-end takes none: only a PersonaPlex-layout checkpoint was trained with one. `voice`: a name in
    `voices` (PersonaPlex's `voice_prompt`)."""
    if (not text or not text.strip()) and not voice:
        return []
    lm = getattr(frontend, "lm", None)
    if lm is None:  # the engine runs in another process (kame serve --fronts)
        raise SessionError("a persona's prompt is not prefilled over a remote engine yet: serve persona "
                           "sessions from one process (kame serve without --fronts)")
    if not getattr(lm, "predicted_q", None):
        asked = "a role text or a voice" if voice else "a role text"
        raise SessionError(f"the front-end {frontend.source or 'in use'} takes no persona ({asked}): "
                           "PersonaPlex-layout checkpoints (nvidia/personaplex-7b-v1) do")
    embeddings = ()
    if voice:
        embeddings = (voices or VoiceLibrary(None)).voice(voice, lm.dim, lm.num_codebooks)
    return prompt_frames(Persona(text, embeddings), frontend.tokenizer, delays=tuple(lm.delays))
