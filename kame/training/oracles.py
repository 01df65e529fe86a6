"""Stage 2, oracles: simulated oracle events for each prepared dialogue, `RUN/oracles/NAME.json`.

Every 0.5 s of a user turn (and once at its end) an event predicts the assistant turn that
follows. `random`: another turn's reply, the true one at the end. `llm`: a backend LLM answers
the words heard so far, with a hint of the true reply that grows with the share of the turn heard.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from kame.backend.llm import ChatMessage, LLMClient, LLMError
from kame.backend.profiles import DEFAULT_PROFILES, BackendProfile
from kame.training.runfiles import (
    ORACLE_STRATEGIES,
    DataError,
    digest,
    frame_of,
    prepared_files,
    read_json,
    stored_hash,
    write_json,
)

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5  # one event per this much of the user's turn
RETRIES = 4  # attempts per LLM request
BACKOFF_S = 0.5  # first retry delay; doubles each time (or the server's Retry-After)
NO_RETRY = ("config", "auth", "bad_request")  # an LLMError of these kinds will not go away by waiting
PROMPT_VERSION = "2"  # part of each request's cache key: change it when the prompt changes

SYSTEM_PROMPT = (
    "You play the voice assistant in a spoken conversation. The user may still be talking: you get "
    "the words heard so far, perhaps cut off mid-sentence. Reply with what the assistant says next, "
    "as plain spoken words, at most 30 of them, no lists or symbols."
)

STOPWORDS = frozenset({
    "a", "an", "the", "is", "are", "was", "were", "be", "been", "am", "i", "you", "he", "she", "it", "we", "they",
    "me", "my", "your", "his", "her", "its", "our", "their", "this", "that", "these", "those", "of", "to", "in",
    "on", "at", "for", "with", "by", "from", "and", "or", "but", "so", "not", "no", "yes", "do", "does", "did",
    "have", "has", "had", "will", "would", "can", "could", "should", "there", "here", "what", "which", "who",
    "how", "why", "when", "where"
})


@dataclass(frozen=True)
class OracleEvent:
    time: float
    frame: int
    text: str
    turn: int  # index in `turns` of the assistant turn this event predicts
    last_of_turn: bool
    tier: str  # none | keywords | more | full | random


@dataclass(frozen=True)
class _Slot:
    """Where an event goes, before its text is known."""

    time: float
    turn: int  # the assistant turn predicted
    user_turn: int
    heard: float  # share of the user turn heard, 0..1
    last: bool


def event_slots(turns: list[dict]) -> list[_Slot]:
    """Each user turn followed by an assistant turn: events at start + 0.5 s, + 1 s, ... before its
    end, and one at its end."""
    slots = []
    for index, turn in enumerate(turns[:-1]):
        if turn["speaker"] != "user" or turns[index + 1]["speaker"] != "assistant":
            continue
        start, end = turn["start"], turn["end"]
        length = max(end - start, 1e-9)
        step = 1
        while (time := start + step * INTERVAL_S) < end - 1e-6:
            slots.append(_Slot(round(time, 6), index + 1, index, (time - start) / length, False))
            step += 1
        slots.append(_Slot(end, index + 1, index, 1.0, True))
    return slots


def tier_of(heard: float) -> str:
    """How much of the true reply the LLM is shown, by the share of the user turn heard."""
    if heard >= 1.0:
        return "full"
    if heard <= 0.5:
        return "none"
    return "keywords" if heard < 0.75 else "more"


def keywords(reply: str, count: int = 3) -> list[str]:
    """The reply's `count` longest content words, in the order they come."""
    words = [w.strip(".,!?;:\"'").lower() for w in reply.split()]
    content = [w for w in dict.fromkeys(words) if w and w not in STOPWORDS]
    chosen = set(sorted(content, key=len, reverse=True)[:count])
    return [w for w in content if w in chosen]


