"""The local knowledge base (kame/knowledge/): real files in a temporary directory, real SQLite FTS5, real pypdf."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kame.knowledge import IndexStats, KnowledgeBase, KnowledgeError, Passage
from kame.knowledge import index as index_module
from kame.knowledge.documents import split_passages
from kame.knowledge.query import build_query, fts_query
from kame.knowledge.retrieval import HEADING, estimate_tokens


def make_pdf(lines: list[str], title: str | None = None) -> bytes:
    """A one-page PDF with `lines` in Helvetica (and a /Title in its info dictionary), built by hand."""

    def escape(text: str) -> str:
        return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")

    stream = "BT /F1 12 Tf 72 720 Td 14 TL " + " ".join(f"({escape(line)}) Tj T*" for line in lines) + " ET"
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        "/Resources << /Font << /F1 5 0 R >> >> >>",
        f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        f"<< /Title ({escape(title)}) >>" if title else "<< >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{offset:010d} 00000 n \n" for offset in offsets).encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R /Info 6 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


CORPUS = {
    "library/opening-hours.md": "# Library opening hours\n\nThe town library opens at nine in the morning and "
    "closes at six in the evening, Monday to Saturday. On Sundays it is closed.\n\nThe reading room closes "
    "half an hour before the library.",
    "library/membership.md": "# Membership\n\nA library card is free for residents. Bring a proof of address. "
    "Visitors pay ten euros a year.",
    "pool.txt": "The swimming pool is open from seven in the morning until nine at night. Lanes are reserved "
    "for clubs on Tuesday evenings.",
    "food/restaurants.html": "<html><head><title>Restaurants near the station</title></head><body>"
    "<h1>Eating out</h1><p>Luigi's serves pizza and pasta until midnight.</p>"
    "<p>The Green Leaf is a vegetarian restaurant with a garden.</p></body></html>",
    "transport.txt": "Buses to the airport leave every twenty minutes from stop B. A ticket costs three euros.",
}


def write(root: Path, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


def bump_mtime(path: Path) -> None:
    """Move the file's mtime on, as an edit a second later would (the index compares size and mtime)."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "kb"
    write(root, dict(CORPUS))
    return root


@pytest.fixture
def kb(corpus: Path):
    base = KnowledgeBase(corpus)
    base.refresh()
    yield base
    base.close()


