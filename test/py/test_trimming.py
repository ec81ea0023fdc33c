"""Look, then cut: analyze_context's lines and ids, prune_context, and the tiers of trimming."""

from __future__ import annotations

import base64
import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
from builders import assistant, conversation, tool, user
from checks import check_trim
from conftest import load_session, session_files
from mcp_calls import call, error, ok, run

import context_shrink as cs

pytestmark = pytest.mark.core  # the fast loop: ./test/test.sh --fast

LINE = re.compile(
    r"^(?P<id>[0-9a-f]{8}) (?P<kind>system|user|assistant|tool_call|tool_result|image) (?P<tokens>\d+)tok: "
)


def png(width: int, height: int) -> str:
    data = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR" + struct.pack(">II", width, height) + b"\x08\x02" + b"\x00" * 70000
    return "data:image/png;base64," + base64.b64encode(data).decode()


def agent_loop() -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": "You are an agent."}, user("fix the failing test in src/app.py")]
    for k in range(6):
        messages += [assistant(None, f"c{k}"), tool(f"c{k}", f"line {k}\n" * (300 + 100 * k))]
    return messages


# --------------------------------------------------------------------------- analyze


def test_analyze_lines_are_parseable_and_totals_cover_everything(tok: cs.Tokenizer) -> None:
    messages = [
        *conversation(2, size=20),
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png(160, 120)}}]},
    ]
    result = cs.analyze_messages(messages, tok, 32768, limit=3)
    assert result["message_count"] == len(messages) and len(result["lines"]) == 3
    assert result["tokens"] == cs.count_messages(messages, tok)[1]
    assert result["messages_by_role"] == {"system": 1, "user": 3, "assistant": 4, "tool": 4}
    assert result["tool_calls"] == 4 and result["images"] == 1
    assert result["next_offset"] == 3 and "offset=3" in result["note"]
    kinds = []
    for line in cs.analyze_messages(messages, tok, 32768, limit=1000)["lines"]:
        match = LINE.match(line)
        assert match, line
        kinds.append(match["kind"])
        assert "\n" not in line and len(line) < 120
    assert kinds == ["system", "user", "tool_call", "tool_result", "tool_result", "assistant"] * 1 + [
        "user",
        "tool_call",
        "tool_result",
        "tool_result",
        "assistant",
        "image",
    ]
    assert " bash: output output" in cs.analyze_messages(messages, tok, 32768)["lines"][3]


def test_analyze_largest_first(tok: cs.Tokenizer) -> None:
    messages = agent_loop()
    lines = cs.analyze_messages(messages, tok, 32768, sort="largest", limit=2)["lines"]
    sizes = [int(LINE.match(line)["tokens"]) for line in lines]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == max(cs.count_messages(messages, tok)[0])


def test_ids_are_stable_and_duplicates_distinct() -> None:
    messages = [user("same"), assistant("ok"), user("same"), assistant("ok")]
    ids = cs.message_ids(messages)
    assert len(set(ids)) == 4
    assert cs.message_ids(messages[2:])[0] == ids[0]  # the first "same" is the first again
    assert cs.message_ids([messages[1], messages[0]]) == [ids[1], ids[0]]  # stable across reordering/removal


@pytest.mark.parametrize(
    ("kwargs", "expected"), [({"sort": "size"}, "sort"), ({"limit": 0}, "limit"), ({"offset": -1}, "offset")]
)
def test_analyze_bad_arguments(tok: cs.Tokenizer, kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(cs.ContextShrinkError, match=expected):
        cs.analyze_messages([user("a")], tok, **kwargs)


# --------------------------------------------------------------------------- prune


def test_prune_by_id_takes_whole_units_and_reports_each_id(tok: cs.Tokenizer) -> None:
    messages = conversation(2, size=20)
    ids = cs.message_ids(messages)
    result = cs.prune_messages(
        messages,
        tok,
        remove_ids=[ids[3], ids[0], "zz99", "ab", ids[6][:6].upper(), "0000ffff"],
        max_context_tokens=32768,
    )
    # ids[3] is a tool result: its call and sibling result go too; ids[6] is the second user message.
    assert result["resolutions"] == {
        ids[3]: "removed",
        ids[0]: "refused",
        "zz99": "no match",
        "ab": "too short",
        ids[6][:6].upper(): "removed",
        "0000ffff": "no match",
    }
    assert result["removed_indices"] == [2, 3, 4, 6]
    assert result["messages"] == [m for i, m in enumerate(messages) if i not in (2, 3, 4, 6)]
    assert cs.api_problems(result["messages"]) == []
    assert result["tokens_after"] < result["tokens_before"]


def test_prune_ambiguous_prefix(tok: cs.Tokenizer) -> None:
    messages = [user(f"message {k}") for k in range(300)]
    ids = cs.message_ids(messages)
    prefix = next(p for p in {i[:4] for i in ids} if sum(i.startswith(p) for i in ids) > 1)
    assert cs.prune_messages(messages, tok, remove_ids=[prefix])["resolutions"] == {prefix: "ambiguous"}


def test_prune_images_and_old_tool_results(tok: cs.Tokenizer) -> None:
    picture = {
        "role": "user",
        "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": png(160, 120)}}],
    }
    messages = [*conversation(3, size=50), picture]
    result = cs.prune_messages(messages, tok, images=True, clear_tool_results_before=1)
    out = result["messages"]
    assert result["images_removed"] == 1
    assert out[-1]["content"][1] == {"type": "text", "text": "[image removed: png 160x120, 68 KB]"}
    # The newest user turn is the picture: every tool result before it is cleared, calls stay.
    assert result["tool_results_cleared"] == 6
    assert all(m["content"].startswith("[tool result cleared: bash, ") for m in out if m["role"] == "tool")
    assert cs.api_problems(out) == [] and [m["role"] for m in out] == [m["role"] for m in messages]
    kept = cs.prune_messages(messages, tok, clear_tool_results_before=2)
    assert kept["tool_results_cleared"] == 4  # only the two oldest turns' results


