"""A tiny MCP server, for tests and the README's example: `python -m kame.testing.mcp_server`
(stdio), or `... --http PORT` (streamable HTTP at http://127.0.0.1:PORT/mcp). Two tools: a tide
table of a made-up harbour, and one that fails."""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import MCPServer

server = MCPServer("kame-test-tides")

TIDES = {"monday": "high tide at seven forty in the morning", "tuesday": "high tide at eight twenty in the morning"}


@server.tool()
def tide(day: str) -> str:
    """The high tide at Kelp Harbour on a day of the week."""
    return TIDES.get(day.strip().lower(), f"no tide table for {day}")


@server.tool()
def broken(reason: str = "scripted") -> str:
    """Always fails (tests the error path)."""
    raise RuntimeError(f"the broken tool failed: {reason}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a tiny MCP server for tests")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on this port (else stdio)")
    port = parser.parse_args().http
    if port is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=port)
