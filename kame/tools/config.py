"""The `[tools.NAME]` tables of the config: one per tool (python, http) or MCP server (mcp)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kame.tools.base import ToolLimits


class _ToolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    description: str = ""  # what the LLM is told the tool does ("": derived, or the URL)
    timeout_s: float = Field(5.0, gt=0, le=120)  # a call running longer is answered with an error
    max_result_chars: int = Field(4000, ge=100, le=200_000)  # longer results are cut, with a marker

    @property
    def limits(self) -> ToolLimits:
        return ToolLimits(self.timeout_s, self.max_result_chars)


class PythonToolConfig(_ToolConfig):
    kind: Literal["python"]
    callable: str  # "package.module:function", sync or async
    parameters: dict | None = None  # JSON schema of the arguments; None: from the type hints and docstring


class HttpToolConfig(_ToolConfig):
    kind: Literal["http"]
    url: str  # a template: "{name}" is filled with the URL-quoted argument
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "GET"
    allowed_hosts: list[str]  # the only hosts this tool may reach (checked on the filled URL)
    headers: dict[str, str] = Field(default_factory=dict)  # header -> the NAME of the env var holding its value
    parameters: dict | None = None  # JSON schema; None: every template field, a required string


class McpToolConfig(_ToolConfig):
    kind: Literal["mcp"]
    command: str | None = None  # stdio: the server's executable ...
    args: list[str] = Field(default_factory=list)  # ... and its arguments
    env: dict[str, str] | None = None  # extra environment of the subprocess
    url: str | None = None  # or streamable HTTP: the server's URL
    prefix: bool = True  # its tools are called "<NAME>_<tool>"; false: by their own names
    connect_timeout_s: float = Field(20.0, gt=0, le=300)  # start-up: connected and tools listed within


ToolConfig = Annotated[PythonToolConfig | HttpToolConfig | McpToolConfig, Field(discriminator="kind")]
