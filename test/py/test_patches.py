"""What context-shrink relies on inside the MCP SDK and uvicorn (the subsection "where this module leans on the
SDK's and uvicorn's internals"): checked against the versions installed, so an upgrade that moves one fails here,
naming it, rather than somewhere downstream. The behaviour each one buys is tested where it is used: the screened
stdio transport in test_stdio.py and test_fuzz.py, the header deadline in test_security.py, strict arguments in
test_doors.py."""

from __future__ import annotations

import importlib.metadata
import inspect

import h11
import mcp.shared._context_streams as context_streams
import pytest
from mcp.server.mcpserver.tools import Tool
from uvicorn.protocols.http.h11_impl import H11Protocol

import context_shrink as cs
import context_shrink_proxy as csp


def moved(part: str) -> str:
    versions = {name: importlib.metadata.version(name) for name in cs.PATCHED_FOR}
    where = "PATCHED_FOR's subsection in context_shrink.py, the HTTP server section of context_shrink_proxy.py"
    return f"{part} moved: written for {cs.PATCHED_FOR}, installed {versions}; see {where}"


def test_tool_run_and_from_function_are_as_strict_tool_uses_them() -> None:
    """StrictTool overrides ``Tool.run(arguments, context, convert_result)`` and builds tools with
    ``structured_output=False`` (no output schema; the result is a CallToolResult it builds itself)."""
    params = list(inspect.signature(Tool.run).parameters)
    assert params[:4] == ["self", "arguments", "context", "convert_result"], moved("Tool.run")
    assert "structured_output" in inspect.signature(Tool.from_function).parameters, moved("Tool.from_function")
    tool = cs.StrictTool.from_function(lambda x=1: {"x": x}, name="t", structured_output=False)
    assert tool.output_schema is None and "x" in tool.parameters["properties"], moved("Tool's schema")


def test_the_lowlevel_server_serves_stdio_as_serve_stdio_drives_it() -> None:
    lowlevel = cs.lowlevel_server(cs.build_server(cs.Config()))
    assert callable(getattr(lowlevel, "run", None)), moved("MCPServer._lowlevel_server.run")
    assert callable(getattr(lowlevel, "create_initialization_options", None)), moved("create_initialization_options")
    expected = ["read_stream", "write_stream", "initialization_options"]
    assert list(inspect.signature(lowlevel.run).parameters)[:3] == expected, moved("the low-level run()")
    writer, reader = context_streams.create_context_streams[object](0)
    assert hasattr(writer, "send") and hasattr(reader, "receive"), moved("mcp.shared._context_streams")


@pytest.mark.parametrize("method", ["connection_made", "data_received", "connection_lost"])
def test_uvicorns_h11_protocol_has_what_the_header_deadline_overrides(method: str) -> None:
    assert callable(getattr(H11Protocol, method, None)), moved(f"H11Protocol.{method}")
    assert issubclass(csp.HeaderDeadline, H11Protocol)


def test_h11_and_the_protocols_state_are_where_the_header_deadline_reads_them() -> None:
    """HeaderDeadline reads ``self.conn.their_state`` (h11's connection) and ``self.loop``/``self.transport``."""
    assert h11.IDLE is not None and hasattr(h11.Connection(h11.SERVER), "their_state"), moved("h11 states")
    source = inspect.getsource(H11Protocol.__init__) + inspect.getsource(H11Protocol.connection_made)
    for attribute in ("self.conn", "self.loop", "self.transport"):
        assert attribute in source, moved(f"H11Protocol's {attribute}")


def test_the_major_versions_are_the_ones_written_for() -> None:
    """A new major version of the SDK, uvicorn or h11 is a new contract: read the subsection again."""
    for name, version in cs.PATCHED_FOR.items():
        assert importlib.metadata.version(name).split(".")[0] == version.split(".")[0], moved(f"{name}'s major")
