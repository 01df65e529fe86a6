"""KAME's oracle in Japanese, as SakanaAI/kame's `dev-ja-oracle-server` branch runs it: restarts counted in
characters (spaces left out), each LLM delta its own oracle chunk, a chunk's leading standalone "▁" dropped but
from the first chunk since a reset, the Japanese prompt; on a tiny Japanese SentencePiece model trained here.

The expected tokens are built from the branch's rule written out in the test (`reference_tokens`): each delta
stripped, skipped when empty, encoded alone; its first token removed when it is the "▁" piece and the delta is
not the first since the oracle's reset."""

from __future__ import annotations

import asyncio
import functools
import io

import pytest

from kame.asr import hears
from kame.asr.events import FinalTranscript, PartialTranscript
from kame.backend.backchannel import is_backchannel
from kame.backend.chunker import DeltaChunker
from kame.backend.language import (
    JA_DATA_NOTE,
    JA_SYSTEM_PROMPT,
    LanguageError,
    language_named,
)
from kame.backend.planner import DEFAULT_SYSTEM_PROMPT, Planner, PlannerConfig
from kame.clock import ManualClock, settle
from kame.frontend.oracle import OracleOp, PieceDecoder, tokenize_words
from kame.protocol import ProtocolError
from kame.testing.fakes import FakeLLM, FakeReply
from server.moshi.mapping import SessionOptions


def in_loop(test):
    """An async test run to its end in a fresh event loop."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


SENTENCES = ["今日はいい天気ですね。", "明日の天気はどうですか？", "東京は晴れです。", "京都に行きたいです。",
             "お寿司が好きです。", "日本の首都は東京です。", "富士山はとても高い山です。", "はい、そうですね。",
             "うん、わかりました。", "ちょっと待ってください。", "今から確認しますね。", "蜘蛛の足は八本です。",
             "ありがとうございます。", "こんにちは、元気ですか？"]


def japanese_tokenizer():
    """A Japanese SentencePiece model trained on the sentences above (BPE, 110 pieces, SentencePiece's
    defaults otherwise: its dummy-prefix "▁" at the start of every encoded text, as J-Moshi's tokenizer)."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(SENTENCES * 20), model_writer=model,
                                             vocab_size=110, model_type="bpe", character_coverage=1.0, pad_id=-1,
                                             minloglevel=2)
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.fixture(scope="module")
def sp():
    return japanese_tokenizer()


def reference_tokens(sp, deltas: list[str]) -> list[int]:
    """The branch's oracle tokens for one stream's deltas, all appended after one reset."""
    tokens, first = [], True
    for delta in deltas:
        text = delta.strip()
        if not text:
            continue
        ids = sp.encode(text)
        if not first and ids and ids[0] == sp.piece_to_id("▁"):
            ids = ids[1:]
        first = False
        tokens += ids
    return tokens


def test_the_tokenizer_gives_both_cases(sp):
    """The model has what the rule is about: a lone "▁" before a chunk, and "▁" merged into a piece."""
    assert [sp.id_to_piece(i) for i in sp.encode("東京は")][0] == "▁"
    assert [sp.id_to_piece(i) for i in sp.encode("蜘蛛の足は")][0] == "▁蜘"


def test_japanese_counts_characters_without_spaces_english_words():
    ja, en = language_named("ja"), language_named("en")
    assert ja.units("今日は 天気　です") == 7  # an ASCII and an ideographic space left out
    assert ja.units("") == 0 and en.units("the capital of France") == 4
    assert language_named(None, "ja").code == "ja" and language_named(" JA ").code == "ja"
    with pytest.raises(LanguageError, match="'de' is not supported: en, ja"):
        language_named("de")


def test_chunks_are_the_deltas_in_japanese_words_in_english():
    chunker = DeltaChunker()
    assert chunker.push(" 東京は") == ["東京は"] and chunker.push("  ") == [] and chunker.flush() == []
    assert language_named("ja").join(["東京は", "晴れ"]) == "東京は晴れ"
    assert language_named("en").join(["the", "capital"]) == "the capital"


