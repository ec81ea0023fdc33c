"""Start the context-shrink MCP server over stdio with the official Python SDK and call its tools.

    python examples/python-client.py [conversation.json]

It lists the tools, measures the sample conversation with estimate_context, trims it to a small
window with trim_context, and asks compact_context for a plan (no model needed).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from mcp import Client
from mcp.client.stdio import StdioServerParameters

HERE = Path(__file__).resolve().parent
SERVER = HERE.parent / "context_shrink.py"


async def main() -> int:
    conversation = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "sample-conversation.json"
    messages = json.loads(conversation.read_text(encoding="utf-8"))["messages"]
    # The server reads files only inside its root: here, the folder of the conversation.
    env = {**os.environ, "CONTEXT_SHRINK_ROOT": str(conversation.resolve().parent)}
    params = StdioServerParameters(command=sys.executable, args=[str(SERVER)], env=env)
    async with Client(params) as client:
        tools = (await client.list_tools()).tools
        print("tools:", ", ".join(tool.name for tool in tools))

        estimate = (await client.call_tool("estimate_context", {"messages": messages})).structured_content
        print(
            f"estimate_context: {estimate['tokens']} tokens of {estimate['max_context_tokens']} "
            f"({estimate['tokenizer']}), should_trim={estimate['should_trim']}"
        )

        trim = await client.call_tool("trim_context", {"messages": messages, "max_context_tokens": 800})
        report = trim.structured_content
        print(
            f"trim_context: {report['tokens_before']} -> {report['tokens_after']} tokens, "
            f"dropped {report['dropped']} messages, fits={report['fits']}"
        )

        arguments = {"messages_path": conversation.name, "max_context_tokens": 800, "keep_last": 2, "model": ""}
        report = (await client.call_tool("compact_context", arguments)).structured_content
        print(f"compact_context (plan): needs_summary={report['needs_summary']}: {report['reason']}")

        bad = await client.call_tool("estimate_context", {"messages": [{"role": "robot", "content": "hi"}]})
        print("bad input ->", "error:" if bad.is_error else "NOT AN ERROR:", bad.content[0].text)
        return 0 if bad.is_error and estimate["tokens"] > 0 else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
