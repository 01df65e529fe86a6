"""`kind = "python"`: an importable callable (`"pkg.module:function"`, sync or async) as a tool. Its
JSON schema is the one configured, or derived from its type hints and docstring (Google style
`Args:` lines describe the parameters). A sync callable runs on a thread of the tools' own pool
(`SYNC_THREADS`), not asyncio's default one, which the ASR and the knowledge base share: a thread
cannot be cancelled, so a sync call past its timeout is answered with an error but keeps its
thread until it returns, and when every thread of the pool is held so, new sync calls are
refused at once instead of queueing behind them."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
import threading
import types
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from kame.tools.base import DEFAULT_LIMITS, ToolError, ToolLimits, ToolSpec

SYNC_THREADS = 8  # sync tool calls running at once, across the process
_pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="kame-tool")
_busy = threading.BoundedSemaphore(SYNC_THREADS)  # held from submit until the call returns


def _release_after(function: Callable, /, **arguments: Any) -> Any:
    try:
        return function(**arguments)
    finally:
        _busy.release()


async def run_sync(function: Callable, arguments: dict) -> Any:
    """`function(**arguments)` on the tools' pool; an error at once when every thread is held."""
    if not _busy.acquire(blocking=False):
        raise ToolError(f"all {SYNC_THREADS} threads of the sync tools are busy (calls that timed out still run)")
    try:
        future = _pool.submit(_release_after, function, **arguments)
    except BaseException:
        _busy.release()
        raise
    return await asyncio.wrap_future(future)


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def load_callable(path: str) -> Callable:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ToolError(f"callable {path!r} must look like 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ToolError(f"callable {path!r}: cannot import {module_name} ({exc})") from exc
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ToolError(f"callable {path!r}: {module_name} has no {attribute}")
    if not callable(target):
        raise ToolError(f"callable {path!r} is not callable")
    return target


def _schema_of(hint: Any) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        return _schema_of(kept[0]) if len(kept) == 1 else {"anyOf": [_schema_of(a) for a in kept]}
    if origin in (list, tuple, set, frozenset):
        return {"type": "array", **({"items": _schema_of(args[0])} if args else {})}
    if origin is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    return {}  # anything: the model is told nothing more


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(the summary paragraph, {parameter: description}) of a Google-style docstring."""
    doc = inspect.cleandoc(doc or "")
    summary = doc.split("\n\n")[0].replace("\n", " ").strip()
    described: dict[str, str] = {}
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if section:
        for line in section.group(1).splitlines():
            if match := re.match(r"\s+(\w+)\s*(?:\([^)]*\))?:\s*(.+)", line):
                described[match.group(1)] = match.group(2).strip()
    return summary, described


def derive_schema(function: Callable) -> tuple[str, dict]:
    """(description, JSON schema of the arguments) from the signature, type hints and docstring."""
    summary, described = _docstring_parts(function.__doc__ or "")
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # unresolvable annotations: the parameters go untyped
        hints = {}
    properties, required = {}, []
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        schema = _schema_of(hints.get(name, Any))
        if name in described:
            schema["description"] = described[name]
        if parameter.default is inspect.Parameter.empty:
            required.append(name)
        else:
            schema["default"] = parameter.default
        properties[name] = schema
    schema = {"type": "object", "properties": properties, "required": required}
    return summary, schema


class PythonTool:
    def __init__(self, name: str, function: Callable | str, description: str | None = None,
                 parameters: dict | None = None, limits: ToolLimits = DEFAULT_LIMITS) -> None:
        self.function = load_callable(function) if isinstance(function, str) else function
        derived_description, derived = derive_schema(self.function)
        description = description or derived_description or f"the python callable {name}"
        self.spec = ToolSpec(name, description, parameters or derived)
        self.limits = limits

    async def call(self, arguments: dict) -> Any:
        try:
            inspect.signature(self.function).bind(**arguments)
        except TypeError as exc:
            raise ToolError(f"bad arguments for {self.spec.name}: {exc}") from exc
        if inspect.iscoroutinefunction(self.function):
            return await self.function(**arguments)
        result = await run_sync(self.function, arguments)
        return await result if inspect.isawaitable(result) else result
