"""`kind = "http"`: an HTTP endpoint as a tool. The URL template's `{argument}` fields are filled
(URL-quoted); the other arguments go in the query string (GET, DELETE) or as a JSON body. Header
values come from environment variables named in the config (never written in it). Only the hosts
the config names in `allowed_hosts` are reached, checked on the filled URL."""

from __future__ import annotations

import os
import string
from urllib.parse import quote, urlsplit

import aiohttp

from kame.tools.base import DEFAULT_LIMITS, ToolError, ToolLimits, ToolSpec

_BODYLESS = {"GET", "DELETE", "HEAD"}


def template_fields(url: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(url) if name]


class HttpTool:
    def __init__(self, name: str, url: str, allowed_hosts: list[str], method: str = "GET",
                 headers_env: dict[str, str] | None = None, description: str = "",
                 parameters: dict | None = None, limits: ToolLimits = DEFAULT_LIMITS) -> None:
        self.url, self.method = url, method.upper()
        self.allowed_hosts = {host.lower() for host in allowed_hosts}
        if not self.allowed_hosts:
            raise ToolError(f"http tool {name}: allowed_hosts is empty, so no host could be reached")
        self.headers_env = dict(headers_env or {})
        fields = template_fields(url)
        schema = parameters or {"type": "object", "required": fields,
                                "properties": {field: {"type": "string"} for field in fields}}
        self.spec = ToolSpec(name, description or f"HTTP {self.method} {url}", schema)
        self.limits = limits
        host = urlsplit(url.split("{", 1)[0]).hostname  # the host, when the template fixes it
        if host and "{" not in urlsplit(url).netloc and host.lower() not in self.allowed_hosts:
            allowed = ", ".join(sorted(self.allowed_hosts))
            raise ToolError(f"http tool {name}: {host} is not in allowed_hosts ({allowed})")

    def _headers(self) -> dict[str, str]:
        headers = {}
        for header, variable in self.headers_env.items():
            value = os.environ.get(variable)
            if value is None:
                raise ToolError(f"the tool's header {header} needs the env var {variable}, which is not set")
            headers[header] = value
        return headers

    def build_url(self, arguments: dict) -> tuple[str, dict]:
        """(the filled URL, the arguments the template did not take); refuses hosts not allowed."""
        fields = template_fields(self.url)
        missing = [field for field in fields if field not in arguments]
        if missing:
            raise ToolError(f"missing argument(s): {', '.join(missing)}")
        dots = [field for field in fields if str(arguments[field]) in (".", "..")]
        if dots:  # a dot segment would climb the path on the allowed host
            raise ToolError(f"argument(s) {', '.join(dots)} may not be '.' or '..'")
        url = self.url.format(**{field: quote(str(arguments[field]), safe="") for field in fields})
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or (parts.hostname or "").lower() not in self.allowed_hosts:
            raise ToolError(f"the host {parts.hostname!r} is not one this tool may reach")
        return url, {key: value for key, value in arguments.items() if key not in fields}

    async def call(self, arguments: dict) -> str:
        url, rest = self.build_url(arguments)
        query = {k: str(v) for k, v in rest.items()} if self.method in _BODYLESS else None
        body = rest if self.method not in _BODYLESS else None
        limit = self.limits.max_result_chars * 4 + 1024  # bytes read at most: the text is cut later anyway
        async with aiohttp.ClientSession() as client, client.request(
                self.method, url, params=query, json=body, headers=self._headers(), allow_redirects=False) as response:
            data = await _read_at_most(response.content, limit)
            text = data.decode(response.charset or "utf-8", errors="replace")
            if response.status >= 400:
                raise ToolError(f"HTTP {response.status}: {text[:300]}")
            return text


async def _read_at_most(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The body up to `limit` bytes: `read(n)` returns what has arrived so far, not n bytes."""
    data = bytearray()
    while len(data) < limit:
        chunk = await content.read(limit - len(data))
        if not chunk:
            break
        data.extend(chunk)
    return bytes(data)
