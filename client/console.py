"""What the terminal commands (`kame client`, `kame talk`) print of a session: the server's JSON
events as readable lines, or each message as a JSON line with its time."""

from __future__ import annotations

import json
from collections.abc import Callable


def describe_event(event: dict) -> str | None:
    """One readable line for a server event (`kame.protocol`'s JSON); None: not worth a line."""
    kind = event.get("type")
    if kind == "transcript":
        return f"user ({'final' if event['final'] else 'partial'}): {event['text']}"
    if kind == "oracle":
        return f"oracle {event['op']} (epoch {event['epoch']}, frame {event['frame']}): {event['text']}"
    if kind == "llm" and event["phase"] in ("started", "failed"):
        detail = event.get("error") or event.get("user_text", "")
        return f"llm {event['phase']} (epoch {event['epoch']}, {event['backend']}): {detail}"
    if kind in ("error", "asr", "backend"):
        return f"{kind}: {event.get('message') or event.get('name')}"
    return None


def printer(as_json: bool) -> Callable[[tuple[float, str, object]], None]:
    """Prints a conversation's (seconds, kind, value) items: JSON lines, or the readable ones."""
    def show(item: tuple[float, str, object]) -> None:
        t, kind, value = item
        if as_json:
            print(json.dumps({"t": round(t, 3), "type": kind, kind: value}), flush=True)
        elif kind == "event":
            line = describe_event(value)
            if line:
                print(f"[{t:7.2f}] {line}", flush=True)
        elif kind == "error":
            print(f"[{t:7.2f}] error: {value}", flush=True)
    return show