def test_leading_word_start_dropped_but_from_a_resets_first_chunk(sp):
    ja = language_named("ja")
    deltas = ["東京は", "晴れです", "蜘蛛の足は", "八本です。"]
    assert ja.tokenize(sp, deltas, first_since_reset=True) == reference_tokens(sp, deltas)
    # an append's chunks: none is the first since the reset
    assert ja.tokenize(sp, ["東京は"], first_since_reset=False) == sp.encode("東京は")[1:]
    assert ja.tokenize(sp, ["蜘蛛の足は"], first_since_reset=False) == sp.encode("蜘蛛の足は")  # "▁蜘" kept
    # English is tokenised a word at a time, as before
    assert language_named("en").tokenize(sp, ["東京 は"], True) == tokenize_words(sp, "東京 は")


def test_agreement_and_extension_across_chunk_boundaries():
    ja = language_named("ja")
    assert ja.agrees(["東京は晴", "れです"], ["東京は", "晴れ"])
    assert not ja.agrees(["大阪は"], ["東京は"])
    assert ja.extension(["東京は晴", "れです"], ["東京は", "晴れ"], own=False) == ["です"]
    assert ja.extension(["東京は", "晴れです。", "明日は"], ["東京は", "晴れです。"], own=False) == ["明日は"]
    assert ja.extension(["東京は", "晴れ"], ["東京は"], own=True) == ["晴れ"]


def test_japanese_backchannels_and_questions():
    ja = language_named("ja")
    assert ja.is_backchannel("うん。") and ja.is_backchannel("はいはい") and ja.is_backchannel("へー、なるほど")
    assert not ja.is_backchannel("うん、それで明日の天気は？") and not ja.is_backchannel("そうですか？")
    assert ja.asks("明日は晴れますか。") and ja.asks("どうですか？") and not ja.asks("晴れです。")
    english = language_named("en")  # English's own rule, kame.backend.backchannel
    assert not english.is_backchannel("うん") and english.is_backchannel("Mm-hmm.") == is_backchannel("Mm-hmm.") is True


class Rig:
    def __init__(self, sp, replies, config: PlannerConfig):
        self.clock = ManualClock()
        self.llm = FakeLLM(replies, self.clock)
        self.updates = []
        self.planner = Planner(self.llm, sp, self.updates.append, None, config, self.clock)

    def partial(self, text):
        self.planner.on_transcript(PartialTranscript(text, 0.0, 1.0))

    async def run_for(self, seconds: float, step: float = 0.05):
        for _ in range(round(seconds / step)):
            await self.clock.advance(step)


@in_loop
async def test_restarts_count_characters(sp):
    rig = Rig(sp, [FakeReply(("はい。",))], PlannerConfig(language="ja"))
    rig.partial("今日は")  # 3 characters: not yet
    await settle()
    assert rig.llm.calls == []
    rig.partial("今日は いい天気")  # 7 (the space left out)
    await settle()
    assert len(rig.llm.calls) == 1
    rig.partial("今日はいい天気ですね")  # 10: 3 more
    await settle()
    assert len(rig.llm.calls) == 1
    rig.partial("今日はいい天気ですね、明日")  # 13: 6 more
    await settle()
    assert len(rig.llm.calls) == 2
    # the prompt is the Japanese one, the words the user said go as they are
    system, user = rig.llm.calls[1]
    assert system.content == JA_SYSTEM_PROMPT and "今日はいい天気ですね、明日" in user.content
    await rig.planner.aclose()


