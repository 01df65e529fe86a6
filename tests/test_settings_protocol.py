"""Settings precedence and validation; the wire protocol's parsers never crash on any input."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kame.protocol import (
    ConfigureMessage,
    Kind,
    OracleEvent,
    ProtocolError,
    decode,
    encode,
    encode_client_message,
    encode_event,
    parse_client_message,
    parse_event,
)
from server.settings import ServerSettings, SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_default_toml_documents_every_key_with_its_default():
    data = tomllib.loads((ROOT / "configs" / "default.toml").read_text())
    text = (ROOT / "configs" / "default.toml").read_text()
    defaults = ServerSettings()
    for key in ServerSettings.model_fields:
        assert key in text, f"configs/default.toml does not mention {key}"
        if key in data and not isinstance(data[key], dict):
            assert data[key] == getattr(defaults, key), key
    unset = {key for key, value in defaults.planner.model_dump().items() if value is None}  # commented out
    assert data["planner"] == defaults.planner.model_dump(exclude=unset)
    assert all(f"# {key} = " in text for key in unset)
    assert load_settings(ROOT / "configs" / "default.toml") == defaults


def test_precedence_defaults_file_env_cli(tmp_path, monkeypatch):
    config = tmp_path / "c.toml"
    config.write_text('port = 9001\nasr = "none"\n[planner]\nmin_new_words = 3\n')
    assert load_settings(config).port == 9001
    monkeypatch.setenv("KAME_PORT", "9002")
    monkeypatch.setenv("KAME_PLANNER__MAX_RESTARTS", "7")
    loaded = load_settings(config)
    assert (loaded.port, loaded.asr, loaded.planner.min_new_words, loaded.planner.max_restarts) == (9002, "none", 3, 7)
    assert load_settings(config, port=9003).port == 9003


@pytest.mark.parametrize(
    ("content", "cli", "message"),
    [
        ("port = -1\n", {}, "setting port"),
        ('asr = "vosk"\n', {}, "setting asr"),
        ("bogus = 1\n", {}, "setting bogus"),
        ("[planner]\nmin_new_words = 0\n", {}, "setting planner.min_new_words"),
        ("", {"llm": "nope"}, "unknown backend profile 'nope'"),
        ("port = \n", {}, "not valid TOML"),
        ('[profiles.x]\nmodel = "m"\ntemperature = 9\n', {}, "setting profiles.x.temperature"),
    ],
)
def test_bad_settings_name_the_key(tmp_path, content, cli, message):
    config = tmp_path / "c.toml"
    config.write_text(content)
    with pytest.raises(SettingsError, match=message):
        load_settings(config, **cli)


def test_missing_config_file():
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings("/nonexistent/kame.toml")


def test_custom_profile_from_cli_becomes_the_default():
    loaded = load_settings(None, llm_base_url="http://127.0.0.1:1/v1", llm_model="m", llm_api_key_env="MY_KEY")
    assert loaded.default_profile == "custom"
    assert loaded.all_profiles()["custom"].api_key_env == "MY_KEY"


@given(st.binary(max_size=64))
def test_decode_never_crashes(data):
    try:
        kind, payload = decode(data)
    except ProtocolError:
        assert not data or data[0] not in {k.value for k in Kind}
    else:
        assert encode(kind, payload) == data


@given(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                 st.dictionaries(st.text(max_size=10), st.one_of(st.none(), st.integers(), st.text(max_size=20)),
                                 max_size=4).map(lambda d: json.dumps(d).encode())))
@settings(max_examples=300)
def test_client_message_parser_only_raises_protocol_errors(payload):
    try:
        message = parse_client_message(payload)
    except ProtocolError:
        return
    assert isinstance(message, ConfigureMessage)


@given(st.text(max_size=50), st.one_of(st.none(), st.text(max_size=30)))
def test_configure_round_trip(prompt, backend):
    message = ConfigureMessage(backend=backend, system_prompt=prompt)
    kind, payload = decode(encode_client_message(message))
    assert kind is Kind.CLIENT_JSON and parse_client_message(payload) == message


@given(st.binary(max_size=200))
def test_event_parser_only_raises_protocol_errors(payload):
    try:
        event = parse_event(payload)
    except ProtocolError:
        return
    assert parse_event(event.model_dump_json(exclude_none=True).encode()) == event


def test_event_round_trip():
    event = OracleEvent(op="reset", epoch=3, text="Paris", tokens=2, frame=17)
    kind, payload = decode(encode_event(event))
    assert kind is Kind.EVENT and parse_event(payload) == event


def test_every_event_round_trips_with_its_optional_fields_left_out():
    from kame.protocol import StatsEvent

    for event in (StatsEvent(frames_in=1, frames_out=1, frames_dropped=0),
                  OracleEvent(op="append", epoch=1, text="", tokens=0, frame=0)):
        assert parse_event(encode_event(event)[1:]) == event


def test_asr_and_history_settings_reach_the_engines(monkeypatch):
    """[whisper], [kyutai_stt] and planner.max_history_turns: settings with the same precedence as the rest."""
    from kame.asr import build_asr

    monkeypatch.setenv("KAME_WHISPER__MIN_SILENCE_S", "1.2")
    settings = load_settings(None, kyutai_stt={"eot_threshold": 0.7}, planner={"max_history_turns": 3})
    runtime = settings.runtime_settings()
    assert runtime.asr_options["whisper"]["min_silence_s"] == 1.2
    assert runtime.asr_options["kyutai-stt"] == {"eot_head": 2, "eot_threshold": 0.7, "min_silence_s": 0.6,
                                                  "vad_threshold": 0.5, "end_of_turn": "smart-turn", "eot_tail_s": 0.1,
                                                  "eot_fallback_s": 2.5, "smart_turn_model": None}
    assert runtime.planner.max_history_turns == 3
    asr = build_asr("whisper", options=runtime.asr_options["whisper"])
    try:
        assert asr.options.min_silence_s == 1.2 and asr.options.decode_interval_s == 0.3
    finally:
        asr.close()
    with pytest.raises(SettingsError, match="whisper.vad_threshold"):
        load_settings(None, whisper={"vad_threshold": 1.5})


def test_quantize_is_a_setting_like_the_others(monkeypatch):
    assert load_settings(None).runtime_settings().quantize is None
    monkeypatch.setenv("KAME_QUANTIZE", "int8")
    assert load_settings(None).runtime_settings().quantize == "int8"
    with pytest.raises(SettingsError, match="setting quantize"):
        load_settings(None, quantize="int4")