def test_placeholders_are_byte_stable() -> None:
    result = tool("c1", "x\n" * 5000)
    assert cs.cleared_result(result, "bash") == cs.cleared_result(dict(result), "bash")
    assert cs.elided_result(result) == cs.elided_result(json.loads(json.dumps(result)))
    assert cs.elided_result(tool("c1", "short")) is None


# --------------------------------------------------------------------------- tiers


def test_tier_one_clears_old_tool_results_when_that_is_enough(tok: cs.Tokenizer) -> None:
    messages = conversation(4, size=150)
    total = cs.count_messages(messages, tok)[1]
    result = check_trim(messages, tok, total - 300, keep_last=2)
    assert result["tiers"][0]["tier"] == "clear_tool_results"
    assert result["dropped"] == 0 and result["fits"] and result["budget_use"] >= 0.95
    assert result["messages"][1] is messages[1]  # old user messages are not touched while results can go
    assert result["messages"][3]["content"].startswith("[tool result cleared: bash, ")  # the oldest first
    assert result["messages"][-2] is messages[-2]  # the newer results stay


def test_tier_two_drops_turns_and_clears_inside(tok: cs.Tokenizer) -> None:
    messages = conversation(8, size=150)
    result = check_trim(messages, tok, 1500, keep_last=2)
    tiers = [t["tier"] for t in result["tiers"]]
    assert "drop_turns" in tiers and result["fits"]
    plain = check_trim(messages, tok, 1500, keep_last=2, strategy="drop")
    assert result["tokens_after"] >= plain["tokens_after"]  # clearing lets more history stay


def test_one_long_turn_clears_its_old_results_before_dropping_steps(tok: cs.Tokenizer) -> None:
    messages = agent_loop()  # results of 1.2k to 3.2k tokens
    budget = 5000
    result = check_trim(messages, tok, budget, keep_last=2)
    tiers = [t["tier"] for t in result["tiers"]]
    assert result["fits"] and tiers[0] == "clear_tool_results" and "drop_turns" not in tiers
    assert result["messages"][1] is messages[1]  # the task itself stays
    assert result["messages"][-1] is messages[-1]  # the newest result is whole: the room went to the old ones
    assert result["budget_use"] >= 0.9


def test_tier_three_elides_the_newest_result_when_it_alone_is_too_big(tok: cs.Tokenizer) -> None:
    messages = [*agent_loop()[:4], assistant(None, "big"), tool("big", "line x\n" * 3000)]
    result = check_trim(messages, tok, 3000, keep_last=2)
    assert result["fits"] and result["messages"][1] is messages[1]
    assert "tokens elided …]" in result["messages"][-1]["content"]  # elided, not cleared
    assert result["messages"][-1]["content"].startswith("line x") and result["budget_use"] >= 0.9