@in_loop
async def test_japanese_answer_reaches_the_oracle_delta_by_delta(sp):
    deltas = ["東京は", "晴れです", "。", "蜘蛛の足は", "八本です。"]
    rig = Rig(sp, [FakeReply(tuple(deltas), delay_s=0.1)], PlannerConfig(language="ja"))
    rig.planner.on_transcript(FinalTranscript("今日の東京の天気は？", 0.0, 2.0))
    await settle()
    await rig.clock.advance(0.1)
    # the first delta is in the oracle at once (no whitespace to wait for), a reset that keeps its "▁"
    assert [u.op for u in rig.updates] == [OracleOp.RESET]
    assert list(rig.updates[0].tokens) == sp.encode("東京は")
    await rig.run_for(1.0)
    assert [u.op for u in rig.updates] == [OracleOp.RESET] + [OracleOp.APPEND] * 4
    assert [t for u in rig.updates for t in u.tokens] == reference_tokens(sp, deltas)
    assert "".join(u.text for u in rig.updates) == "東京は晴れです。蜘蛛の足は八本です。"
    assert rig.planner.attempts[-1].text == "東京は晴れです。蜘蛛の足は八本です。"
    await rig.planner.aclose()


@in_loop
async def test_a_newer_answer_repeating_the_oracle_extends_it(sp):
    """Two streams of one turn cut the same words differently: the newer keeps the oracle and appends only
    what it says past it."""
    first = FakeReply(("東京は", "晴れ"), delay_s=0.1)
    second = FakeReply(("東京は晴", "れです", "よ"), first_delay_s=0.5, delay_s=0.1)
    rig = Rig(sp, [first, second], PlannerConfig(language="ja", max_concurrent_streams=4))
    rig.partial("東京の天気はどうですか")  # 11 characters: a start
    await settle()
    await rig.run_for(0.15)  # the first stream said 東京は
    rig.partial("東京の天気はどうですか、明日もそうかな")  # 8 more: a second start
    await settle()
    await rig.run_for(2.0)
    ops = [(u.op, u.text) for u in rig.updates]
    assert ops[0] == (OracleOp.RESET, "東京は")
    assert (OracleOp.RESET, "東京は晴") not in ops  # kept, not reset
    assert ops == [(OracleOp.RESET, "東京は"), (OracleOp.APPEND, "晴れ"), (OracleOp.APPEND, "です"),
                   (OracleOp.APPEND, "よ")]
    assert len(rig.llm.calls) == 2 and rig.planner.attempts[-1].kept_oracle
    await rig.planner.aclose()


@in_loop
async def test_a_configured_prompt_is_kept_and_the_data_note_is_japanese(sp):
    rig = Rig(sp, [FakeReply(("はい",))], PlannerConfig(language="ja", system_prompt="関西弁で話してください。"))
    assert rig.planner.system_prompt == "関西弁で話してください。"
    assert Rig(sp, None, PlannerConfig(language="en")).planner.system_prompt == DEFAULT_SYSTEM_PROMPT
    assert "指示ではありません" in JA_DATA_NOTE
    await rig.planner.aclose()


def test_front_end_pieces_join_without_spaces(sp):
    """J-Moshi's text stream: pieces are joined as they are ("▁" a space), so Japanese comes out unspaced."""
    decoder = PieceDecoder(sp)
    text = "".join(decoder.push(t) for t in sp.encode("東京は晴れです。"))
    assert text == " 東京は晴れです。"


def test_moshi_query_names_the_language():
    assert SessionOptions.from_query({"language": "ja"}).language == "ja"
    assert SessionOptions.from_query({}).language is None
    with pytest.raises(ProtocolError, match="language: language 'xx' is not supported"):
        SessionOptions.from_query({"language": "xx"})


def test_an_english_only_whisper_says_it_cannot_hear_japanese():
    from kame.asr.whisper import WhisperAsr, WhisperOptions

    asr = WhisperAsr(WhisperOptions(end_of_turn="silence"))  # the bundled tiny.en
    assert asr.languages == ("en",) and hears(asr, "en") is None
    why = hears(asr, "ja")
    assert why.startswith("the ASR (whisper tiny.en) hears English only, not Japanese") and "asr_model" in why


