"""The server's tools, built once at start-up from `[tools.NAME]` (none configured: no tools, and
the LLM is offered none). MCP servers are connected and their tools listed here."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from kame.tools.base import TOOL_NAME, Tool, ToolError, ToolSpec
from kame.tools.config import HttpToolConfig, McpToolConfig, PythonToolConfig, ToolConfig
from kame.tools.http_tool import HttpTool
from kame.tools.mcp_tool import McpServer
from kame.tools.python_tool import PythonTool

logger = logging.getLogger(__name__)



class ToolRegistry:
    def __init__(self, tools: Iterable[Tool] = (), servers: Iterable[McpServer] = ()) -> None:
        self.tools: dict[str, Tool] = {}
        self._servers = list(servers)
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        name = tool.spec.name
        if not TOOL_NAME.fullmatch(name):
            raise ToolError(f"tool name {name!r}: only letters, digits, _ and -, at most 64")
        if name in self.tools:
            raise ToolError(f"two tools are named {name!r} (an MCP server's prefix = true keeps names apart)")
        self.tools[name] = tool

    @classmethod
    def from_config(cls, configs: Mapping[str, ToolConfig]) -> ToolRegistry:
        """Build every configured tool (blocking: MCP servers are started and listed)."""
        registry = cls()
        try:
            for name, config in configs.items():
                if isinstance(config, PythonToolConfig):
                    registry.add(PythonTool(name, config.callable, config.description or None, config.parameters,
                                            config.limits))
                elif isinstance(config, HttpToolConfig):
                    registry.add(HttpTool(name, config.url, config.allowed_hosts, config.method, config.headers,
                                          config.description, config.parameters, config.limits))
                elif isinstance(config, McpToolConfig):
                    server = McpServer(name, config.command, config.args, config.env, config.url, config.prefix,
                                       config.limits, config.connect_timeout_s)
                    registry._servers.append(server)
                    for tool in server.start():
                        registry.add(tool)
        except BaseException:
            registry.close()
            raise
        if registry.tools:
            logger.info("tools: %s", ", ".join(registry.tools))
        return registry

    @property
    def specs(self) -> list[ToolSpec]:
        return [tool.spec for tool in self.tools.values()]

    def get(self, name: str) -> Tool | None:
        return self.tools.get(name)

    def __len__(self) -> int:
        return len(self.tools)

    def close(self) -> None:
        for server in self._servers:
            server.close()
        self._servers.clear()
