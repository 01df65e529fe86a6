"""Backchannels: the listener's "mm-hm", "right", "yeah" said while the other one talks, which tell
the speaker they are heard and are not a turn of their own. The planner lets one pass while the
assistant speaks (no LLM attempt, no user turn, the oracle kept), and the transports do not open a
user turn for it."""

from __future__ import annotations

import re

# normalised (lower case, letters only, hyphens and spaces dropped): what English listeners say
# and what Whisper writes for it ("Mm-hmm.", "Mhm.", "Uh-huh.")
_SOUNDS = {"mm", "mmm", "mhm", "mmhm", "mmhmm", "hm", "hmm", "uhhuh", "uhuh", "ah", "aha", "oh", "ooh", "wow"}
_WORDS = {"yeah", "yep", "yes", "yup", "right", "okay", "ok", "sure", "alright", "cool", "nice", "great", "exactly",
          "true", "indeed", "totally", "absolutely", "gotcha", "interesting", "really", "uh", "um"}
_PHRASES = {"i see", "got it", "i know", "go on", "all right", "makes sense", "of course", "oh okay", "oh yeah",
            "oh really", "oh wow", "okay okay", "yeah yeah", "right right", "uh huh", "mm hm", "mm hmm", "sure sure"}
MAX_WORDS = 3  # a longer utterance is a turn, whatever its words


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z\s-]", "", text.lower()).replace("-", "").split()


def is_backchannel(text: str) -> bool:
    """`text` (a transcript) says nothing but a backchannel: "Mm-hmm.", "Right, right.", "Oh, I see."
    A question ("Really?") is not one: it asks for an answer; nor are fillers alone ("um": a hesitation)."""
    if text.strip().endswith("?"):
        return False
    words = _words(text)
    if not words or len(words) > MAX_WORDS or all(w in ("uh", "um") for w in words):
        return False
    index = 0
    while index < len(words):  # each piece a backchannel phrase (two words) or word
        if " ".join(words[index:index + 2]) in _PHRASES:
            index += 2
        elif words[index] in _SOUNDS or words[index] in _WORDS:
            index += 1
        else:
            return False
    return True
