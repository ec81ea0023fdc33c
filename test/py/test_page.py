"""The live page (#31): ``GET /context-shrink/`` on the proxy and on ``serve``, loaded in a real headless
Chromium against a proxy that has shrunk real requests; what it renders must be what
``/context-shrink/stats`` reports. Screenshots (light and dark) are kept in ``test/artifacts/``."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx2
import pytest
from builders import chat_history
from fake_openai import FakeOpenAI, serve
from proxy_helpers import proxy, started

import context_shrink_proxy as csp

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
TOKEN = "page-token-0123456789"


def chromium() -> str:
    """Debian's chromium (``.ci/run`` installs it); outside CI a machine without one skips, saying so."""
    found = next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the live page in a real browser: apt-get install chromium")
        pytest.skip("no Chromium on this machine (apt-get install chromium): the live page is not loaded")
    return found


def rendered(url: str, tmp_path: Path, screenshot: Path | None = None, dark: bool = False) -> str:
    """The page's DOM after its script ran (and fetched the stats), from headless Chromium."""
    command = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=4000",
               "--window-size=1280,1150"]  # fmt: skip
    command += ["--force-dark-mode"] if dark else []
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([*command, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True)
    done = subprocess.run([*command, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def cards(dom: str) -> dict[str, str]:
    return {key: html.unescape(value) for key, value in re.findall(r'<b id="(\w+)">([^<]*)</b>', dom)}


def shrunk_traffic(url: str, **headers: str) -> None:
    """Requests that fit, that are compacted, and a conversation that grows turn by turn."""
    for turns in (3, 14, 15, 16, 17):
        body = {"model": "m", "messages": chat_history(turns, size=200), "max_tokens": 200}
        reply = httpx2.post(url + "/chat/completions", json=body, headers=headers, timeout=60)
        assert reply.status_code == 200, reply.text


def assert_shows(dom: str, stats: dict[str, Any]) -> None:
    shown, totals = cards(dom), stats["totals"]
    for key in ("requests", "shrunk", "tokens_saved", "refusals_avoided", "refusals", "exact_counts",
                "estimated_counts", "summariser_calls"):  # fmt: skip
        assert shown[key] == f"{totals[key]:,}", (key, shown, totals)
    assert shown["repeated"] == f"{round(100 * totals['repeated_share_sum'] / totals['repeated_requests'])} %"
    recent = stats["recent"]
    chart = re.search(r'<svg id="chart".*?</svg>', dom, re.S)
    assert chart and chart.group(0).count("<rect") == 2 * len(recent)  # before and after, as inline SVG
    assert "<polyline" in chart.group(0)  # the window line
    decisions = re.search(r'<tbody id="decisions">(.*?)</tbody>', dom, re.S)
    assert decisions and decisions.group(1).count("<tr>") == len(recent)
    for row in recent:
        assert f"{row['tokens_before']:,}" in decisions.group(1) and row["action"] in decisions.group(1)
    for table, rows in (("models", stats["models"]), ("conversations", next(iter(stats["models"].values()))
                                                      ["conversations"])):  # fmt: skip
        body = re.search(rf'<tbody id="{table}">(.*?)</tbody>', dom, re.S)
        cells = [re.findall(r"<td[^>]*>([^<]*)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", body.group(1))]
        for name, row in rows.items():
            shown = next(c for c in cells if c[0] == name)
            wanted = [row["requests"], row["shrunk"], row["refusals_avoided"], row["tokens_saved"]]
            assert shown[1:5] == [f"{n:,}" for n in wanted], (table, shown, row)


def test_the_live_page_shows_what_the_stats_report(tmp_path: Path) -> None:
    upstream_fake, summariser = FakeOpenAI(window=6000), FakeOpenAI(window=100_000)
    summariser.default = "copy"  # a summariser that fails: the page shows it backed off
    with serve(upstream_fake) as upstream, serve(summariser) as summary_url:
        flags = ("--window", "6000", "--summary-url", summary_url, "--no-archive")
        with proxy(upstream, *flags, log=tmp_path / "log") as url:
            shrunk_traffic(url)
            base = url.removesuffix("/v1")
            page = httpx2.get(base + "/context-shrink/")
            stats = httpx2.get(base + "/context-shrink/stats").json()
            dom = rendered(base + "/context-shrink/", tmp_path, ARTIFACTS / "live-page.png")
            rendered(base + "/context-shrink/", tmp_path, ARTIFACTS / "live-page-dark.png", dark=True)
            assert httpx2.get(base + "/context-shrink", follow_redirects=True).text == page.text
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert not re.search(r"""(src|href)\s*=|https?://|@import""", csp.LIVE_PAGE)  # nothing from outside the proxy
    assert stats["totals"]["shrunk"] >= 3 and stats["totals"]["requests"] == 5
    over = [r for r in stats["recent"] if r["tokens_before"] > 6000 >= r["tokens_after"]]
    assert stats["totals"]["refusals_avoided"] == len(over) >= 3  # over the window, sent within it
    assert_shows(dom, stats)
    (health,) = stats["summarisers"].values()
    assert health["failures"] == 1 and "backed off" in dom and health["last_error"][:40] in html.unescape(dom)
    assert (ARTIFACTS / "live-page.png").stat().st_size > 10_000


def test_the_live_page_on_serve_needs_the_token(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=6000)
    with serve(fake) as upstream:
        flags = ("serve", "--token", TOKEN, "--upstream", upstream, "--window", "6000", "--no-archive")
        with started(*flags, log=tmp_path / "log") as base:
            shrunk_traffic(base + "/v1", Authorization=f"Bearer {TOKEN}")  # as the agents send it
            page = base + "/context-shrink/"
            refused = [httpx2.get(page), httpx2.get(page + "?token=wrong"), httpx2.get(base + "/context-shrink/stats")]
            passing = httpx2.get(base + "/context-shrink/stats?token=" + TOKEN)  # the query opens the page only
            stats = httpx2.get(base + "/context-shrink/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()
            dom = rendered(page + "?token=" + TOKEN, tmp_path, ARTIFACTS / "live-page-serve.png")
            locked = rendered(page, tmp_path / "fresh")
    assert [r.status_code for r in refused] == [401, 401, 401] and passing.status_code == 401
    assert_shows(dom, stats)
    assert "a bearer token is required" in locked and not cards(locked)  # without it, not even the page
    assert TOKEN not in (tmp_path / "log").read_text()


def test_the_live_page_says_when_the_store_is_unreachable(tmp_path: Path) -> None:
    """A Redis that is down: the proxy serves from memory and its page says so, without the password."""
    from tiny_llama import free_port

    dead = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    with serve(FakeOpenAI(window=6000)) as upstream, proxy(upstream, "--state", dead, log=tmp_path / "log") as url:
        shrunk_traffic(url)
        base = url.removesuffix("/v1")
        dom = rendered(base + "/context-shrink/", tmp_path)
    status = re.search(r'<span class="(\w+)" id="status">([^<]*)</span>', dom)
    assert status and status.group(1) == "bad", dom[:2000]
    assert "unreachable" in status.group(2) and "serving from memory" in status.group(2)
    assert "hunter2" not in dom