class ParseCounter:
    """Wraps the index's document reader to count the files it parses."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sources: list[str] = []
        real = index_module.read_document

        def counting(path: Path, data: bytes):
            self.sources.append(path.name)
            return real(path, data)

        monkeypatch.setattr(index_module, "read_document", counting)


# ------------------------------------------------------------------ documents


def test_every_file_type_is_indexed_with_its_title_and_text(tmp_path: Path):
    write(
        tmp_path,
        {
            "notes.txt": "Plain notes about the boiler: reset it with the red button.",
            "guide.md": "Intro line\n\n## Wi-Fi **password**\n\n"
            "The [guest network](http://x.example) key is `tortoise42`.",
            "page.html": "<html><head><title>Office  page</title><style>.secret { color: red }</style>"
            "<script>var hidden = 'javascriptonly';</script></head><body><p>The printer is on the "
            "second floor.</p><script>trackerword()</script><table><tr><td>Room</td><td>Kitchen</td></tr>"
            "</table></body></html>",
            "manual.pdf": make_pdf(["The espresso machine needs descaling", "every month."], title="Coffee Manual"),
            "untitled.pdf": make_pdf(["Fire exits are at both ends of the corridor."]),
            "data.json": '{"ignored": "jsonfileword"}',
            ".hidden.md": "hiddenword",
            ".git/config.txt": "gitword",
        },
    )
    with KnowledgeBase(tmp_path) as kb:
        stats = kb.refresh()
        assert (stats.documents, stats.added, stats.failed) == (5, 5, [])

        def top(query: str) -> Passage:
            found = kb.search(query)
            assert found, query
            return found[0]

        assert (top("boiler").source, top("boiler").title) == ("notes.txt", "notes")
        guide = top("guest network key")
        assert guide.title == "Wi-Fi password"  # the first heading, its markup removed
        assert "tortoise42" in guide.text and "**" not in guide.text and "http" not in guide.text
        page = top("printer")
        assert page.title == "Office page" and "second floor" in page.text
        assert "color" not in page.text and "hidden" not in page.text and "Room Kitchen" in page.text
        manual = top("espresso descaling")
        assert (manual.source, manual.title) == ("manual.pdf", "Coffee Manual")
        assert "every month" in manual.text
        assert top("fire exits corridor").title == "untitled"  # no PDF title: the file's stem
        for word in ("javascriptonly", "trackerword", "jsonfileword", "hiddenword", "gitword", "secret"):
            assert kb.search(word) == [], word


def test_legacy_encodings_and_a_byte_order_mark_are_read(tmp_path: Path):
    write(tmp_path, {"legacy.txt": "Le café ferme à minuit.".encode("cp1252"),
                     "bom.md": "\ufeff# Crème brûlée\n\nServed on Fridays.".encode()})
    with KnowledgeBase(tmp_path) as kb:
        assert kb.refresh().failed == []
        assert kb.search("cafe minuit")[0].text == "Le café ferme à minuit."  # diacritics folded for matching
        assert kb.search("creme brulee")[0].title == "Crème brûlée"  # the BOM did not hide the heading


def test_passages_follow_paragraphs_stay_within_the_size_and_overlap():
    paragraphs = [" ".join(f"p{i}w{j}" for j in range(n)) for i, n in enumerate([5, 7, 30, 3])]
    passages = split_passages("\n\n".join(paragraphs), passage_words=12, overlap_words=4)
    words = [passage.split() for passage in passages]
    assert all(len(w) <= 12 for w in words)
    assert words[0] == paragraphs[0].split() + paragraphs[1].split()  # two whole paragraphs fit: one passage
    assert passages[0].split("\n") == paragraphs[:2]  # the paragraph break is kept as a line break
    for before, after in zip(words, words[1:], strict=False):
        assert after[:4] == before[-4:]  # each passage starts with the last 4 words of the one before
    every = [f"p{i}w{j}" for i, n in enumerate([5, 7, 30, 3]) for j in range(n)]
    assert sorted(set(sum(words, [])), key=every.index) == every  # nothing lost


def test_passages_without_overlap_partition_the_text():
    text = "\n\n".join(" ".join(f"w{i}_{j}" for j in range(9)) for i in range(10))
    passages = split_passages(text, passage_words=20, overlap_words=0)
    assert [len(p.split()) for p in passages] == [18] * 5  # whole paragraphs of 9 only, 2 per passage
    assert " ".join(passages).split() == text.split()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=12),
    st.integers(min_value=1, max_value=40),
    st.data(),
)
def test_passages_cover_the_text_in_order_within_the_size_with_a_bounded_overlap(sizes, passage_words, data):
    overlap_words = data.draw(st.integers(min_value=0, max_value=passage_words - 1))
    paragraphs = [" ".join(f"p{i}w{j}" for j in range(n)) for i, n in enumerate(sizes)]
    passages = [p.split() for p in split_passages("\n\n".join(paragraphs), passage_words, overlap_words)]
    seen: list[str] = []
    for number, words in enumerate(passages):
        assert 0 < len(words) <= passage_words
        carried = [w for w in words if w in seen]
        assert words[: len(carried)] == carried  # what repeats the passage before comes first ...
        if number:
            before = passages[number - 1]
            assert len(carried) <= overlap_words and before[len(before) - len(carried) :] == carried
        assert len(words) > len(carried)  # ... and every passage brings new words
        seen += words[len(carried):]
    assert seen == " ".join(paragraphs).split()  # every word once, in order


def test_a_document_becomes_numbered_passages_in_the_index(tmp_path: Path):
    body = "\n\n".join(f"Paragraph {i} talks about topic{i} " + "filler " * 30 for i in range(6))
    write(tmp_path, {"long.md": "# Long\n\n" + body})
    with KnowledgeBase(tmp_path, passage_words=50, overlap_words=10) as kb:
        stats = kb.refresh()
        assert stats.passages >= 5
        ordinals = {kb.search(f"topic{i}")[0].ordinal for i in range(6)}
        assert ordinals == set(range(len(ordinals))) and len(ordinals) >= 5


# ------------------------------------------------------------------ ranking and queries


@pytest.mark.parametrize(
    ("transcript", "source"),
    [
        ("um so when does the library op", "library/opening-hours.md"),
        ("uh what time does the swimming po", "pool.txt"),
        ("is there a vegetarian restaura", "food/restaurants.html"),
        ("how much is a ticket to the airp", "transport.txt"),
        ("do visitors have to pay for a card", "library/membership.md"),
        ("what time do they openin", "library/opening-hours.md"),
    ],
)
def test_bm25_puts_the_right_passage_first_for_a_partial_transcript(kb: KnowledgeBase, transcript: str, source: str):
    found = kb.search(transcript)
    assert found and found[0].source == source, [p.source for p in found]
    assert [p.score for p in found] == sorted((p.score for p in found), reverse=True)
    assert all(p.score > 0 for p in found)  # BM25, higher is better


def test_the_query_quotes_every_term_drops_fillers_and_prefixes_the_last_word():
    assert fts_query("um so uh what are the opening hours.") == '"opening" OR "hours"'  # ends whole
    assert fts_query("the opening hou") == '"opening" OR "hou"*'
    assert fts_query('say "NEAR(cats dogs)" OR title:fish* ^AND') == '"near" OR "cats" OR "dogs" OR "title" OR "fish"'
    assert fts_query("um uh the") == "" and fts_query("") == "" and fts_query("so the") == ""
    completions = {"restaura": ["restaurant", "restaurants"]}
    assert fts_query("a cheap restaura", completions.get) == '"cheap" OR "restaura"* OR "restaurant" OR "restaurants"'
    assert build_query(["x"], None, ["ignored"]) == '"x"'


def test_a_cut_off_word_is_completed_from_the_index(kb: KnowledgeBase):
    # Porter stores "restaur" for "restaurant": the prefix "restaura"* alone would find nothing
    assert kb.search("restaura") and kb.search("restaura")[0].source == "food/restaurants.html"
    assert kb.retrieve("restaura").query == '"restaura"* OR "restaurant" OR "restaurants"'
    assert kb.search("openin")[0].source == "library/opening-hours.md"
    assert kb.search("qwertyu") == []


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_a_safe_query(text: str):
    query = fts_query(text)
    connection = sqlite3.connect(":memory:")
    connection.execute("CREATE VIRTUAL TABLE t USING fts5 (x, tokenize = 'porter unicode61 remove_diacritics 2')")
    connection.execute("INSERT INTO t (x) VALUES ('some text')")
    if query:
        connection.execute("SELECT * FROM t WHERE t MATCH ?", (query,)).fetchall()  # never a syntax error


@pytest.mark.parametrize(
    "query",
    ["", "   ", "um uh er", "the of and", '"', '""', "'", "*", "AND OR NOT", "NEAR(", "title:", "^start", "a-b-c",
     "\x00\x01", "café", "東京 タワー", "🙂🙂", "x" * 5000, " ".join(["word"] * 500), "null)--; DROP TABLE documents"],
)
def test_odd_queries_never_raise(kb: KnowledgeBase, query: str):
    assert isinstance(kb.search(query), list)
    retrieval = kb.retrieve(query)
    assert (retrieval.text is None) == (retrieval.passages == [])
    assert kb.search("library")  # the index is still whole


def test_a_query_of_only_stop_words_finds_nothing(kb: KnowledgeBase):
    retrieval = kb.retrieve("um so uh what is it that they")
    assert (retrieval.query, retrieval.passages, retrieval.text, retrieval.tokens) == ("", [], None, 0)


# ------------------------------------------------------------------ refresh


def test_refresh_picks_up_a_change_an_addition_and_a_removal(corpus: Path, monkeypatch: pytest.MonkeyPatch):
    with KnowledgeBase(corpus) as kb:
        first = kb.refresh()
        assert (first.documents, first.added, first.updated, first.removed) == (5, 5, 0, 0)
        parsed = ParseCounter(monkeypatch)

        again = kb.refresh()
        assert (again.added, again.updated, again.removed, again.failed) == (0, 0, 0, [])
        assert parsed.sources == []  # nothing changed: nothing read or parsed

        pool = corpus / "pool.txt"
        pool.write_text("The swimming pool is closed for repairs until March.")
        bump_mtime(pool)
        write(corpus, {"museum.md": "# Museum\n\nThe museum of clocks opens on weekends."})
        (corpus / "transport.txt").unlink()
        stats = kb.refresh()
        assert (stats.documents, stats.added, stats.updated, stats.removed) == (5, 1, 1, 1)
        assert sorted(parsed.sources) == ["museum.md", "pool.txt"]
        assert "repairs" in kb.search("swimming pool")[0].text
        assert kb.search("seven lanes clubs tuesday") == []  # the old text of the pool is gone
        assert kb.search("museum clocks")[0].source == "museum.md"
        assert kb.search("airport buses") == []


def test_a_new_mtime_with_the_same_bytes_is_not_parsed_again(corpus: Path, monkeypatch: pytest.MonkeyPatch):
    with KnowledgeBase(corpus) as kb:
        kb.refresh()
        parsed = ParseCounter(monkeypatch)
        bump_mtime(corpus / "pool.txt")
        stats = kb.refresh()
        assert (stats.added, stats.updated, parsed.sources) == (0, 0, [])  # the content hash matched
        assert kb.refresh().updated == 0 and parsed.sources == []


def test_an_index_file_is_reused_across_runs_and_rebuilt_for_other_settings(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    index = tmp_path / "state" / "kb.sqlite"
    with KnowledgeBase(corpus, index_path=index) as kb:
        assert kb.refresh().added == 5
    parsed = ParseCounter(monkeypatch)
    with KnowledgeBase(corpus, index_path=index) as kb:
        stats = kb.refresh()
        assert (stats.documents, stats.added, parsed.sources) == (5, 0, [])
        assert kb.search("swimming")[0].source == "pool.txt"
    with KnowledgeBase(corpus, index_path=index, passage_words=60) as kb:
        assert kb.refresh().added == 5  # passages of another size: the index is made again
        assert len(parsed.sources) == 5


def test_a_broken_file_is_reported_and_the_rest_is_indexed(corpus: Path):
    write(
        corpus,
        {
            "broken.pdf": b"%PDF-1.4 this is not really a pdf",
            "truncated.pdf": make_pdf(["Cut short"])[:120],
            "binary.txt": b"\x00\x01\x02\x03 not text",
            "scan.pdf": make_pdf([]),
            "odd.html": "<p>Notes</p><![!x",  # html.parser gives up on this one (an AssertionError)
        },
    )
    with KnowledgeBase(corpus) as kb:
        stats = kb.refresh()
        assert stats.documents == 5
        failed = dict(line.split(": ", 1) for line in stats.failed)
        assert set(failed) == {"broken.pdf", "truncated.pdf", "binary.txt", "scan.pdf", "odd.html"}
        assert failed["binary.txt"] == "binary content, not text"
        assert "no extractable text" in failed["scan.pdf"]
        assert kb.refresh().failed == []  # reported once; not tried again until the file changes

        pool = corpus / "pool.txt"
        pool.write_bytes(b"\x00garbage")  # a good file that breaks loses its old passages
        bump_mtime(pool)
        stats = kb.refresh()
        assert stats.failed == ["pool.txt: binary content, not text"] and stats.documents == 4
        assert kb.search("swimming") == []


def test_clear_errors_for_a_missing_directory_bad_settings_a_foreign_index_and_a_closed_base(tmp_path: Path):
    with pytest.raises(KnowledgeError, match="does not exist"):
        KnowledgeBase(tmp_path / "nowhere")
    with pytest.raises(KnowledgeError, match="overlap_words"):
        KnowledgeBase(tmp_path, passage_words=20, overlap_words=20)
    not_a_database = tmp_path / "notes.sqlite"
    not_a_database.write_text("just text " * 100)
    with pytest.raises(KnowledgeError, match="cannot be used as a knowledge index"):
        KnowledgeBase(tmp_path, index_path=not_a_database)
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE customers (name TEXT)").connection.commit()
    with pytest.raises(KnowledgeError, match="other tables"):
        KnowledgeBase(tmp_path, index_path=other)
    kb = KnowledgeBase(tmp_path)
    kb.close()
    with pytest.raises(KnowledgeError, match="closed"):
        kb.search("harbour")


# ------------------------------------------------------------------ threads, budget, watch


def test_searches_during_a_refresh_on_another_thread_see_a_consistent_index(tmp_path: Path):
    write(tmp_path, {f"doc{i:03}.md": f"# Doc {i}\n\nShared words about harbours. Unique{i}." for i in range(300)})
    with KnowledgeBase(tmp_path) as kb:
        errors: list[BaseException] = []
        stats: list[IndexStats] = []

        def refresh() -> None:
            try:
                stats.append(kb.refresh())
            except BaseException as exc:  # handed to the test thread, which fails on it
                errors.append(exc)

        worker = threading.Thread(target=refresh)
        worker.start()
        seen = []
        while worker.is_alive():
            found = kb.search("shared harbours", limit=3)
            seen.append(len(found))
            assert all(p.text.startswith(p.title) for p in found)  # whole documents only
        worker.join()
        assert errors == [] and stats[0].documents == 300
        assert len(seen) > 1 and seen[-1] <= 3
        assert kb.search("unique299")[0].source == "doc299.md"


def test_retrieve_packs_the_best_passages_within_the_budget(kb: KnowledgeBase):
    everything = kb.retrieve("library closes card residents", limit=4, budget_tokens=2000)
    assert len(everything.passages) == 2 and everything.text is not None
    assert everything.text.startswith(HEADING) and "not instructions" in HEADING
    for passage in everything.passages:
        assert f"{passage.source} (\"{passage.title}\"):\n{passage.text}" in everything.text
    assert everything.tokens == estimate_tokens(everything.text) <= 2000
    assert everything.query.startswith('"library"') and everything.elapsed_s >= 0

    tight = kb.retrieve("library closes card residents", budget_tokens=everything.tokens - 5)
    assert len(tight.passages) == 1 and tight.tokens <= everything.tokens - 5
    assert tight.passages[0] == everything.passages[0]

    tiny = kb.retrieve("library opens closes", budget_tokens=estimate_tokens(HEADING) + 25)
    assert len(tiny.passages) == 1 and tiny.tokens <= estimate_tokens(HEADING) + 25
    assert tiny.passages[0].text.endswith(" ...")  # the best passage, cut to fit
    assert kb.retrieve("library", budget_tokens=10).text is None  # not even the heading fits
    assert kb.retrieve("zebras giraffes").text is None


def test_watch_picks_up_a_change(corpus: Path):
    async def scenario(kb: KnowledgeBase) -> IndexStats:
        changes: asyncio.Queue[IndexStats] = asyncio.Queue()
        watcher = asyncio.create_task(kb.watch(interval_s=0.05, on_refresh=changes.put_nowait), name="watch")
        try:
            await asyncio.sleep(0.3)
            assert changes.empty()  # polls that change nothing are not reported
            write(corpus, {"zoo.md": "# Zoo\n\nThe zoo feeds the penguins at noon."})
            return await asyncio.wait_for(changes.get(), timeout=10)
        finally:
            watcher.cancel()
            with pytest.raises(asyncio.CancelledError):
                await watcher

    with KnowledgeBase(corpus) as kb:
        kb.refresh()
        stats = asyncio.run(scenario(kb))
        assert (stats.added, stats.documents) == (1, 6)
        assert kb.search("when are the penguins fed")[0].source == "zoo.md"


def test_an_unreadable_file_is_reported_once_and_retried_until_it_reads(corpus: Path, monkeypatch: pytest.MonkeyPatch):
    real_read = Path.read_bytes
    locked = {"pool.txt"}

    def read_bytes(path: Path) -> bytes:
        if path.name in locked:
            raise PermissionError(13, "Permission denied")
        return real_read(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)  # root reads through chmod 000: fake the refusal
    with KnowledgeBase(corpus) as kb:
        assert kb.refresh().failed == ["pool.txt: unreadable (Permission denied)"]
        assert kb.refresh().failed == []  # tried again, the same reason: not reported again
        locked.clear()  # permissions fixed: the file itself (size, mtime) did not change
        stats = kb.refresh()
        assert (stats.added, stats.documents) == (1, 5)
        assert kb.search("swimming")[0].source == "pool.txt"


def test_the_benchmark_script_runs_and_prints_its_table():
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_knowledge.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--documents", "12", "--queries", "20", "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| memory | 12 |" in proc.stdout and "| file | 12 |" in proc.stdout
    rows = json.loads(proc.stdout[proc.stdout.index("["):])
    assert all(row["passages"] > 12 and row["retrievals"] == 20 and row["retrieve_p50_ms"] > 0 for row in rows)
