"""`kind = "mcp"`: the tools of an MCP server (Model Context Protocol, the `mcp` package), over stdio
(`command` + `args`, a subprocess) or streamable HTTP (`url`). Its tools are listed at start-up
and called by name. Names: `<server>_<tool>` by default (`prefix = false`: the server's own names),
so two servers' tools never clash.

The connection lives on a thread of its own with its own event loop: the SDK's anyio task groups
must be entered and left on one task, while sessions call from whichever loop serves them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import logging
import threading
from typing import Any

from kame.tools.base import DEFAULT_LIMITS, ToolError, ToolLimits, ToolSpec

logger = logging.getLogger(__name__)


class McpServer:
    """One MCP server connection; `start()` connects and lists its tools (blocking)."""

    def __init__(self, name: str, command: str | None = None, args: list[str] | None = None,
                 env: dict[str, str] | None = None, url: str | None = None, prefix: bool = True,
                 limits: ToolLimits = DEFAULT_LIMITS, connect_timeout_s: float = 20.0) -> None:
        if (command is None) == (url is None):
            raise ToolError(f"mcp tool {name}: give either command (stdio) or url (streamable HTTP)")
        if importlib.util.find_spec("mcp") is None:
            raise ToolError(f"mcp tool {name} needs the MCP SDK: pip install -e '.[tools]'")
        self.name, self.command, self.args, self.env, self.url = name, command, list(args or []), env, url
        self.prefix, self.limits, self.connect_timeout_s = prefix, limits, connect_timeout_s
        self.tools: list[McpTool] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp-{name}", daemon=True)
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._held: concurrent.futures.Future | None = None

    def start(self) -> list[McpTool]:
        self._thread.start()
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._held = asyncio.run_coroutine_threadsafe(self._hold(ready), self._loop)
        try:
            listed = ready.result(self.connect_timeout_s)
        except concurrent.futures.TimeoutError as exc:
            self.close()
            raise ToolError(f"mcp server {self.name}: no tool list within {self.connect_timeout_s:g} s") from exc
        except Exception as exc:
            self.close()
            raise ToolError(f"mcp server {self.name}: cannot start ({type(exc).__name__}: {exc})") from exc
        self.tools = [McpTool(self, tool.name, self._public_name(tool.name), tool.description or "",
                              tool.input_schema or {"type": "object", "properties": {}}) for tool in listed]
        logger.info("mcp server %s: %d tools (%s)", self.name, len(self.tools),
                    ", ".join(t.spec.name for t in self.tools))
        return self.tools

    def _public_name(self, tool: str) -> str:
        return f"{self.name}_{tool}" if self.prefix else tool

    async def _hold(self, ready: concurrent.futures.Future) -> None:
        """Connect, list, then keep the connection open until `close()`."""
        from mcp import Client, StdioServerParameters

        self._stop = asyncio.Event()
        target = self.url if self.url is not None else StdioServerParameters(
            command=self.command, args=self.args, env=self.env)
        try:
            async with Client(target) as client:
                self._client = client
                listed = await client.list_tools()
                ready.set_result(listed.tools)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            logger.warning("mcp server %s: connection ended (%s)", self.name, exc)
        finally:
            self._client = None

    async def call(self, tool: str, arguments: dict) -> str:
        """Call `tool` on the server's thread; wait for it here (cancelling this cancels the call)."""
        future = asyncio.run_coroutine_threadsafe(self._call(tool, arguments), self._loop)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise

    async def _call(self, tool: str, arguments: dict) -> str:
        if self._client is None:
            raise ToolError(f"the mcp server {self.name} is not connected")
        result = await self._client.call_tool(tool, arguments)
        text = "\n".join(getattr(block, "text", None) or str(block.model_dump(exclude_none=True))
                         for block in result.content)
        if not text and result.structured_content is not None:
            text = str(result.structured_content)
        if result.is_error:
            raise ToolError(text or "the mcp tool reported an error")
        return text

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._held is not None:
            with contextlib.suppress(Exception):
                self._held.result(5)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


class McpTool:
    def __init__(self, server: McpServer, remote_name: str, name: str, description: str, schema: dict) -> None:
        self.server, self.remote_name = server, remote_name
        self.spec = ToolSpec(name, description or f"{remote_name} (mcp server {server.name})", schema)
        self.limits = server.limits

    async def call(self, arguments: dict) -> str:
        return await self.server.call(self.remote_name, arguments)