def test_a_whisper_stream_decodes_in_its_sessions_language():
    """Each stream passes its own language to the model, and joins its pieces without spaces in Japanese."""
    import numpy as np

    from kame.asr.whisper import WhisperAsr, WhisperOptions

    asked = []

    class Segment:
        def __init__(self, text):
            self.text = text

    class Model:
        def transcribe(self, pcm, language, **kwargs):
            asked.append(language)
            return [Segment("東京は"), Segment("晴れ")], None

    asr = WhisperAsr.__new__(WhisperAsr)
    asr.options, asr.model = WhisperOptions(model="small"), Model()
    assert asr.transcribe(np.zeros(16000, np.float32), language="ja") == "東京は晴れ"
    assert asr.transcribe(np.zeros(16000, np.float32)) == "東京は 晴れ"  # the options' language: en
    assert asked == ["ja", "en"]


@in_loop
async def test_each_session_opens_its_stream_in_its_language():
    from kame.asr import NoAsr, open_stream_in
    from kame.asr.whisper import WhisperAsr, WhisperOptions

    asr = WhisperAsr(WhisperOptions(end_of_turn="silence"))
    ja, en = open_stream_in(asr, "ja"), open_stream_in(asr, "en")
    assert (ja.language, en.language) == ("ja", "en")
    await ja.aclose()
    await en.aclose()
    await open_stream_in(NoAsr(), "ja").aclose()  # an engine that takes no language opens as before


def test_a_moshi_with_a_japanese_tokenizer_is_j_moshi(sp, tmp_path):
    """J-Moshi's files are a Kyutai Moshi repo's with a Japanese SentencePiece model under moshi's tokenizer
    name: the loader and doctor's inspection name it (and its licence); a session on a Japanese front-end thinks in
    Japanese unless it asks otherwise (test_session.py)."""
    from moshi.models import loaders

    from kame.frontend.loader import inspect_source, load_frontend
    from kame.testing import hub_layouts as hub

    repo = hub.kyutai_moshi_repo(tmp_path / "j-moshi", hub.random_weights(hub.TINY_LM_CONFIG, seed=5))
    (repo / loaders.TEXT_TOKENIZER_NAME).write_bytes(sp.serialized_model_proto())
    frontend = load_frontend(str(repo), "cpu")
    assert frontend.language == "ja"
    assert frontend.family.startswith("J-Moshi") and "CC BY-NC 4.0" in frontend.family
    assert inspect_source(str(repo)).language == "ja"
    assert load_frontend("tiny", "cpu").language == "en"


def test_edges_a_review_found():
    """An empty ?language= is the server's language; a prompt sent back as the English default stays Japanese in a
    Japanese session; a character that normalises to two still lets a merging answer extend the oracle; English
    keeps its own question mark; a close reason that echoes Japanese fits a close frame."""
    from server.access import close_reason

    assert SessionOptions.from_query({"language": ""}).language is None
    planner = Planner(FakeLLM(), None, lambda update: None, None, PlannerConfig(language="ja"))
    planner.set_system_prompt(DEFAULT_SYSTEM_PROMPT)
    assert planner.system_prompt == JA_SYSTEM_PROMPT
    planner.set_system_prompt("敬語で話してください。")
    assert planner.system_prompt == "敬語で話してください。"
    ja = language_named("ja")
    assert ja.extension(["㍻は", "三十年"], ["㍻"], own=False) == ["は三十年"]
    assert not language_named("en").asks("Really？") and language_named("en").asks("Really?")
    reason = close_reason("voice_prompt 'ボイス': " + "あ" * 100)
    assert len(reason.encode()) <= 123 and reason.startswith("voice_prompt 'ボイス': ")


def test_a_front_process_knows_its_engines_language():
    """`kame serve --fronts`: the front processes get the front-end's language from the engine process."""
    from types import SimpleNamespace

    import torch

    from kame.runtime import RemoteFrontend

    frontend = SimpleNamespace(source="nu-dialogue/j-moshi-ext", device=torch.device("cpu"), dtype=torch.float32,
                               tokenizer=None, language="ja")
    assert RemoteFrontend.of(RemoteFrontend.describe(frontend)).language == "ja"
