"""Decision questions answered by an LLM: choice, predicate and score questions (OpenAI's Decision API, which
GPT-Live's Decisions delegation and transcript triggers run) asked about the conversation, the answers in the
Decision API's shape (a refusal for a question the model did not answer).

The model is asked for one JSON object (with a JSON schema where the endpoint takes `response_format`, else by
the prompt alone): for each question its answer and a confidence in [0, 1]; the probabilities the Decision
API reports are made from that confidence (the answer's, the rest shared), not read from logprobs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from kame.backend.llm import ChatMessage, LLMClient, LLMError

logger = logging.getLogger(__name__)

SYSTEM = ("You judge a live voice conversation. Answer each question about it from what was said, in order, "
          "as one JSON object {\"answers\": [{\"index\": I, \"answer\": A, \"confidence\": C}]}: for a predicate, "
          "A is true or false; for a choice, A is one of its values exactly; for a score, A is one of its level "
          "labels exactly. C is how sure you are, from 0 to 1. Leave out a question you cannot answer.")


@dataclass(frozen=True)
class Question:
    """One question: `kind` choice, predicate or score; `options`: a choice's values, a score's level labels."""

    kind: str
    instructions: str
    name: str | None = None
    options: tuple = ()
    descriptions: tuple[str | None, ...] = ()

    @classmethod
    def of(cls, question: dict) -> Question:
        """From the Decision API's question (a dict as the SDK dumps it); its instructions' parts as text."""
        kind, instructions = question["type"], question["instructions"]
        if not isinstance(instructions, str):
            instructions = parts_text(instructions)
        entries = question.get("choices") if kind == "choice" else question.get("levels") if kind == "score" else []
        key = "value" if kind == "choice" else "label"
        return cls(kind, instructions, question.get("name"), tuple(e[key] for e in entries or ()),
                   tuple(e.get("description") for e in entries or ()))

    def describe(self, index: int) -> str:
        label = f" ({self.name})" if self.name else ""
        text = f"{index}. [{self.kind}]{label} {self.instructions}"
        if self.options:
            text += " Options: " + "; ".join(json.dumps(o) + (f" = {d}" if d else "")
                                            for o, d in zip(self.options, self.descriptions, strict=True))
        return text


def parts_text(parts) -> str:
    """A Decision message's or question's content parts as the text a model reads: text and refusals as they
    are, JSON as JSON; an image only as a mention (the LLM profiles here read text)."""
    out = []
    for part in parts or ():
        kind = part.get("type")
        if kind in ("input_text", "output_text"):
            out.append(part.get("text", ""))
        elif kind == "refusal":
            out.append(part.get("refusal", ""))
        elif kind == "input_json":
            out.append(json.dumps(part.get("data"), ensure_ascii=False))
        elif kind == "input_image":
            out.append("[an image, not shown]")
    return " ".join(p for p in out if p)


def messages(questions: list[Question], conversation: list[str], inputs: list[str]) -> list[ChatMessage]:
    """The request: the rules, then the conversation (and the client's decision inputs) and the questions."""
    parts = ["Conversation:", *(conversation or ["(nothing said yet)"])]
    if inputs:
        parts += ["", "Other inputs:", *inputs]
    parts += ["", "Questions:", *(q.describe(i) for i, q in enumerate(questions))]
    return [ChatMessage("system", SYSTEM), ChatMessage("user", "\n".join(parts))]


def response_format(questions: list[Question]) -> dict:
    """A JSON schema for the answers object (the endpoint's structured output)."""
    answer = {"type": "object", "additionalProperties": False, "required": ["index", "answer", "confidence"],
              "properties": {"index": {"type": "integer"}, "confidence": {"type": "number"},
                             "answer": {"type": ["string", "boolean"]}}}
    schema = {"type": "object", "additionalProperties": False, "required": ["answers"],
              "properties": {"answers": {"type": "array", "items": answer}}}
    return {"type": "json_schema", "json_schema": {"name": "decision", "schema": schema, "strict": True}}


async def decide(llm: LLMClient, model: str, questions: list[Question], conversation: list[str],
                 inputs: list[str]) -> dict:
    """The Decision API's `decision` for these questions: answers in question order, the model, a usage that
    counts what was sent and received in estimated tokens. LLMError when the model cannot be asked."""
    request = messages(questions, conversation, inputs)
    options = {"response_format": response_format(questions)} if getattr(llm, "structured_output", False) else {}
    text = "".join([piece async for piece in llm.stream_chat(request, **options) if isinstance(piece, str)])
    given = _parse(text)
    answers = [answer_of(question, given.get(index)) for index, question in enumerate(questions)]
    sent = sum(len(m.content) for m in request) // 4
    received = len(text) // 4
    return {"answers": answers, "model": model, "usage": {
        "input_tokens": sent, "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": 0},
        "output_tokens": received, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": sent + received}}


def _parse(text: str) -> dict[int, dict]:
    """The model's answers by question index; {} for text that holds no JSON object of answers."""
    start, end = text.find("{"), text.rfind("}")
    try:
        data = json.loads(text[start:end + 1]) if start >= 0 else {}
    except json.JSONDecodeError:
        logger.info("a decision's answer is not JSON: %.120s", text)
        return {}
    answers = data.get("answers") if isinstance(data, dict) else None
    if not isinstance(answers, list):
        return {}
    return {a["index"]: a for a in answers
            if isinstance(a, dict) and isinstance(a.get("index"), int) and not isinstance(a["index"], bool)}


def answer_of(question: Question, given: dict | None) -> dict:
    """One question's answer resource, or a refusal when the model gave no valid answer for it."""
    refusal = {"type": "refusal", "name": question.name}
    if given is None:
        return refusal
    answer, confidence = given.get("answer"), _unit(given.get("confidence"))
    if question.kind == "predicate":
        if not isinstance(answer, bool):
            return refusal
        return {"type": "predicate", "name": question.name,
                "probability": round(confidence if answer else 1 - confidence, 4)}
    if not any(o == answer and type(o) is type(answer) for o in question.options):  # typed: "true" is not True
        return refusal
    shares = _shares(question.options, answer, confidence)
    if question.kind == "choice":
        return {"type": "choice", "name": question.name, "choice": answer, "confidence": round(confidence, 4),
                "probabilities": [{"value": o, "probability": p} for o, p in shares]}
    values = {label: index + 1 for index, label in enumerate(question.options)}  # levels scored 1..n, in order
    return {"type": "score", "name": question.name, "score": float(values[answer]), "confidence": round(confidence, 4),
            "probabilities": [{"label": o, "probability": p, "value": values[o]} for o, p in shares]}


def _unit(value: object) -> float:
    try:
        return min(1.0, max(0.0, float(value)))
    except (TypeError, ValueError):
        return 0.5


def _shares(options: tuple, answer: object, confidence: float) -> list[tuple[object, float]]:
    """The answer's probability is the confidence; the others share the rest evenly."""
    rest = (1 - confidence) / (len(options) - 1) if len(options) > 1 else 0.0
    return [(o, round(confidence if o == answer and type(o) is type(answer) else rest, 4)) for o in options]


__all__ = ["LLMError", "Question", "answer_of", "decide", "messages", "response_format"]
