"""The backend client against a mock transport: headers, retries, Retry-After, error shapes, redaction."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import httpx2
import pytest

import context_shrink as cs

REPLY = {"choices": [{"message": {"role": "assistant", "content": "- the summary"}, "finish_reason": "stop"}]}


def backend(handler: Callable[[httpx2.Request], httpx2.Response], **kwargs: Any) -> cs.Backend:
    client = httpx2.AsyncClient(transport=httpx2.MockTransport(handler))
    return cs.Backend(client, "http://backend.test/v1/", **kwargs)


def chat(b: cs.Backend) -> cs.Reply:
    return anyio.run(lambda: b.chat("m", [{"role": "user", "content": "x"}], 64))


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    recorded: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        recorded.append(seconds)

    monkeypatch.setattr(cs, "_sleep", fake_sleep)
    return recorded


def test_request_shape_and_headers() -> None:
    seen: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(200, json=REPLY)

    b = backend(handler, api_key="sk-1", extra_headers={"api-key": "azure"})
    assert chat(b) == "- the summary"
    request = seen[0]
    assert str(request.url) == "http://backend.test/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-1"
    assert request.headers["api-key"] == "azure"
    body = json.loads(request.content)
    assert body["model"] == "m" and body["max_tokens"] == 64 and body["stream"] is False


def test_no_key_no_authorization_header() -> None:
    seen: list[httpx2.Request] = []
    chat(backend(lambda r: seen.append(r) or httpx2.Response(200, json=REPLY)))
    assert "authorization" not in seen[0].headers


def test_429_honours_retry_after(sleeps: list[float]) -> None:
    replies = iter([httpx2.Response(429, headers={"Retry-After": "7"}, json={"error": {"message": "slow down"}})])
    assert chat(backend(lambda r: next(replies, httpx2.Response(200, json=REPLY)))) == "- the summary"
    assert sleeps == [7.0]


def test_retry_after_is_capped(sleeps: list[float]) -> None:
    replies = iter([httpx2.Response(503, headers={"Retry-After": "3600"})])
    chat(backend(lambda r: next(replies, httpx2.Response(200, json=REPLY))))
    assert sleeps == [cs.MAX_RETRY_AFTER]


def test_5xx_gives_up_after_two_retries(sleeps: list[float]) -> None:
    calls: list[int] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        calls.append(1)
        return httpx2.Response(500, json={"error": {"message": "boom"}})

    with pytest.raises(cs.ContextShrinkError, match="backend 500: boom"):
        chat(backend(handler))
    assert len(calls) == 3 and len(sleeps) == 2


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (
            400,
            {
                "error": {
                    "code": 400,
                    "message": "request (6010 tokens) exceeds the available context size (2048 tokens), "
                    "try increasing it",
                    "type": "exceed_context_size_error",
                }
            },
            "backend 400: request (6010 tokens) exceeds the available context size (2048 tokens)",
        ),
        (400, {"object": "error", "message": "This model's maximum context length is 4096 tokens."}, "maximum context"),
        (400, {"error": "Trying to keep the first 9000 tokens"}, "backend 400: Trying to keep"),
        (422, {"error": "Input validation error", "error_type": "validation"}, "backend 422: Input validation error"),
        (404, {"detail": "Not Found"}, "backend 404: Not Found"),
    ],
)
def test_upstream_error_shapes(status: int, body: dict[str, Any], expected: str) -> None:
    with pytest.raises(cs.ContextShrinkError, match=None) as info:
        chat(backend(lambda r: httpx2.Response(status, json=body)))
    assert expected in str(info.value)


def test_garbage_and_non_summary_replies() -> None:
    with pytest.raises(cs.ContextShrinkError, match="is not JSON"):
        chat(backend(lambda r: httpx2.Response(200, text="<html>oops</html>")))
    tool_only = {"choices": [{"message": {"content": None, "tool_calls": [{"id": "c", "function": {"name": "x"}}]}}]}
    called = chat(backend(lambda r: httpx2.Response(200, json=tool_only)))  # the guard asks again (test_fidelity)
    assert called == "" and called.finish_reason == "tool_calls"
    empty = {"choices": [{"message": {"content": "   "}}]}
    with pytest.raises(cs.ContextShrinkError, match="no text"):
        chat(backend(lambda r: httpx2.Response(200, json=empty)))


def test_api_key_is_redacted_from_errors(sleeps: list[float]) -> None:
    body = {"error": {"message": "Incorrect API key provided: sk-very-secret"}}
    with pytest.raises(cs.ContextShrinkError) as info:
        chat(backend(lambda r: httpx2.Response(401, json=body), api_key="sk-very-secret"))
    assert "sk-very-secret" not in str(info.value) and "backend 401: Incorrect API key provided: ***" in str(info.value)


def test_connection_errors_are_retried_then_named(sleeps: list[float]) -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("Connection refused")

    with pytest.raises(cs.ContextShrinkError, match=r"backend unreachable: http://backend.test/v1/chat/completions"):
        chat(backend(handler))
    assert len(sleeps) == 2


def test_timeouts_are_not_retried(sleeps: list[float]) -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ReadTimeout("timed out")

    with pytest.raises(cs.ContextShrinkError, match="backend timeout"):
        chat(backend(handler))
    assert sleeps == []


def test_errors_carry_attributes_not_just_text(sleeps: list[float]) -> None:
    """Callers branch on BackendError's attributes: status, url, unreachable, missing and overflow."""
    overflow = {"error": {"code": 400, "message": "request (9000 tokens) exceeds the available context size "
                          "(4096 tokens)", "type": "exceed_context_size_error", "n_prompt_tokens": 9000,
                          "n_ctx": 4096}}  # fmt: skip
    cases = {404: {"error": {"message": "File Not Found"}}, 400: overflow, 401: {"error": {"message": "no key"}}}
    for status, body in cases.items():
        with pytest.raises(cs.BackendError) as info:
            chat(backend(lambda _, status=status, body=body: httpx2.Response(status, json=body)))
        error = info.value
        assert error.status == status and error.url == "http://backend.test/v1/chat/completions"
        assert not error.unreachable and error.missing == (status == 404)
        assert (error.overflow == cs.Overflow(4096, 9000)) == (status == 400)

    def refuse(_: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("refused")

    with pytest.raises(cs.BackendError) as info:
        chat(backend(refuse))
    assert info.value.unreachable and info.value.status is None and isinstance(info.value, cs.ContextShrinkError)
