"""The knowledge base: a directory of documents indexed in SQLite FTS5, searched with BM25."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kame.errors import KnowledgeError
from kame.knowledge.documents import MAX_FILE_BYTES, SUFFIXES, DocumentError, read_document, split_passages
from kame.knowledge.query import build_query, query_terms, vocabulary
from kame.knowledge.retrieval import Passage, Retrieval, estimate_tokens, pack

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE documents (
    id INTEGER PRIMARY KEY, source TEXT NOT NULL UNIQUE, title TEXT NOT NULL,
    size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, sha256 TEXT NOT NULL, error TEXT
);
CREATE TABLE passage_map (id INTEGER PRIMARY KEY, doc_id INTEGER NOT NULL, ordinal INTEGER NOT NULL);
CREATE INDEX passage_map_doc ON passage_map (doc_id);
CREATE VIRTUAL TABLE passage_fts USING fts5 (text, title, tokenize = 'porter unicode61 remove_diacritics 2');
CREATE TABLE words (term TEXT PRIMARY KEY, documents INTEGER NOT NULL) WITHOUT ROWID;
"""
MAX_COMPLETIONS = 8  # of a cut-off last word: the most widespread words it can be the start of
_SEARCH = """
SELECT d.source, d.title, f.text, -bm25(passage_fts, 1.0, 0.5), m.ordinal
FROM passage_fts AS f JOIN passage_map AS m ON m.id = f.rowid JOIN documents AS d ON d.id = m.doc_id
WHERE passage_fts MATCH ? ORDER BY bm25(passage_fts, 1.0, 0.5) LIMIT ?
"""


@dataclass(frozen=True)
class IndexStats:
    documents: int  # documents in the index after this refresh
    passages: int  # passages in the index after this refresh
    added: int  # new files indexed by this refresh
    updated: int  # files whose content changed, re-indexed
    removed: int  # files gone from the directory, dropped from the index
    failed: list[str]  # "source: reason" for each file this refresh tried and could not index
    elapsed_s: float


_Outcome = Literal["added", "updated", "same", "failed"]


@dataclass(frozen=True)
class _Stat:
    st_size: int
    st_mtime_ns: int


_RETRY = _Stat(st_size=-1, st_mtime_ns=-1)  # stored for a file that could not be read: never matches


@dataclass(frozen=True)
class _Known:
    id: int
    size: int
    mtime_ns: int
    sha256: str
    error: str | None


