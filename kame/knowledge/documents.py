"""Files of the knowledge base -> title and plain text -> passages (text, Markdown, HTML, PDF)."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

SUFFIXES = frozenset({".txt", ".md", ".markdown", ".html", ".htm", ".pdf"})
MAX_FILE_BYTES = 64 * 1024 * 1024  # larger files are reported, not read: a knowledge base holds notes, not dumps

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_BLOCK_TAGS_TEXT = """p div br li ul ol dl dt dd h1 h2 h3 h4 h5 h6 tr table section article header footer aside nav
blockquote pre hr figure figcaption main form fieldset address details summary"""
_BLOCK_TAGS = frozenset(_BLOCK_TAGS_TEXT.split())
_SPACED_TAGS = frozenset({"td", "th"})  # cells of a row: words apart, one paragraph
_SKIPPED_TAGS = frozenset({"script", "style", "noscript", "template", "svg"})
_MD_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_MD_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_MD_MARKUP = re.compile(r"(\*\*|__|`+|~~)")


class DocumentError(Exception):
    """A file could not be read as a document; the message says why (it goes into `IndexStats.failed`)."""


@dataclass(frozen=True)
class Document:
    title: str
    text: str  # paragraphs separated by blank lines


def read_document(path: Path, data: bytes) -> Document:
    """The title and text of one file's bytes, by the file's suffix; raises DocumentError."""
    suffix = path.suffix.lower()
    if suffix == ".pdf":
        return _read_pdf(path, data)
    text = _decode(data)
    if suffix in (".md", ".markdown"):
        return _read_markdown(path, text)
    if suffix in (".html", ".htm"):
        return _read_html(path, text)
    return Document(title=_stem_title(path), text=text)


def split_passages(text: str, passage_words: int, overlap_words: int) -> list[str]:
    """Passages of at most `passage_words` words, cut on paragraph boundaries where possible.

    Each passage after the first starts with the last `overlap_words` words of the one before
    (trimmed when the next paragraph would not fit beside them), so a fact that straddles a cut
    is whole in one of the two. A paragraph longer than a passage is cut into pieces that fit."""
    step = passage_words - overlap_words
    passages: list[str] = []
    current: list[str] = []
    fresh = 0  # words of `current` that are not overlap from the previous passage
    for paragraph in _PARAGRAPH_BREAK.split(text):
        words = paragraph.split()
        if words:
            words[-1] += "\n"  # a paragraph ends a line in the passage's text (not a word of its own)
        for start in range(0, len(words), step):
            piece = words[start : start + step] if len(words) > passage_words else words
            if fresh and len(current) + len(piece) > passage_words:
                passages.append(_join(current))
                current, fresh = current[len(current) - overlap_words :] if overlap_words else [], 0
            room = passage_words - len(piece)
            if len(current) > room:
                current = current[len(current) - room :] if room else []
            current += piece
            fresh += len(piece)
            if len(words) <= passage_words:
                break
    if fresh:
        passages.append(_join(current))
    return passages


def _join(words: list[str]) -> str:
    return " ".join(words).replace("\n ", "\n").strip()


def _decode(data: bytes) -> str:
    if b"\x00" in data[:8192]:
        raise DocumentError("binary content, not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")  # the usual legacy encoding of notes


def _stem_title(path: Path) -> str:
    return path.stem.replace("_", " ").replace("-", " ").strip() or path.name


def _read_markdown(path: Path, text: str) -> Document:
    title = ""
    lines = []
    for line in text.splitlines():
        line = _MD_MARKUP.sub("", _MD_LINK.sub(r"\1", line))
        heading = _MD_HEADING.match(line)
        if heading:
            title = title or heading.group(1)
            line = "\n" + heading.group(1) + "\n"  # a heading is a paragraph of its own
        lines.append(line)
    return Document(title=title or _stem_title(path), text="\n".join(lines))


class _TextExtractor(HTMLParser):
    """Visible text of an HTML page: scripts, styles and the head dropped, blocks as paragraphs."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title = ""
        self.first_h1 = ""
        self._skip_depth = 0
        self._in_head = False  # <head> is often left open: <body> ends it too
        self._in: str | None = None  # "title" or "h1" while inside one

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("head", "body"):
            self._in_head = tag == "head"
        elif tag in _SKIPPED_TAGS:
            self._skip_depth += 1
        elif tag in ("title", "h1") and not self._in and not self._skip_depth:
            self._in = tag
        if tag in _BLOCK_TAGS:
            self.parts.append("\n\n")
        elif tag in _SPACED_TAGS:
            self.parts.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag == "head":
            self._in_head = False
        elif tag in _SKIPPED_TAGS:
            self._skip_depth = max(0, self._skip_depth - 1)
        elif tag == self._in:
            self._in = None
        if tag in _BLOCK_TAGS:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if self._skip_depth:
            return
        if self._in == "title":
            self.title += data
        elif self._in == "h1":
            self.first_h1 += data
        if not self._in_head and self._in != "title":
            self.parts.append(data)


def _read_html(path: Path, text: str) -> Document:
    parser = _TextExtractor()
    try:
        parser.feed(text)
        parser.close()
    except AssertionError as exc:  # html.parser's way to give up on some malformed declarations
        raise DocumentError(f"unparsable HTML ({exc or 'a malformed declaration'})") from exc
    title = " ".join(parser.title.split()) or " ".join(parser.first_h1.split())
    return Document(title=title or _stem_title(path), text="".join(parser.parts))


def _read_pdf(path: Path, data: bytes) -> Document:
    from pypdf import PdfReader  # imported here: only a knowledge base with PDFs needs it

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError("encrypted PDF (a password is needed)")
        pages = [page.extract_text() or "" for page in reader.pages]
        metadata_title = (reader.metadata.title if reader.metadata else None) or ""
    except DocumentError:
        raise
    except Exception as exc:
        # pypdf parses untrusted bytes: besides its own errors, a damaged file can raise anything from
        # deep in its object parser (KeyError, struct.error, RecursionError ...). It is this file's
        # failure, reported with its reason, never the end of the refresh.
        raise DocumentError(f"unreadable PDF ({type(exc).__name__}: {exc})") from exc
    if pages and not any(page.strip() for page in pages):
        raise DocumentError("no extractable text (a scanned PDF needs OCR first)")
    return Document(title=str(metadata_title).strip() or _stem_title(path), text="\n\n".join(pages))