def hint(tier: str, reply: str) -> str | None:
    if tier == "keywords":
        return "Your reply mentions: " + ", ".join(keywords(reply)) + "."
    if tier == "more":
        words = reply.split()
        return "Your reply begins with: " + " ".join(words[: max(1, (len(words) + 1) // 2)])
    return None


def messages_for(turns: list[dict], words: list[dict], slot: _Slot, tier: str) -> list[ChatMessage]:
    """The request of one event: the instructions (and the hint), the turns before the user turn,
    then the user's words heard so far."""
    system = SYSTEM_PROMPT if (text := hint(tier, turns[slot.turn]["text"])) is None else f"{SYSTEM_PROMPT}\n{text}"
    history = [ChatMessage(t["speaker"], t["text"]) for t in turns[: slot.user_turn]]
    user = turns[slot.user_turn]
    heard = " ".join(w["word"] for w in words if w["speaker"] == "user"
                     and user["start"] <= w["start"] and w["end"] <= slot.time + 1e-6)
    return [ChatMessage("system", system), *history, ChatMessage("user", heard or "...")]


# ------------------------------------------------------------------ random


def random_events(name: str, prepared: dict, pool: list[str], seed: int) -> list[OracleEvent]:
    """Intermediate events: a reply drawn from `pool` (other turns' replies); the last: the true one."""
    rng = random.Random(f"{seed}:{name}")
    turns, events = prepared["turns"], []
    for slot in event_slots(turns):
        truth = turns[slot.turn]["text"]
        if slot.last:
            text, tier = truth, "full"
        else:
            others = [reply for reply in pool if reply != truth] or [""]
            text, tier = rng.choice(others), "random"
        events.append(OracleEvent(slot.time, frame_of(slot.time), text, slot.turn, slot.last, tier))
    return events


def _pools(prepared: dict[str, dict]) -> dict[str, list[str]]:
    """The replies each dialogue's random events draw from: other dialogues', or its own other turns."""
    replies = {name: [t["text"] for t in p["turns"] if t["speaker"] == "assistant"] for name, p in prepared.items()}
    if len(prepared) == 1:
        return dict(replies)
    return {name: [r for other, rs in replies.items() if other != name for r in rs] for name in prepared}


# ------------------------------------------------------------------ llm


class _CachedLLM:
    """One LLM client behind a bounded number of concurrent requests, a disk cache keyed by the
    request's content, and retries with backoff."""

    def __init__(self, client: LLMClient, profile: BackendProfile, cache_dir: Path, concurrency: int) -> None:
        self.client, self.profile, self.cache_dir = client, profile, cache_dir
        self._limit = asyncio.Semaphore(max(1, concurrency))
        self._flying: dict[str, asyncio.Future[str]] = {}  # identical requests share one answer

    def key(self, messages: list[ChatMessage]) -> str:
        return digest(PROMPT_VERSION, json.dumps(self.profile.public(), sort_keys=True),
                      json.dumps([asdict(m) for m in messages]))

    async def answer(self, messages: list[ChatMessage]) -> str:
        """The reply to `messages`: from the cache, from the same request already in flight, or asked."""
        key = self.key(messages)
        path = self.cache_dir / f"{key}.json"
        if path.is_file() and isinstance(cached := read_json(path), dict) and "text" in cached:
            return cached["text"]
        if key not in self._flying:
            self._flying[key] = asyncio.ensure_future(self._fetch(messages, path))
        return await self._flying[key]

    async def _fetch(self, messages: list[ChatMessage], path: Path) -> str:
        async with self._limit:
            text = await self._ask(messages)
        write_json(path, {"text": text})
        return text

    async def _ask(self, messages: list[ChatMessage]) -> str:
        for attempt in range(RETRIES):
            try:
                return " ".join("".join([piece async for piece in self.client.stream_chat(messages)]).split())
            except LLMError as exc:
                if exc.kind in NO_RETRY or attempt == RETRIES - 1:
                    raise DataError(f"LLM {self.profile.name!r} failed: {exc}") from exc
                delay = exc.retry_after_s if exc.retry_after_s is not None else BACKOFF_S * 2**attempt
                logger.warning("LLM %s: %s; retrying in %.1f s", self.profile.name, exc, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")


async def llm_events(prepared: dict, llm: _CachedLLM) -> list[OracleEvent]:
    turns, words = prepared["turns"], prepared["words"]
    slots = event_slots(turns)

    async def text_of(slot: _Slot) -> str:
        tier = tier_of(slot.heard)
        return turns[slot.turn]["text"] if tier == "full" else await llm.answer(messages_for(turns, words, slot, tier))

    texts = await asyncio.gather(*(text_of(slot) for slot in slots))
    return [OracleEvent(s.time, frame_of(s.time), text, s.turn, s.last, tier_of(s.heard))
            for s, text in zip(slots, texts, strict=True)]


# ------------------------------------------------------------------ the stage


def simulate(run_dir: Path, *, strategy: str = "random", llm: str | None = None, seed: int = 0,
             concurrency: int = 4, profiles: Mapping[str, BackendProfile] | None = None) -> list[Path]:
    """Stage 2: `RUN/prepared/*.json` into `RUN/oracles/*.json`; dialogues already simulated with the
    same inputs are skipped. `llm` names a backend profile (of `profiles`, default the built-in ones)."""
    run_dir = Path(run_dir)
    if strategy not in ORACLE_STRATEGIES:
        raise DataError(f"oracle strategy must be one of {', '.join(ORACLE_STRATEGIES)}, not {strategy!r}")
    prepared = {path.stem: _read_prepared(path) for path in prepared_files(run_dir)}
    out = {name: run_dir / "oracles" / f"{name}.json" for name in prepared}
    if strategy == "random":
        pools = _pools(prepared)
        everything = json.dumps(prepared, sort_keys=True)  # the pools depend on every dialogue
        for name in tqdm(prepared, desc="oracles", unit="dialogue"):
            inputs = digest("random", str(seed), everything, name)
            if stored_hash(out[name]) != inputs:
                _write(out[name], name, "random", random_events(name, prepared[name], pools[name], seed), inputs)
        return list(out.values())
    profile = _profile(llm, profiles)
    asyncio.run(_simulate_llm(prepared, out, profile, run_dir / "oracles" / "cache", concurrency))
    return list(out.values())


def _profile(name: str | None, profiles: Mapping[str, BackendProfile] | None) -> BackendProfile:
    known = dict(DEFAULT_PROFILES if profiles is None else profiles)
    if name is None:
        raise DataError(f"the llm oracle strategy needs a backend profile (--llm): one of {', '.join(known)}")
    if name not in known:
        raise DataError(f"unknown LLM profile {name!r}; known: {', '.join(known)}")
    # the simulated reply may take longer than a live stream is allowed to: no hurry offline
    profile = known[name]
    return replace(profile, first_token_timeout_s=max(profile.first_token_timeout_s, 120.0),
                   token_timeout_s=max(profile.token_timeout_s, 60.0))


async def _simulate_llm(prepared: dict[str, dict], out: dict[str, Path], profile: BackendProfile,
                        cache_dir: Path, concurrency: int) -> None:
    from kame.backend import make_llm

    client = make_llm(profile)
    # the embedded model serves one request at a time: more in flight would only wait (and time out)
    llm = _CachedLLM(client, profile, cache_dir, 1 if profile.kind == "embedded" else concurrency)
    public = json.dumps(profile.public(), sort_keys=True)
    todo = {name: digest("llm", PROMPT_VERSION, public, json.dumps(p, sort_keys=True)) for name, p in prepared.items()}
    todo = {name: inputs for name, inputs in todo.items() if stored_hash(out[name]) != inputs}
    bar = tqdm(total=len(prepared), initial=len(prepared) - len(todo), desc="oracles", unit="dialogue")

    async def one(name: str) -> None:
        _write(out[name], name, "llm", await llm_events(prepared[name], llm), todo[name])
        bar.update()

    try:
        await asyncio.gather(*(one(name) for name in todo))
    finally:
        bar.close()
        if (close := getattr(client, "aclose", None)) is not None:
            await close()


def _read_prepared(path: Path) -> dict:
    value = read_json(path)
    if not isinstance(value, dict) or not {"name", "words", "turns"} <= set(value):
        raise DataError(f"{path}: not a prepared dialogue (run `kame data prepare` again)")
    value.pop("inputs_sha256", None)
    return value


def _write(path: Path, name: str, strategy: str, events: list[OracleEvent], inputs: str) -> None:
    write_json(path, {"name": name, "strategy": strategy, "events": [asdict(e) for e in events],
                      "inputs_sha256": inputs})