def test_partial_turn_keeps_its_user_message(tok: cs.Tokenizer) -> None:
    messages = [{"role": "system", "content": "s"}, user("refactor the parser")]
    for k in range(8):  # big tool-call arguments: old ones keep a head and tail of each long value
        call = {
            "id": f"w{k}",
            "type": "function",
            "function": {"name": "write", "arguments": json.dumps({"text": "x " * 400})},
        }
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]}, tool(f"w{k}", "ok")]
    messages += [user("now also update the docs"), assistant("done")]
    total = cs.count_messages(messages, tok)[1]
    result = check_trim(messages, tok, total // 2, keep_last=2)
    assert result["pinned_user_index"] == 1 and result["messages"][1] is messages[1]
    assert result["messages"][2]["role"] == "assistant" and result["budget_use"] >= 0.9
    assert {t["tier"] for t in result["tiers"]} <= {"drop_turns", "elide"}
    shortened = [m for m in result["messages"] if m.get("tool_calls") and "tokens elided" in str(m["tool_calls"])]
    assert all(json.loads(m["tool_calls"][0]["function"]["arguments"])["text"] for m in shortened)  # still JSON


def test_best_effort_when_nothing_can_fit(tok: cs.Tokenizer) -> None:
    messages = [{"role": "system", "content": "s " * 3000}, user("go")]
    result = check_trim(messages, tok, 1000)
    assert not result["fits"] and result["tokens_over"] > 0 and result["messages"] == messages


def test_alternate_roles_merges_neighbours(tok: cs.Tokenizer) -> None:
    messages = [user("a"), user("b"), assistant("c"), assistant("d"), user("e")]
    result = cs.trim_messages(messages, tok, 10_000, alternate_roles=True)
    assert [m["role"] for m in result["messages"]] == ["user", "assistant", "user"]
    assert result["messages"][0]["content"] == "a\n\nb"
    assert result["tiers"] == [{"tier": "merge_roles", "messages": 2, "tokens": 0}]


@pytest.mark.parametrize("budget", [4096, 8192, 16384, 32768, 131072])
@pytest.mark.parametrize("path", session_files(), ids=lambda p: p.stem[:40])
def test_invariants_on_real_transcripts(tok: cs.Tokenizer, path: Path, budget: int) -> None:
    messages = load_session(path)
    result = check_trim(messages, tok, budget)
    if result["fits"]:
        assert result["budget_use"] <= 1.0


def budget_use_table(tok: cs.Tokenizer) -> list[tuple[str, int, float | None]]:
    rows = []
    for path in session_files():
        messages = load_session(path)
        for budget in (8192, 16384, 32768):
            result = cs.trim_messages(messages, tok, budget)
            use = result["tokens_after"] / budget if result["fits"] else None
            rows.append((path.stem, budget, use if cs.count_messages(messages, tok)[1] > budget else None))
    return rows


def test_budget_use_on_real_transcripts(tok: cs.Tokenizer) -> None:
    uses = [use for _, _, use in budget_use_table(tok) if use is not None]
    assert len(uses) >= 3 and min(uses) >= 0.95


# --------------------------------------------------------------------------- the tools


def test_prune_tool_in_place_dry_run_backup_and_bad_jsonl_lines(tmp_path: Path) -> None:
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken"))
    messages = conversation(2, size=20)
    lines = [json.dumps(m) + "\n" for m in messages]
    lines.insert(3, "{this line is not json\n")
    original = "".join(lines)
    (tmp_path / "h.jsonl").write_text(original)
    ids = cs.message_ids(messages)
    arguments = {"messages_path": "h.jsonl", "output_path": "h.jsonl", "remove_ids": [ids[6]]}
    report = ok(run(call(server, "prune_context", arguments)))
    assert report["dry_run"] is True and report["resolutions"] == {ids[6]: "removed"}
    assert (tmp_path / "h.jsonl").read_text() == original  # nothing written
    report = ok(run(call(server, "prune_context", {**arguments, "dry_run": False})))
    assert report["dry_run"] is False and report["backup_path"]
    backup = Path(report["backup_path"])
    assert backup.name.startswith("h.jsonl.pre-shrink-") and backup.read_text() == original
    written = (tmp_path / "h.jsonl").read_text().splitlines(keepends=True)
    assert written == [line for k, line in enumerate(lines) if k != 7]  # byte for byte, the bad line too


def test_analyze_tool_and_bad_input(tmp_path: Path) -> None:
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken"))
    messages = agent_loop()
    result = ok(run(call(server, "analyze_context", {"messages": messages, "sort": "largest", "limit": 2})))
    assert len(result["lines"]) == 2 and result["next_offset"] == 2
    assert all(LINE.match(line) for line in result["lines"])
    assert "limit" in error(run(call(server, "analyze_context", {"messages": messages, "limit": 5000})))
    assert "remove_ids" in error(run(call(server, "prune_context", {"messages": messages, "remove_ids": "abcd"})))


def test_trim_tool_reports_tiers(tmp_path: Path) -> None:
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken"))
    messages = agent_loop()
    result = ok(run(call(server, "trim_context", {"messages": messages, "max_context_tokens": 3000, "keep_last": 2})))
    assert result["fits"] and result["tiers"][0]["tier"] == "clear_tool_results"
    out = result["messages"]
    assert out[:2] == messages[:2] and [m["role"] for m in out] == [m["role"] for m in messages]


def test_a_reduction_says_what_it_did_whatever_its_text_holds() -> None:
    """Each reduced form comes with what was done to make it, from the code that made it: a text that quotes an
    elision marker or a placeholder is not taken for one."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    quoted = {"role": "user", "content": [{"type": "text", "text": "the log said [… 12 tokens elided …]"}, image]}
    form, kind = cs.least_form(quoted, "tool")
    assert kind == "image" and form != quoted
    result = {"role": "tool", "tool_call_id": "c1", "content": "[tool result cleared: x] " + "line\n" * 300}
    assert cs.least_form(result, "read")[1] == "cleared"
    long_text = {"role": "assistant", "content": "word " * 2000}
    assert cs.least_form(long_text, "tool")[1] == "elided" and cs.least_form(long_text, "tool", light=True) is None
    assert {k for m in (quoted, result, long_text) for _, k in [cs.least_form(m, "t")]} <= set(cs.REDUCTION_KINDS)