class KnowledgeBase:
    """Documents (.txt, .md, .html, .pdf) under `root`, split into passages, in an FTS5 index.

    `index_path` None keeps the index in memory (rebuilt by the first `refresh`); a file keeps it
    between runs, and the next `refresh` re-reads only what changed. `search`/`retrieve` may run
    on one thread while `refresh` runs on another: one connection, used under a lock that a
    refresh holds only while it writes one document (parsing happens outside it)."""

    def __init__(
        self, root: Path, *, index_path: Path | None = None, passage_words: int = 120, overlap_words: int = 20
    ) -> None:
        if passage_words < 1 or not 0 <= overlap_words < passage_words:
            raise KnowledgeError(
                f"knowledge passages need passage_words >= 1 and 0 <= overlap_words < passage_words "
                f"(got {passage_words} and {overlap_words})"
            )
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise KnowledgeError(f"the knowledge directory {self.root} does not exist or is not a directory")
        self.index_path = Path(index_path).expanduser().resolve() if index_path is not None else None
        self.passage_words = passage_words
        self.overlap_words = overlap_words
        self._lock = threading.Lock()  # the connection's
        self._refresh_lock = threading.Lock()  # one refresh at a time
        self._closed = False
        self._conn = self._open()

    # ------------------------------------------------------------------ searching

    def search(self, query: str, limit: int = 4) -> list[Passage]:
        """The best `limit` passages for a (partial, spoken) query; [] when nothing matches."""
        return self._find(query, limit)[1]

    def retrieve(self, query: str, *, limit: int = 4, budget_tokens: int = 400) -> Retrieval:
        """The best passages for `query` packed into a system-message block of `budget_tokens`."""
        started = time.perf_counter()
        expression, found = self._find(query, limit)
        passages, text = pack(found, budget_tokens)
        tokens = estimate_tokens(text) if text else 0
        return Retrieval(expression, passages, text, time.perf_counter() - started, tokens)

    def _find(self, transcript: str, limit: int) -> tuple[str, list[Passage]]:
        """The FTS query run for `transcript` and the passages it found, best first."""
        self._check_open()
        terms, cut_off = query_terms(transcript)
        if not terms:
            return "", []
        with self._lock:
            self._check_open()
            completions = self._completions(cut_off) if cut_off else []
            expression = build_query(terms, cut_off, completions)
            if limit <= 0:
                return expression, []
            try:
                rows = self._conn.execute(_SEARCH, (expression, limit)).fetchall()
            except sqlite3.OperationalError as exc:  # quoting makes this unexpected: never fail the caller on it
                logger.warning("knowledge query %r failed: %s", expression, exc)
                return expression, []
        return expression, [Passage(source=s, title=t, text=x, score=float(b), ordinal=o) for s, t, x, b, o in rows]

    def _completions(self, prefix: str) -> list[str]:
        rows = self._conn.execute(
            "SELECT term FROM words WHERE term > ? AND term < ? ORDER BY documents DESC, term LIMIT ?",
            (prefix, prefix + "\U0010ffff", MAX_COMPLETIONS),
        ).fetchall()
        return [row[0] for row in rows]

    # ------------------------------------------------------------------ indexing

    def refresh(self) -> IndexStats:
        """Bring the index up to the directory: index new files, re-index changed ones, drop
        removed ones. A file whose size and mtime are unchanged is not read; one whose bytes
        hash the same is not parsed. A file that cannot be read or parsed is listed in
        `failed` (the first time it is tried) and the rest goes on."""
        started = time.perf_counter()
        with self._refresh_lock:
            self._check_open()
            files = self._scan()
            known = self._known()
            removed = [known[source].id for source in known.keys() - files.keys()]
            if removed:
                self._write(lambda conn: [_delete_document(conn, doc_id) for doc_id in removed])
            added = updated = 0
            failed: list[str] = []
            for source, stat in sorted(files.items()):
                old = known.get(source)
                if old is not None and (old.size, old.mtime_ns) == (stat.st_size, stat.st_mtime_ns):
                    continue
                outcome, error = self._index_file(source, stat, old)
                added += outcome == "added"
                updated += outcome == "updated"
                if error is not None and (old is None or old.error != error):
                    failed.append(f"{source}: {error}")
            documents, passages = self._totals()
        for line in failed:
            logger.warning("knowledge base: cannot index %s", line)
        return IndexStats(documents, passages, added, updated, len(removed), failed, time.perf_counter() - started)

    def _index_file(
        self, source: str, stat: os.stat_result | _Stat, old: _Known | None
    ) -> tuple[_Outcome, str | None]:
        """Index one new or changed file; the outcome, and why it failed if it did."""
        path = self.root / source
        digest, error, title, passages = "", None, path.stem, []
        try:
            if stat.st_size > MAX_FILE_BYTES:
                raise DocumentError(f"too large ({stat.st_size} bytes; the limit is {MAX_FILE_BYTES})")
            try:
                data = path.read_bytes()
            except OSError as exc:
                stat = _RETRY  # a permission or I/O problem can go away without the file changing
                raise DocumentError(f"unreadable ({exc.strerror or exc})") from exc
            digest = hashlib.sha256(data).hexdigest()
            if old is not None and old.sha256 == digest:
                self._write(lambda conn: _touch(conn, old.id, stat))
                return "same", old.error
            document = read_document(path, data)
            title = document.title
            passages = split_passages(document.text, self.passage_words, self.overlap_words)
        except DocumentError as exc:
            error = str(exc)
        self._write(lambda conn: _store(conn, source, title, stat, digest, error, passages, old))
        if error is not None:
            return "failed", error
        return ("added" if old is None or old.error is not None else "updated"), None

    def _scan(self) -> dict[str, os.stat_result]:
        """Every supported, non-hidden file under the root, by its path relative to the root."""
        if not self.root.is_dir():
            raise KnowledgeError(f"the knowledge directory {self.root} is gone")
        files: dict[str, os.stat_result] = {}
        for folder, subfolders, names in os.walk(self.root):
            subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
            for name in names:
                path = Path(folder, name)
                if name.startswith(".") or path.suffix.lower() not in SUFFIXES or path == self.index_path:
                    continue
                try:
                    stat = path.stat()
                except OSError:  # removed while we walked: the next refresh sees it gone
                    continue
                files[path.relative_to(self.root).as_posix()] = stat
        return files

    # ------------------------------------------------------------------ the database

    def _open(self) -> sqlite3.Connection:
        target = ":memory:"
        if self.index_path is not None:
            try:
                self.index_path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                folder = self.index_path.parent
                raise KnowledgeError(f"cannot create the knowledge index's folder {folder}: {exc}") from exc
            target = str(self.index_path)
        try:
            conn = sqlite3.connect(target, check_same_thread=False)
            if self.index_path is not None:
                # the index is a cache of the files: WAL without a sync per commit (one per document)
                # cannot corrupt it, and indexing is ~10x faster than with the default journal
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = NORMAL")
            self._prepare(conn)
        except sqlite3.Error as exc:
            message = f"{target} cannot be used as a knowledge index ({exc}): delete it or pick another"
            raise KnowledgeError(message) from exc
        return conn

    def _prepare(self, conn: sqlite3.Connection) -> None:
        """Create the schema, or keep an existing index made with the same settings; an index of
        another schema version, root or passage size is emptied (it is a cache of the files)."""
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        wanted = {"schema": str(SCHEMA_VERSION), "root": str(self.root),
                  "passage_words": str(self.passage_words), "overlap_words": str(self.overlap_words)}
        if tables and "meta" not in tables:
            raise sqlite3.DatabaseError("it holds other tables")
        if "meta" in tables and dict(conn.execute("SELECT key, value FROM meta").fetchall()) == wanted:
            return
        for table in ("meta", "documents", "passage_map", "passage_fts", "words"):
            conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.executescript(_SCHEMA)
        with conn:
            conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", wanted.items())

    def _known(self) -> dict[str, _Known]:
        with self._lock:
            self._check_open()
            rows = self._conn.execute("SELECT source, id, size, mtime_ns, sha256, error FROM documents").fetchall()
        return {source: _Known(*rest) for source, *rest in rows}

    def _totals(self) -> tuple[int, int]:
        with self._lock:
            self._check_open()
            documents = self._conn.execute("SELECT count(*) FROM documents WHERE error IS NULL").fetchone()[0]
            passages = self._conn.execute("SELECT count(*) FROM passage_map").fetchone()[0]
        return documents, passages

    def _write(self, change: Callable[[sqlite3.Connection], object]) -> None:
        """One transaction, under the lock: searches see each document before or after, never half."""
        with self._lock:
            self._check_open()
            with self._conn:
                change(self._conn)

    def _check_open(self) -> None:
        if self._closed:
            raise KnowledgeError("the knowledge base is closed")

    # ------------------------------------------------------------------ life cycle

    async def watch(self, interval_s: float = 5.0, on_refresh: Callable[[IndexStats], None] | None = None) -> None:
        """Refresh now and every `interval_s` seconds (on a worker thread) until cancelled or
        closed. `on_refresh` gets the stats of each refresh that changed something or met a
        file it could not index. A failing refresh (the directory gone) is logged and retried."""
        last_error = ""
        while not self._closed:
            try:
                stats = await asyncio.to_thread(self.refresh)
            except (KnowledgeError, OSError, sqlite3.Error) as exc:
                if self._closed:
                    return
                if str(exc) != last_error:
                    logger.warning("knowledge base refresh failed: %s", exc)
                last_error = str(exc)
            else:
                last_error = ""
                if on_refresh is not None and (stats.added or stats.updated or stats.removed or stats.failed):
                    on_refresh(stats)
            await asyncio.sleep(interval_s)

    def close(self) -> None:
        """Close the index; a refresh running on another thread stops at its next write, and
        every later call raises KnowledgeError."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    def __enter__(self) -> KnowledgeBase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _delete_document(conn: sqlite3.Connection, doc_id: int) -> None:
    texts = conn.execute(
        "SELECT text FROM passage_fts WHERE rowid IN (SELECT id FROM passage_map WHERE doc_id = ?)", (doc_id,)
    ).fetchall()
    titles = conn.execute("SELECT title FROM documents WHERE id = ?", (doc_id,)).fetchall()
    _count_words(conn, [text for (text,) in texts + titles], -1)
    conn.execute("DELETE FROM passage_fts WHERE rowid IN (SELECT id FROM passage_map WHERE doc_id = ?)", (doc_id,))
    conn.execute("DELETE FROM passage_map WHERE doc_id = ?", (doc_id,))
    conn.execute("DELETE FROM documents WHERE id = ?", (doc_id,))


def _touch(conn: sqlite3.Connection, doc_id: int, stat: os.stat_result | _Stat) -> None:
    conn.execute("UPDATE documents SET size = ?, mtime_ns = ? WHERE id = ?", (stat.st_size, stat.st_mtime_ns, doc_id))


def _store(
    conn: sqlite3.Connection, source: str, title: str, stat: os.stat_result | _Stat, digest: str,
    error: str | None, passages: list[str], old: _Known | None,
) -> None:
    """Replace a document's row and passages (a failed file keeps a row, with its error, and none)."""
    if old is not None:
        _delete_document(conn, old.id)
    cursor = conn.execute(
        "INSERT INTO documents (source, title, size, mtime_ns, sha256, error) VALUES (?, ?, ?, ?, ?, ?)",
        (source, title, stat.st_size, stat.st_mtime_ns, digest, error),
    )
    doc_id = cursor.lastrowid
    for ordinal, text in enumerate(passages):
        passage_id = conn.execute(
            "INSERT INTO passage_map (doc_id, ordinal) VALUES (?, ?)", (doc_id, ordinal)
        ).lastrowid
        conn.execute("INSERT INTO passage_fts (rowid, text, title) VALUES (?, ?, ?)", (passage_id, text, title))
    _count_words(conn, [*passages, title], +1)


def _count_words(conn: sqlite3.Connection, passages: list[str], change: int) -> None:
    """Keep `words` (each word's count of documents, for completing a cut-off word) up to date."""
    words = set().union(*(vocabulary(text) for text in passages)) if passages else set()
    conn.executemany(
        "INSERT INTO words (term, documents) VALUES (?, ?) ON CONFLICT (term) DO UPDATE SET documents = documents + ?",
        [(word, change, change) for word in words],
    )
    if change < 0:
        conn.execute("DELETE FROM words WHERE documents <= 0")
