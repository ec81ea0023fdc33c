"""The proxy in front of a failing upstream (#18): sixteen ways an upstream can fail, each with a request
that goes straight through and one that first needs a summary (so the summariser meets the fault too).

Whatever the upstream does, the client gets an answer within the proxy's timeout — the upstream's own
reply when it sent one, a 502 naming the upstream when it did not, an error event at the end of a stream
that was cut — with no traceback in the log, and the proxy answers the next request too."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Callable
from typing import Any

import httpx2
import pytest
from builders import conversation
from tiny_llama import free_port
from upstreams import proxied, raw_upstream

Reader, Writer = asyncio.StreamReader, asyncio.StreamWriter
CHAT = json.dumps({"id": "c", "choices": [{"message": {"role": "assistant", "content": "- a summary."},
                   "finish_reason": "stop"}], "usage": {"prompt_tokens": 10}}).encode()  # fmt: skip


def reply(status: str, headers: list[str], body: bytes = b"") -> bytes:
    """A reply as the upstream writes it; it closes the connection after each (and says so)."""
    return ("\r\n".join([f"HTTP/1.1 {status}", *headers, "connection: close", "", ""])).encode() + body


async def hold(writer: Writer, seconds: float = 5.0) -> None:
    await asyncio.sleep(seconds)
    writer.close()


# Each fault: what the upstream writes after reading a request's headers, and the status the client sees.
FAULTS: dict[str, tuple[Callable[[Writer], Any], int]] = {
    "reset on connect": (lambda w: None, 502),
    "half a status line": (lambda w: w.write(b"HTTP/1.1 2"), 502),
    "not HTTP at all": (lambda w: w.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"), 502),
    "headers, then nothing": (lambda w: w.write(reply("200 OK", ["content-length: 100"])), 502),
    "a body cut short": (lambda w: w.write(reply("200 OK", ["content-length: 1000"], b'{"choi')), 502),
    "a chunked body cut short": (lambda w: w.write(reply("200 OK", ["transfer-encoding: chunked"], b'5\r\n{"ch')), 502),
    "no answer": ("hang", 502),
    "a stalled body": ("stall", 502),
    "a 200 KB header": (
        lambda w: w.write(reply("200 OK", ["x-big: " + "a" * 200_000, "content-length: 2"], b"{}")),
        502,
    ),
    "an undecodable error": (
        lambda w: w.write(reply("400 Bad Request", ["content-encoding: gzip", "content-length: 9"], b"not gzip!")),
        502,
    ),
    "500 with HTML": (
        lambda w: w.write(
            reply(
                "500 Internal Server Error",
                ["content-type: text/html", "content-length: 21"],
                b"<h1>it broke</h1>\n\n\n\n",
            )
        ),
        500,
    ),
    "429 with retry-after": (
        lambda w: w.write(reply("429 Too Many Requests", ["retry-after: 1", "content-length: 2"], b"{}")),
        429,
    ),
    "200, not JSON": (lambda w: w.write(reply("200 OK", ["content-length: 9"], b"not json!")), 200),
    "200, empty": (lambda w: w.write(reply("200 OK", ["content-length: 0"])), 200),
    "a valid gzip body": (
        lambda w: w.write(
            reply(
                "200 OK", ["content-encoding: gzip", f"content-length: {len(gzip.compress(CHAT))}"], gzip.compress(CHAT)
            )
        ),
        200,
    ),
    "a stream cut short": ("sse", 200),
}


def upstream_for(fault: str) -> Callable[[Reader, Writer], Any]:
    action, _ = FAULTS[fault]

    async def handle(reader: Reader, writer: Writer) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            return
        if action == "hang":
            return await hold(writer)
        if action == "stall":
            writer.write(reply("200 OK", ["content-length: 500"], b'{"id": "c", '))
            await writer.drain()
            return await hold(writer)
        if action == "sse":
            event = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
            writer.write(reply("200 OK", ["content-type: text/event-stream", "transfer-encoding: chunked"],
                               b"%x\r\n%s\r\n" % (len(event), event)))  # fmt: skip
        else:
            action(writer)
        await writer.drain()
        writer.close()

    return handle


@pytest.mark.parametrize("needs_summary", [False, True], ids=["straight", "summary first"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failing_upstream_always_gets_the_client_an_answer(
    fault: str, needs_summary: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    expected = FAULTS[fault][1]
    history = conversation(12, size=150) if needs_summary else [{"role": "user", "content": "hi"}]
    body: dict[str, Any] = {"model": "m", "messages": history, "max_tokens": 64, "stream": fault.startswith("a stream")}
    with raw_upstream(upstream_for(fault)) as url, proxied(url, window=2048, timeout=1.0) as front:
        answers = [httpx2.post(f"{front}/chat/completions", json=body, timeout=30) for _ in range(2)]
    for answer in answers:  # the second request too: the proxy is still there
        assert answer.status_code == expected, (fault, answer.status_code, answer.text[:300])
        if expected == 502:
            assert url in answer.json()["error"]["message"]
        if body["stream"]:
            assert url in json.loads(answer.text.strip().splitlines()[-1][6:])["error"]["message"]
    if needs_summary and expected >= 400:  # the summariser failed too: the request was trimmed instead
        assert "action=trim" in answers[0].headers.get("x-context-shrink", "action=trim")
    assert "Traceback" not in capfd.readouterr().err


def test_an_upstream_that_is_not_there_is_a_502(capfd: pytest.CaptureFixture[str]) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with proxied(dead, window=2048, timeout=1.0) as front:
        answer = httpx2.post(f"{front}/chat/completions", json={"model": "m", "messages": conversation(12, size=150)})
    assert answer.status_code == 502 and dead in answer.json()["error"]["message"]
    assert "Traceback" not in capfd.readouterr().err
