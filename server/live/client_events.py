"""The client's GPT-Live events, parsed with the openai SDK's own models (`openai.types.live`, the
schema): `parse(text)` returns the SDK's typed event or raises `LiveError` with the protocol's error
type, code and the parameter at fault.

The SDK's models accept unknown fields (they are built to read a server that grows); the Live
server does not ("a strict configuration object that rejects unknown fields"), so every field the
models do not define is refused here by name (`unknown_parameter`, `session.x`).
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Union, get_args, get_origin

from openai.types.live import ClientEvent
from pydantic import BaseModel, ValidationError

from kame.protocol import ProtocolError
from server.realtime.client_events import decode_frame


class LiveError(ProtocolError):
    """A bad client event: sent as an `error` event; the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None, client_event_id: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code, self.param, self.client_event_id, self.kind = code, param, client_event_id, kind


def _members(annotation: object) -> tuple:
    """The types of a union (`Annotated` and `Optional` unwrapped); a type alone is a union of one."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(m for arg in get_args(annotation) for m in _members(arg) if m is not type(None))
    return (annotation,)


def _tags(model: type[BaseModel]) -> tuple[str, ...]:
    """The `type` literal(s) of a model of a discriminated union; () when it has none."""
    field = model.model_fields.get("type")
    if field is None:
        return ()
    return tuple(t for m in _members(field.annotation) if get_origin(m) is typing.Literal for t in get_args(m))


# fields the protocol requires though the SDK's models default them ("Required, nullable")
REQUIRED_NULLABLE = {kind: "delegation_id" for kind in
                     ("session.commentary.append", "session.thinking.append", "session.instructions.append")}
EVENT_MODELS: dict[str, type[BaseModel]] = {tag: model for model in _members(ClientEvent) for tag in _tags(model)}


def unknown_parameter(annotation: object, value: object, path: str) -> str | None:
    """The first key in `value` that `annotation` (an SDK model, a union or list of them) does not
    define, as a parameter path (`session.audio.x`, `session.input[0].y`); None when there is none.
    Free-form objects (`Dict[str, object]`, a tool's JSON schema) are not looked into."""
    models = [m for m in _members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    if isinstance(value, dict) and models:
        tag = value.get("type")
        tagged = [m for m in models if tag in _tags(m)]
        candidates = tagged or models
        found = [_unknown_in_model(m, value, path) for m in candidates]
        return None if None in found else found[0]
    for member in _members(annotation):
        if get_origin(member) in (list, typing.List) and isinstance(value, list):  # noqa: UP006
            (item_type,) = get_args(member)
            for index, item in enumerate(value):
                if (found := unknown_parameter(item_type, item, f"{path}[{index}]")) is not None:
                    return found
    return None


def _unknown_in_model(model: type[BaseModel], value: dict, path: str) -> str | None:
    fields = {field.alias or name: field for name, field in model.model_fields.items()}
    for key, item in value.items():
        here = f"{path}.{key}" if path else key
        field = fields.get(key)
        if field is None:
            return here
        if (found := unknown_parameter(field.annotation, item, here)) is not None:
            return found
    return None


def parse(text: str | None, limit_bytes: int) -> tuple[BaseModel, str | None]:
    """A client's text frame -> (the SDK's event, its event_id); LiveError for a bad one."""
    raw, event_id = decode_frame(text, limit_bytes, LiveError)
    model = EVENT_MODELS.get(raw["type"])
    if model is None:
        raise LiveError("invalid_value", f"Invalid value: {raw['type']!r}. Supported event types are: "
                        f"{', '.join(sorted(EVENT_MODELS))}.", "type", event_id)
    if (param := _unknown_in_model(model, raw, "")) is not None:
        raise LiveError("unknown_parameter", f"Unknown parameter: '{param}'.", param, event_id)
    if (required := REQUIRED_NULLABLE.get(raw["type"])) is not None and required not in raw:
        raise LiveError("missing_required_parameter", f"Missing required parameter: '{required}' (null for the "
                        "session as a whole).", required, event_id)
    try:
        return model.model_validate(raw), event_id
    except ValidationError as exc:
        raise invalid(exc, event_id) from None


def invalid(exc: ValidationError, event_id: str | None = None, prefix: str = "") -> LiveError:
    """pydantic's complaint as the protocol's error, naming the parameter at fault (`_telling`)."""
    error = _telling(exc.errors(include_url=False))
    parts = [p for p in error["loc"] if not _is_step(p)]
    param = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    param = param.lstrip(".") or None
    if error["type"] == "missing":
        return LiveError("missing_required_parameter", f"Missing required parameter: '{param}'.", param, event_id)
    message = error["msg"].removeprefix("Value error, ")
    return LiveError("invalid_value", f"Invalid value for '{param}': {message}.", param, event_id)


def _telling(errors: list[dict]) -> dict:
    """Of pydantic's complaints, one about what the client meant: those under a union member that the
    input's own tag rules out (a `type`, or a message's `role`, that is not the member's) are left aside,
    and of the rest the deepest is the most precise. Without this, a Decisions question missing its
    instructions was reported as `session.delegation.type` not being 'client'."""
    tags = [e for e in errors if _tag_complaint(e)]
    ruled_out = {tuple(e["loc"][:-1]) for e in tags if _is_step(e["loc"][-2])}
    kept = [e for e in errors if not any(tuple(e["loc"][:len(member)]) == member for member in ruled_out)]
    if kept:
        return max(kept, key=lambda e: len(e["loc"]))
    if not tags:
        return errors[0]
    deepest = max(len(e["loc"]) for e in tags)  # no member takes this tag: say what every one would
    tags = [e for e in tags if len(e["loc"]) == deepest]
    expected = ", ".join(dict.fromkeys(str(e.get("ctx", {}).get("expected", "")) for e in tags))
    return {**tags[0], "msg": f"Input should be one of {expected}"}


def _tag_complaint(error: dict) -> bool:
    """pydantic's complaint that a member's tag (`type`, or a message's `role`) is not the input's."""
    return error["type"] == "literal_error" and len(error["loc"]) > 1 and error["loc"][-1] in ("type", "role")


def _is_step(part: object) -> bool:
    """pydantic's own steps in a location (a union member's name, `literal[...]`), not fields."""
    return isinstance(part, str) and (part[:1].isupper() or part in ("str", "int", "float", "bool") or part.startswith(
        ("literal[", "function-", "lax-", "strict-", "tagged-union[", "list[", "dict[")))
