"""An MCP server (kame/testing/mcp_server.py, a real subprocess over stdio) is listed at start-up
and its tools are called by name, through the registry the server builds from its config."""

from __future__ import annotations

import asyncio
import sys

import pytest

from kame.tools import ToolCall, ToolError, run_tool
from kame.tools.config import McpToolConfig
from kame.tools.registry import ToolRegistry


@pytest.fixture(scope="module")
def tides():
    registry = ToolRegistry.from_config({"tides": McpToolConfig(
        kind="mcp", command=sys.executable, args=["-m", "kame.testing.mcp_server"], timeout_s=10)})
    yield registry
    registry.close()


def test_mcp_tools_are_listed_with_their_schema_and_prefixed(tides):
    assert sorted(tides.tools) == ["tides_broken", "tides_tide"]
    spec = tides.get("tides_tide").spec
    assert spec.description == "The high tide at Kelp Harbour on a day of the week."
    assert spec.parameters["required"] == ["day"] and spec.parameters["properties"]["day"]["type"] == "string"


def test_mcp_tool_is_called_by_name_and_its_failure_is_a_result(tides):
    async def scenario():
        good = await run_tool(tides.get("tides_tide"), ToolCall("1", "tides_tide", '{"day": "Tuesday"}'))
        bad = await run_tool(tides.get("tides_broken"), ToolCall("2", "tides_broken", "{}"))
        return good, bad

    good, bad = asyncio.run(scenario())  # another event loop than the connection's: it lives on its own thread
    assert good.ok and good.content == "high tide at eight twenty in the morning"
    assert not bad.ok and bad.content.startswith("error: ") and "broken" in bad.content


def test_unprefixed_names_and_a_server_that_cannot_start():
    registry = ToolRegistry.from_config({"t": McpToolConfig(
        kind="mcp", command=sys.executable, args=["-m", "kame.testing.mcp_server"], prefix=False)})
    try:
        assert sorted(registry.tools) == ["broken", "tide"]
    finally:
        registry.close()
    with pytest.raises(ToolError, match="mcp server gone: cannot start"):
        ToolRegistry.from_config({"gone": McpToolConfig(kind="mcp", command="/nonexistent/kame-mcp")})
    with pytest.raises(ToolError, match="either command"):
        ToolRegistry.from_config({"none": McpToolConfig(kind="mcp")})


def test_the_readme_example_config_builds_its_knowledge_and_tools(monkeypatch):
    from pathlib import Path

    from kame.runtime import open_knowledge
    from server.settings import load_settings

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root / "examples" / "knowledge_tools"))
    settings = load_settings(root / "examples" / "knowledge_tools" / "config.toml")
    tools = dict(settings.tools)
    tools["tides"] = tools["tides"].model_copy(update={"command": sys.executable})  # this venv's python
    registry = ToolRegistry.from_config(tools)
    knowledge = open_knowledge(settings.knowledge_options())
    try:
        assert sorted(registry.tools) == ["order_status", "tides_broken", "tides_tide"]
        call = ToolCall("1", "order_status", '{"order_id": "a17"}')
        result = asyncio.run(run_tool(registry.get("order_status"), call))
        assert result.content == "shipped on Monday, arriving Thursday"
        retrieval = knowledge.retrieve("when does the shop open on sunday")
        assert retrieval.passages[0].source == "opening-hours.md" and "ten" in retrieval.text
    finally:
        registry.close()
        knowledge.close()


def test_an_mcp_server_over_streamable_http(tmp_path):
    import subprocess
    import time

    from .server_harness import free_port

    port = free_port()
    log = (tmp_path / "mcp.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "kame.testing.mcp_server", "--http", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    registry = None
    try:
        deadline = time.monotonic() + 30
        while registry is None:
            try:
                registry = ToolRegistry.from_config({"tides": McpToolConfig(
                    kind="mcp", url=f"http://127.0.0.1:{port}/mcp", connect_timeout_s=5)})
            except ToolError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.3)  # not listening yet
        assert sorted(registry.tools) == ["tides_broken", "tides_tide"]
        result = asyncio.run(run_tool(registry.get("tides_tide"), ToolCall("1", "tides_tide", '{"day": "monday"}')))
        assert result.ok and result.content == "high tide at seven forty in the morning"
    finally:
        if registry is not None:
            registry.close()
        server.terminate()
        server.wait(10)
        log.close()
