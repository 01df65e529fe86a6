"""The one vocabulary: the planner emits the session's own frozen events, and `wire_event` maps each
to the JSON a client with ?events=1 gets, byte for byte as the protocol documents it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kame.backend.attempts import AttemptRecord
from kame.protocol import encode_event, parse_event, session_event, wire_event
from kame.session_events import (
    AsrFailed,
    AssistantAudio,
    AssistantText,
    BackendChanged,
    FramesSkipped,
    KnowledgeRetrieval,
    LLMAttempt,
    OracleApplied,
    OracleLead,
    SessionFailed,
    SessionStats,
    ToolCallEvent,
    Transcript,
)

WIRE = [
    (Transcript(True, "hi", 0.0, 1.5, 0.2),
     '{"type":"transcript","final":true,"text":"hi","start_s":0.0,"end_s":1.5}'),
    (Transcript(True, "Mm-hmm.", 3.0, 3.5, 0.2, backchannel=True),  # the field only on a backchannel
     '{"type":"transcript","final":true,"text":"Mm-hmm.","start_s":3.0,"end_s":3.5,"backchannel":true}'),
    (Transcript(False, "so what is", 0.2, 1.4, 0.1, settled=True),  # the field only on a settled partial
     '{"type":"transcript","final":false,"text":"so what is","start_s":0.2,"end_s":1.4,"settled":true}'),
    (OracleApplied("reset", 3, "a b", 4, 10, True, 0),
     '{"type":"oracle","op":"reset","epoch":3,"text":"a b","tokens":4,"frame":10,"accepted":true,"late_tokens":0}'),
    (LLMAttempt("started", 1, "b", "partial", user_text="x"),
     '{"type":"llm","phase":"started","epoch":1,"backend":"b","trigger":"partial","user_text":"x","answer":"",'
     '"oracle_tokens":0,"took_oracle":false,"kept_oracle":false}'),
    (LLMAttempt("failed", 1, "b", "final", answer="q", oracle_tokens=3, took_oracle=True, error_kind="server",
                error="boom", retry_in_s=0.5),
     '{"type":"llm","phase":"failed","epoch":1,"backend":"b","trigger":"final","user_text":"","answer":"q",'
     '"oracle_tokens":3,"took_oracle":true,"kept_oracle":false,"error_kind":"server","error":"boom","retry_in_s":0.5}'),
    (ToolCallEvent("done", 2, "c1", "t", "{}", "res", 0.1, True, False, None),
     '{"type":"tool","phase":"done","epoch":2,"call_id":"c1","name":"t","arguments":"{}","result":"res",'
     '"elapsed_s":0.1,"cached":true,"truncated":false}'),
    (KnowledgeRetrieval(1, "q", 2, ("a", "b"), 30, 0.01),
     '{"type":"knowledge","epoch":1,"query":"q","passages":2,"sources":["a","b"],"tokens":30,"elapsed_s":0.01}'),
    (OracleLead(1.2, 3), '{"type":"oracle_lead","lead_s":1.2,"epoch":3}'),
    (BackendChanged("n", "m", "p"), '{"type":"backend","name":"n","model":"m","system_prompt":"p"}'),
    (AsrFailed("x"), '{"type":"asr","status":"failed","message":"x"}'),
    (SessionFailed("engine", "e"), '{"type":"error","code":"engine","message":"e"}'),
]


@pytest.mark.parametrize(("event", "json"), WIRE, ids=[type(e).__name__ for e, _ in WIRE])
def test_each_session_event_has_its_wire_json_byte_for_byte(event, json):
    wire = wire_event(event)
    assert encode_event(wire) == b"\x07" + json.encode()
    assert parse_event(json.encode()) == wire  # and a client reads back what was sent


@pytest.mark.parametrize(("event", "json"), WIRE, ids=[type(e).__name__ for e, _ in WIRE])
def test_a_client_reads_each_wire_event_back_into_the_session_event(event, json):
    """`session_event` of the documented JSON is the event that made it; what the wire does not carry
    (a transcript's lag, an attempt's oracle epoch) is unknown on the client (NaN) or its default."""
    back = session_event(parse_event(json.encode()))
    if isinstance(event, Transcript):
        assert math.isnan(back.lag_s)
        back = dataclasses.replace(back, lag_s=event.lag_s)
    assert back == event


def test_wire_events_no_session_event_makes_read_back_as_none():
    assert session_event(parse_event(b'{"type":"stats","frames_in":1,"frames_out":1,"frames_dropped":0}')) is None


def test_audio_text_and_stats_have_no_json_event():
    for event in (AssistantAudio(0, np.zeros(3, np.float32), True, None), AssistantText(0, "x"), FramesSkipped(2),
                  SessionStats(1, 2, 3, None)):
        assert wire_event(event) is None


def test_an_attempt_event_is_a_frozen_snapshot_of_the_planners_record():
    record = AttemptRecord(1, "fake", "partial", "hi", requested_at=10.0)
    started = record.snapshot("started")
    record.first_token_at, record.text, record.tokens = 10.25, "hello there", 2
    first = record.snapshot("first_token")
    record.status = "done"
    done = record.snapshot("done")
    record.text = "changed later"
    assert started == LLMAttempt("started", 1, "fake", "partial", user_text="hi")
    assert first == LLMAttempt("first_token", 1, "fake", "partial", latency_s=0.25)
    assert done.answer == "hello there" and done.oracle_tokens == 2  # not what the record says now
    with pytest.raises(dataclasses.FrozenInstanceError):
        done.answer = "x"
