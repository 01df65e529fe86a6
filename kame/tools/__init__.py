"""Tools the backend LLM may call while the front-end keeps talking: the server's (`[tools.NAME]`:
python callables, HTTP endpoints, MCP servers), a Realtime client's functions, and the knowledge
base's `search_knowledge`. Off unless configured."""

from kame.tools.base import Tool, ToolCall, ToolError, ToolLimits, ToolResult, ToolSpec, run_tool
from kame.tools.toolbox import ToolBox

__all__ = ["Tool", "ToolBox", "ToolCall", "ToolError", "ToolLimits", "ToolResult", "ToolSpec", "run_tool"]
