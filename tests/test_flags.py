"""The server's flags, declared once (server/flags.py) for `kame serve` and `kame doctor`: each sets a setting of
the schema, with exactly the setting's values, and both commands turn the same flags into the same settings."""

from __future__ import annotations

import argparse
import types
import typing

import pytest

from server.flags import MODEL_FLAGS, SERVE_FLAGS, add_flags, given
from server.settings import ServerSettings, WhisperSettings, load_settings

FOLDED = {"end_of_turn": WhisperSettings.model_fields["end_of_turn"].annotation,  # load_settings folds these in
          "knowledge_dir": str, "sip_listen": str}


def _annotation(setting: str):
    return FOLDED.get(setting) or ServerSettings.model_fields[setting].annotation


def _literal(annotation) -> tuple[str, ...] | None:
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return None


def _plain(annotation):
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (arg,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return arg
    return annotation


@pytest.mark.parametrize("flag", SERVE_FLAGS, ids=[f.name for f in SERVE_FLAGS])
def test_each_flag_takes_exactly_its_settings_values(flag):
    annotation = _annotation(flag.setting)
    assert flag.choices == _literal(annotation)
    assert (flag.type is int) == (_plain(annotation) is int)
    assert flag.repeat == (typing.get_origin(_plain(annotation)) is list)


def test_doctor_takes_serves_model_flags_and_both_build_the_same_settings():
    assert set(MODEL_FLAGS) <= set(SERVE_FLAGS)
    argv = ["--device", "cpu", "--max-sessions", "3", "--kv-cache", "int8", "--end-of-turn", "silence",
            "--llm", "embedded", "--asr", "none"]
    built = []
    for flags in (SERVE_FLAGS, MODEL_FLAGS):
        parser = argparse.ArgumentParser()
        add_flags(parser, flags)
        built.append(load_settings(None, **given(parser.parse_args(argv), flags)))
    assert built[0] == built[1]
    assert (built[0].device, built[0].max_sessions, built[0].kv_cache, built[0].whisper.end_of_turn) == (
        "cpu", 3, "int8", "silence")


def test_a_value_the_setting_does_not_take_is_refused_by_the_flag(capsys):
    parser = argparse.ArgumentParser()
    add_flags(parser, MODEL_FLAGS)
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "gpu"])
    assert "invalid choice: 'gpu'" in capsys.readouterr().err
