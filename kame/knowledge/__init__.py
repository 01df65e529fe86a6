"""The local knowledge base: documents in a directory, searched with SQLite FTS5 (BM25) for the
backend LLM (retrieved passages in its system message, and the `search_knowledge` tool)."""

from kame.errors import KnowledgeError
from kame.knowledge.index import IndexStats, KnowledgeBase
from kame.knowledge.retrieval import Passage, Retrieval

__all__ = ["IndexStats", "KnowledgeBase", "KnowledgeError", "Passage", "Retrieval"]
