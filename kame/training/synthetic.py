"""Synthetic token files in RUN/tokens's format, for tests, benchmarks and the `tiny-copy` recipe.

- A copy task (`write_copy_task`): each dialogue's assistant says words that only that dialogue's
  oracle holds (drawn from the MT-Bench questions' words, none used twice while unused ones
  remain). A front-end that learned to follow its oracle predicts them; with another dialogue's
  oracle it cannot. The audio codes are random but shared by every dialogue (one voice per side),
  so only the oracle tells the dialogues apart.
- The oracle echo (`write_oracle_echo`): the assistant's text at every frame is the oracle's token
  of that frame, over random audio. What `tiny-copy` is trained on: its text stream repeats
  whatever the backend puts in its oracle, so tests can see the oracle path end to end.
- Random tokens (`write_random_tokens`): for speed and memory only.

The files are written exactly as the token stage writes them.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kame.frontend.oracle import TextTokenizer, oracle_stream, tokenize_words
from kame.training.dataset import lm_config
from kame.training.tokens import place_tokens, write_manifest, write_token_file

QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "mt_bench_questions.jsonl"


def vocabulary() -> list[str]:
    """Distinct plain words of the MT-Bench questions shipped with the package (about two thousand)."""
    words = set()
    for line in QUESTIONS.read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            words.update(w for w in re.findall(r"[a-z]+", turn.lower()) if len(w) >= 4)
    return sorted(words)


def sentences() -> list[str]:
    """The MT-Bench questions cut into sentences (356 of them)."""
    found = []
    for line in QUESTIONS.read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            found.extend(s.strip() for s in turn.replace("\n", " ").split(". ") if s.strip())
    return found


@dataclass(frozen=True)
class Shape:
    """The front-end config the files are made for (the manifest's five keys)."""

    text_card: int
    padding_id: int
    n_q: int
    dep_q: int
    card: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @property
    def code_dtype(self) -> torch.dtype:
        """The audio codes' dtype in a token file."""
        return torch.int16 if self.card < 2**15 else torch.int32


SILENCE_CODE = 0  # the audio code of a channel while its speaker is silent
ANSWER_LAG = 3  # frames between the end of the user's turn and the assistant's first word


def _turns(rng: random.Random, answers: list[list[int]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]],
                                                                   list[tuple[int, int]], int]:
    """Frame spans of (user turns, assistant turns) and the oracle event frames, then the length.

    The assistant answers ANSWER_LAG frames after the user stops, its tokens one per frame: when
    it speaks is visible in the audio, what it says only in the oracle (applied a few frames
    before the user's turn ends, as a planner would)."""
    frame, users, assistants, events = 3, [], [], []
    for tokens in answers:
        user = (frame, frame + rng.randrange(10, 20))
        start = user[1] + ANSWER_LAG
        users.append(user)
        assistants.append((start, start + len(tokens) + 2))
        events.append((user[1] - rng.randrange(1, 4), start))
        frame = assistants[-1][1] + rng.randrange(2, 5)
    return users, assistants, events, frame + 3


def _voice(codebooks: int, card: int, seed: int, frames: int = 64) -> torch.Tensor:
    """Random codes [codebooks, frames] that every turn of a channel starts with: the audio shows when
    someone speaks but not which dialogue this is, so the text cannot be learnt by heart from it."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, card, (codebooks, frames), generator=generator, dtype=torch.int32)


def _audio(voice: torch.Tensor, frames: int, spans: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    """The voice's codes while the speaker talks, SILENCE_CODE otherwise."""
    codes = torch.full((voice.shape[0], frames), SILENCE_CODE, dtype=torch.int32)
    for start, end in spans:
        codes[:, start:end] = voice[:, : end - start]
    return codes.to(dtype)


