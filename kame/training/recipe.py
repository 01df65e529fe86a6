"""Training recipes: a TOML file of `kame train` options (and, instead of recorded dialogues, a
synthetic data source), so that a run can be written down, committed and re-made.

    kame train --recipe tiny-copy --out RUN          # a recipe shipped in kame/training/recipes/
    kame train --recipe my-run.toml --out RUN --steps 500   # the command line wins over the file

Keys are `kame train`'s options with underscores (`lora_rank`, `audio_weight`, `augment =
false` for --no-augment; not `out`, `resume` or `from_tokens`, which belong to one command);
`data` is relative to the recipe's own folder. A `[synthetic]` table names a generator of
RUN/tokens (see SYNTHETIC_TASKS) in place of `data`: `task`, `dialogues`, `frames` and its own
`seed` (default: the recipe's).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kame.errors import KameError
from kame.training.runfiles import ORACLE_STRATEGIES, write_json

RECIPES_DIR = Path(__file__).parent / "recipes"

# option -> accepted types (bool is checked before int: TOML's true is not a step count)
OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "frontend": (str,), "data": (str,), "steps": (int,), "chunk": (int,), "batch": (int,), "lr": (float, int),
    "seed": (int,), "checkpoint_every": (int,), "oracles": (str,), "llm": (str,), "asr_model": (str,),
    "lora_rank": (int,), "device": (str,), "augment": (bool,), "audio_weight": (float, int), "fsdp": (bool,),
}
SYNTHETIC_TASKS = ("oracle-echo", "copy")
SYNTHETIC_KEYS = {"task": (str,), "dialogues": (int,), "frames": (int,), "seed": (int,)}


@dataclass(frozen=True)
class Recipe:
    path: Path
    options: dict  # option -> value, checked against OPTION_TYPES
    synthetic: dict | None  # the [synthetic] table, or None: the data comes from --data


def shipped() -> list[str]:
    """The names of the recipes that come with the package."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def resolve(name: str) -> Path:
    """A recipe file: a path, or the name of a shipped recipe."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if "/" not in name and (RECIPES_DIR / f"{name}.toml").is_file():
        return RECIPES_DIR / f"{name}.toml"
    raise KameError(f"recipe {name!r}: no such file, and not a shipped recipe ({', '.join(shipped())})")


def load(name: str) -> Recipe:
    path = resolve(name)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KameError(f"cannot read recipe {path}: {exc}") from exc
    synthetic = raw.pop("synthetic", None)
    options = {key: _checked(path, key, value, OPTION_TYPES) for key, value in raw.items()}
    if options.get("oracles", "random") not in ORACLE_STRATEGIES:
        raise KameError(f"recipe {path}: oracles must be one of {', '.join(ORACLE_STRATEGIES)}, "
                        f"not {options['oracles']!r}")
    if "data" in options:  # a recipe's folders are where the recipe is, not where it is run from
        options["data"] = str((path.parent / Path(options["data"]).expanduser()).resolve())
    if synthetic is not None:
        synthetic = _check_synthetic(path, synthetic)
        if "data" in options:
            raise KameError(f"recipe {path}: `data` and [synthetic] are two sources of dialogues; keep one")
    return Recipe(path, options, synthetic)


def _checked(path: Path, key: str, value, types: dict[str, tuple[type, ...]]):
    if key not in types:
        raise KameError(f"recipe {path}: unknown key {key!r} (known: {', '.join(sorted(types))})")
    wanted = types[key]
    if isinstance(value, bool) and bool not in wanted or not isinstance(value, wanted):
        names = " or ".join(t.__name__ for t in wanted)
        raise KameError(f"recipe {path}: {key} must be a {names}, not {value!r}")
    return float(value) if float in wanted and not isinstance(value, bool) else value


def _check_synthetic(path: Path, table) -> dict:
    if not isinstance(table, dict):
        raise KameError(f"recipe {path}: synthetic must be a table ([synthetic])")
    spec = {key: _checked(path, key, value, SYNTHETIC_KEYS) for key, value in table.items()}
    if spec.get("task") not in SYNTHETIC_TASKS:
        raise KameError(f"recipe {path}: [synthetic] task must be one of {', '.join(SYNTHETIC_TASKS)}, "
                        f"not {spec.get('task')!r}")
    for key in ("dialogues", "frames"):
        if key in spec and spec[key] < 2:
            raise KameError(f"recipe {path}: [synthetic] {key} must be at least 2")
    if spec["task"] == "copy" and "frames" in spec:
        raise KameError(f"recipe {path}: [synthetic] task copy has no `frames` (its dialogues last as long as "
                        "their turns)")
    return spec


# ---------------------------------------------------------------- the synthetic data stage


def _writer(task: str):
    from kame.training import synthetic

    return {"oracle-echo": synthetic.write_oracle_echo, "copy": synthetic.write_copy_task}[task]


def resolved(spec: dict, seed: int) -> dict:
    """The spec with every size the generator would default filled in, and the seed (the table's
    own, else the recipe's): what the token files are a function of."""
    defaults = {name: param.default for name, param in inspect.signature(_writer(spec["task"])).parameters.items()
                if name in ("dialogues", "frames")}
    return {"seed": seed, **defaults, **spec}


def _names_digest(folder: Path) -> str | None:
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return None
    names = json.loads(manifest.read_text()).get("dialogues", [])
    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def synthetic_stage(run_dir: Path, spec: dict, frontend: str, seed: int) -> list[Path]:
    """RUN/tokens from the recipe's generator, once: a rerun with the same spec skips it; another
    spec, or token files changed since (another stage wrote the manifest), is refused."""
    from kame.frontend.loader import load_frontend
    from kame.training import synthetic

    wanted = {**resolved(spec, seed), "frontend": frontend}
    folder = Path(run_dir) / "tokens"
    marker = folder / "synthetic.json"
    if marker.is_file():
        made = json.loads(marker.read_text())
        digest = made.pop("dialogues_sha256", None)
        if made != wanted:
            raise KameError(f"{folder} was made by another synthetic spec ({made}); delete it to remake the tokens")
        if digest is None or digest != _names_digest(folder):
            raise KameError(f"{folder} no longer holds what the recipe made (its manifest changed); "
                            "delete it to remake the tokens, or train into another --out")
        return sorted(folder.glob("*.safetensors"))
    if (folder / "manifest.json").is_file():
        raise KameError(f"{folder} already holds token files not made by this recipe; train into another --out")
    base = load_frontend(frontend, "cpu")
    if base.tokenizer is None:
        raise KameError(f"front-end {frontend!r} has no text tokenizer: a synthetic task needs one")
    sizes = {k: v for k, v in wanted.items() if k in ("dialogues", "frames")}
    paths = _writer(spec["task"])(run_dir, frontend, base.tokenizer, synthetic.shape_of(base.lm),
                                  seed=wanted["seed"], **sizes)
    write_json(marker, {**wanted, "dialogues_sha256": _names_digest(folder)})
    return paths
