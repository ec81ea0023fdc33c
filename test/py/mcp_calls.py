"""Calling the MCP tools from tests: through the SDK's in-memory client, and reading the results."""

from __future__ import annotations

from typing import Any

import anyio
from mcp import Client


def run(coro: Any) -> Any:
    return anyio.run(lambda: coro)


async def call(server: Any, name: str, arguments: dict[str, Any]) -> Any:
    async with Client(server) as client:
        return await client.call_tool(name, arguments)


def ok(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content[0].text
    return result.structured_content


def error(result: Any) -> str:
    assert result.is_error
    return result.content[0].text
