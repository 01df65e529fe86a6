"""`search_knowledge`: the knowledge base offered as a tool, for models that call tools (the same
index whose passages each attempt already gets in its system message)."""

from __future__ import annotations

import asyncio
from typing import Any

from kame.tools.base import ToolLimits, ToolSpec

NAME = "search_knowledge"
LIMITS = ToolLimits(timeout_s=2.0, max_result_chars=4000)


class KnowledgeTool:
    def __init__(self, knowledge: Any, limit: int = 4, limits: ToolLimits = LIMITS) -> None:
        self.knowledge, self.limit, self.limits = knowledge, limit, limits
        self.spec = ToolSpec(NAME, "Search the local knowledge base (the operator's documents) for passages "
                             "about a topic. Returns the best passages with their sources.",
                             {"type": "object", "required": ["query"], "properties": {
                                 "query": {"type": "string", "description": "what to look for, in a few words"}}})

    async def call(self, arguments: dict) -> str:
        query = str(arguments.get("query", "")).strip()
        passages = await asyncio.to_thread(self.knowledge.search, query, self.limit)
        if not passages:
            return f"no passage of the knowledge base matches {query!r}"
        return "\n\n".join(f"[{p.source}] {p.title}\n{p.text}" for p in passages)
