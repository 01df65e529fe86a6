"""The flags several `kame` commands share, each declared once: --device (a torch device) and --frontend (a
front-end source). Each command keeps its own default. `kame serve`'s flags are server/flags.py's, with the same
words. Nothing heavy is imported here: `kame --help` builds every parser without torch."""

from __future__ import annotations

import argparse

DEVICE_HELP = "auto, cpu, cuda (default: auto)"
FRONTEND_SOURCES = "preset (tiny, tiny-copy, moshi-7b-random), local directory or HF repo id"
AS_SERVE = "SakanaAI/kame with a GPU, tiny-copy without"  # what kame serve runs when no front-end is named
FRONTEND_HELP = f"{FRONTEND_SOURCES} (default: {AS_SERVE})"


def add_device_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = "auto",
                    what: str = "") -> None:
    """--device; `default` None: the command tells an absent flag apart and fills in auto itself; `what`: whose
    device it is, where it is not the front-end's."""
    parser.add_argument("--device", default=default, help=f"{what}{DEVICE_HELP}")


def add_frontend_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None,
                      base: bool = False, required: bool = False) -> None:
    """--frontend; `default` None: kame serve's choice, unless `base` (the front-end a training starts from,
    which has no default)."""
    if base:
        text = f"the base front-end: {FRONTEND_SOURCES}"
    else:
        text = f"{FRONTEND_SOURCES} (default: {default or AS_SERVE})"
    parser.add_argument("--frontend", default=default, required=required, help=text)