def _random_codes(shape: Shape, frames: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Uniformly random codes on both sides (the user's drawn first)."""
    return {side: torch.randint(0, shape.card, (count, frames), generator=generator).to(shape.code_dtype)
            for side, count in (("user_codes", shape.n_q - shape.dep_q), ("assistant_codes", shape.dep_q))}


def _write(run_dir: Path, shape: Shape, name: str, tensors: dict[str, torch.Tensor], events: list[list]) -> str:
    """RUN/tokens/NAME.safetensors of these tensors and `[frame, tokens, last_of_turn]` events; its name."""
    meta = {"name": name, "frames": int(tensors["text"].shape[0]), "oracle_events": events,
            "frontend": shape.as_dict()}
    write_token_file(Path(run_dir) / "tokens" / f"{name}.safetensors", tensors, meta)
    return name


def dialogue_tensors(rng: random.Random, tokenizer: TextTokenizer, shape: Shape,
                     answers: list[list[str]]) -> tuple[dict, list[list]]:
    """(tensors, oracle events) of one copy-task dialogue."""
    tokens = [tokenize_words(tokenizer, " ".join(words)) for words in answers]
    users, assistants, events, frames = _turns(rng, tokens)
    spoken = [(start, t) for (start, _), t in zip(assistants, tokens, strict=True)]
    tensors = {
        "user_codes": _audio(_voice(shape.n_q - shape.dep_q, shape.card, 1), frames, users, shape.code_dtype),
        "assistant_codes": _audio(_voice(shape.dep_q, shape.card, 2), frames, assistants, shape.code_dtype),
        "text": torch.tensor(place_tokens(spoken, frames, shape.padding_id)[0], dtype=torch.int32),
    }
    return tensors, [[frame, t, True] for (frame, _), t in zip(events, tokens, strict=True)]


def write_copy_task(run_dir: Path, frontend: str, tokenizer: TextTokenizer, shape: Shape, *, dialogues: int = 20,
                    turns: int = 3, words_per_turn: int = 1, max_pieces: int = 2, seed: int = 0) -> list[Path]:
    """RUN/tokens/NAME.safetensors for `dialogues` copy-task dialogues, and the manifest. The words
    are those of at most `max_pieces` tokens; a word is used again only once all have been used."""
    rng = random.Random(seed)
    words = [w for w in vocabulary() if len(tokenize_words(tokenizer, w)) <= max_pieces]
    pool: list[str] = []
    names = []
    for index in range(dialogues):
        answers = []
        for _ in range(turns):
            if len(pool) < words_per_turn:
                pool = rng.sample(words, k=len(words))
            answers.append([pool.pop() for _ in range(words_per_turn)])
        names.append(_write(run_dir, shape, f"dialogue_{index:03d}", *dialogue_tensors(rng, tokenizer, shape, answers)))
    return _manifest(run_dir, frontend, shape, names)


ECHO_INTERRUPT = 0.3  # the share of oracle updates that a newer one replaces before it is read out
ECHO_MAX_GAP = 15  # frames of padding between the end of one update and the next: 0 to ECHO_MAX_GAP - 1


def echo_events(rng: random.Random, pieces: list[list[int]], frames: int) -> list[list]:
    """Oracle events [frame, tokens, True] over `frames`: a random prefix of a random sentence at a
    time, mostly read out to the end and followed by a short gap, sometimes cut short by the next
    update (which the engine's timeline clears the rest of the older one for)."""
    events, frame = [], rng.randrange(0, 12)
    while frame < frames:
        tokens = rng.choice(pieces)
        tokens = tokens[: rng.randrange(1, len(tokens) + 1)]
        events.append([frame, tokens, True])
        span = 1 + len(tokens)  # the start token, then one token per frame
        if rng.random() < ECHO_INTERRUPT:
            frame += rng.randrange(2, span + 1)
        else:
            frame += span + rng.randrange(0, ECHO_MAX_GAP)
    return events


def write_oracle_echo(run_dir: Path, frontend: str, tokenizer: TextTokenizer, shape: Shape, *,
                      dialogues: int = 2000, frames: int = 160, seed: int = 0) -> list[Path]:
    """RUN/tokens for the oracle echo: text = the oracle stream (padding where it holds its start
    token or padding), audio codes uniformly random on both sides."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    pieces = [p for p in (tokenize_words(tokenizer, s) for s in sentences()) if p]
    start, pad = shape.text_card, shape.padding_id
    names = []
    for index in range(dialogues):
        events = echo_events(rng, pieces, frames)
        stream = torch.tensor(oracle_stream([(f, t) for f, t, _ in events], frames, start, pad), dtype=torch.int32)
        tensors = {**_random_codes(shape, frames, generator), "text": torch.where(stream == start, pad, stream)}
        names.append(_write(run_dir, shape, f"echo_{index:05d}", tensors, events))
    return _manifest(run_dir, frontend, shape, names)


def shape_of(lm) -> Shape:
    return Shape(**lm_config(lm))


def write_random_tokens(run_dir: Path, frontend: str, shape: Shape, *, dialogues: int = 4, frames: int = 600,
                        seed: int = 0) -> list[Path]:
    """Token files of random codes and text (a word token every few frames, an oracle every 5 s):
    for measuring training speed and memory, where what is learnt does not matter."""
    generator = torch.Generator().manual_seed(seed)
    names = []
    for index in range(dialogues):
        text = torch.randint(0, shape.text_card, (frames,), generator=generator, dtype=torch.int32)
        text[torch.rand(frames, generator=generator) < 0.7] = shape.padding_id
        tensors = {**_random_codes(shape, frames, generator), "text": text}
        events = [[frame, torch.randint(0, shape.text_card, (20,), generator=generator).tolist(), True]
                  for frame in range(0, frames, 62)]
        names.append(_write(run_dir, shape, f"random_{index:03d}", tensors, events))
    return _manifest(run_dir, frontend, shape, names)


def _manifest(run_dir: Path, frontend: str, shape: Shape, names: list[str]) -> list[Path]:
    """Write the manifest of these token files; their paths."""
    write_manifest(run_dir, frontend, shape.as_dict(), names)
    return [Path(run_dir) / "tokens" / f"{name}.safetensors" for name in names]
