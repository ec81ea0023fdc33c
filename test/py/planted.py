"""Conversations with planted identifiers, for the fidelity tests and bench/fidelity.py."""

from __future__ import annotations

import json
import random
from typing import Any

IDENTIFIERS = [
    "src/parser/core.py",
    "tests/test_parser.py",
    "KeyError: 'timeout'",
    "PARSER_STRICT=1",
    "a1b2c3d",
    "issue #481",
    "https://ci.example.com/job/77",
    "250 ms",
    "parse_header",
    "pytest -x tests/test_parser.py",
]

FILLER = [
    "Let me look at the surrounding code first.",
    "The tests are slow on this machine, so I will run only the failing module.",
    "That output is long; the relevant part is near the end.",
    "I will keep the change small and leave the public API as it is.",
    "Before editing, I want to confirm how the configuration is loaded.",
]


def planted_conversation(seed: int = 0, turns: int = 6, tool_heavy: bool = True, lead: int = 0) -> list[dict[str, Any]]:
    """A debugging conversation in which every identifier of IDENTIFIERS appears exactly where a real one would:
    ``lead`` filler turns, then the six turns that hold the facts, then filler up to ``turns``."""
    rng = random.Random(seed)
    facts = [
        ("user", "The parser crashes with KeyError: 'timeout' when the config has no timeout. See issue #481."),
        ("read_file", {"path": "src/parser/core.py"}, "def parse_header(raw):\n    timeout = raw['timeout']\n" * 3),
        (
            "bash",
            {"command": "pytest -x tests/test_parser.py"},
            "FAILED tests/test_parser.py::test_defaults\nE   KeyError: 'timeout'\n1 failed in 250 ms",
        ),
        ("assistant", "The crash comes from parse_header, which reads raw['timeout'] without a default."),
        ("bash", {"command": "git log --oneline -3"}, "a1b2c3d Read timeout from config\n9f8e7d6 Add parser\n"),
        (
            "user",
            "CI shows the same failure: https://ci.example.com/job/77 . Strict mode is on there (PARSER_STRICT=1).",
        ),
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent working in a repository."}]
    call = 0
    for k in range(max(turns, lead + len(facts))):
        fact = facts[k - lead] if lead <= k < lead + len(facts) else None
        for _ in range(rng.randint(1, 3) if tool_heavy else 0):  # noise before the fact
            call += 1
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"n{call}",
                            "type": "function",
                            "function": {"name": "bash", "arguments": json.dumps({"command": f"ls src/module_{call}"})},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": f"n{call}", "content": "\n".join(f"file_{i}.txt" for i in range(40))},
            ]
        if fact is None:
            messages.append({"role": "assistant", "content": rng.choice(FILLER)})
        elif fact[0] in ("user", "assistant"):
            messages.append({"role": fact[0], "content": fact[1]})
        else:
            call += 1
            name, arguments, output = fact
            messages += [
                {
                    "role": "assistant",
                    "content": rng.choice(FILLER),
                    "tool_calls": [
                        {
                            "id": f"c{call}",
                            "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments)},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": f"c{call}", "content": output},
            ]
    messages.append({"role": "user", "content": "Please fix it now and tell me what you changed."})
    return messages


# --------------------------------------------------------------------------- generated identifiers in prose
# Identifiers of the kinds a reader needs to act again, written inside ordinary sentences (no tool calls),
# drawn from random names so that no value can be memorised: kinds x sentence templates x seeds.

SYLLABLES = ["ka", "lo", "mi", "ren", "tus", "vex", "qua", "dor", "fin", "zel", "pra", "nok", "sil", "bru", "tem"]


def word(rng: random.Random, parts: int = 2) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts))


def snake(rng: random.Random) -> str:
    return "_".join(word(rng, rng.randint(1, 2)) for _ in range(rng.randint(2, 3)))


def path(rng: random.Random) -> str:
    ext = rng.choice(["py", "ts", "go", "rs", "rb", "java", "yaml", "toml", "tsx", "kt", "conf", "sql"])
    form = rng.randrange(4)
    if form == 0:
        return "/".join(word(rng) for _ in range(rng.randint(1, 3))) + f"/{snake(rng)}.{ext}"
    if form == 1:
        return f"/{rng.choice(['etc', 'var/lib', 'opt', 'srv'])}/{word(rng)}/{word(rng)}.{ext}"
    if form == 2:
        return f"~/.config/{word(rng)}/{rng.choice(['config', 'settings', 'init'])}.{ext}"
    return "/".join(word(rng) for _ in range(rng.randint(2, 3))) + "/"


def command(rng: random.Random) -> str:
    name, test, target = word(rng), f"test_{snake(rng)}", f"{word(rng)}-{word(rng)}"
    return rng.choice(
        [
            f"pytest {path(rng).rstrip('/')} -k {test}",
            f"python -m pytest tests/{snake(rng)}.py::{test} -x",
            f"go test ./{name}/... -run Test{name.title()}",
            f"cargo test {snake(rng)} -- --nocapture",
            f"npx jest src/{name}.test.ts -t {test}",
            f"make {target}",
            f"cargo build --release -p {name}",
            f"npm run {target}",
            f"bazel build //{name}:{word(rng)}",
            f"docker compose up -d {name}",
            f"./gradlew :{name}:assemble",
            f"tox -e {rng.choice(['py311', 'lint', 'docs'])} -- -k {test}",
            f"dotnet test --filter {name.title()}Tests",
        ]
    )


def commit(rng: random.Random) -> str:
    digits = "0123456789abcdef" if rng.random() < 0.8 else "abcdef"  # short hashes with no digit exist
    return "".join(rng.choice(digits) for _ in range(rng.choice([7, 8, 10, 12])))


def reference(rng: random.Random) -> str:
    n = rng.randint(2, 99999)
    return rng.choice(
        [
            f"#{n}",
            f"issue {n}",
            f"PR #{n}",
            f"pull request {n}",
            f"GH-{n}",
            f"{word(rng).upper()}-{n}",
            f"{word(rng)}/{word(rng)}#{n}",
        ]
    )


def error(rng: random.Random) -> str:
    return rng.choice(
        [
            f"{word(rng).title()}{rng.choice(['Error', 'Exception'])}",
            f"error[E0{rng.randint(100, 999)}]",
            rng.choice(["ECONNREFUSED", "ENOENT", "EADDRINUSE", "EACCES", "ETIMEDOUT"]),
            f"exit code {rng.choice([1, 2, 124, 137, 139])}",
            f"TS{rng.randint(1000, 9999)}",
            rng.choice(["SIGKILL", "SIGSEGV", "OOMKilled"]),
            f"HTTP {rng.choice([401, 403, 409, 429, 502, 503])}",
        ]
    )


def setting(rng: random.Random) -> str:
    value = rng.choice([str(rng.randint(2, 5000)), "true", "false", word(rng)])
    return rng.choice(
        [
            f"{snake(rng).upper()}={value}",
            f"{snake(rng)}={value}",
            f"{word(rng)}.{snake(rng)} = {value}",
            f"--{word(rng)}-{word(rng)}={value}",
        ]
    )


KINDS = {"command": command, "commit": commit, "reference": reference, "path": path, "error": error,
         "setting": setting}  # fmt: skip

TEMPLATES = {
    "command": [
        "I reproduced it with {x} and it failed the same way.",
        "Next, run {x} to see whether the fix holds.",
        "After that I ran {x}, which passed.",
        "You can check it yourself: {x} should now be green.",
        "The CI step is just {x} on a clean checkout.",
    ],
    "commit": [
        "I committed the fix as {x}.",
        "Pushed {x} to the feature branch.",
        "That change was merged in {x} last week.",
        "The regression came in with commit {x}, according to bisect.",
        "I reverted {x} for now.",
    ],
    "reference": [
        "This is tracked in {x}, so please link it.",
        "See {x} for the original report.",
        "It duplicates {x}, which was closed without a fix.",
        "The reviewer on {x} asked for a test first.",
    ],
    "path": [
        "The handler lives in {x} and reads the config once.",
        "I edited {x} to add the default.",
        "Look at {x}; the bug is near the top.",
        "The fixture data is under {x} now.",
    ],
    "error": [
        "It still dies with {x} on the second request.",
        "The logs show {x} right after start-up.",
        "We get {x} only in the container.",
        "That explains the {x} we saw yesterday.",
    ],
    "setting": [
        "It works once {x} is set in the environment.",
        "I changed the default to {x} in the config.",
        "Production runs with {x}, staging does not.",
        "Try again with {x}, it avoids the timeout.",
    ],
}

PROSE_FILLER = [
    "Thanks, that makes sense.",
    "Let me think about the cleanest way to do this.",
    "I looked at it again and the approach still holds.",
    "Could you explain why the earlier attempt did not work?",
    "The first attempt changed too much at once, so I split it up.",
    "Good, let's keep going with the next part.",
    "I am not sure yet; the behaviour depends on the order of start-up.",
    "That part is fine as it is, no change needed there.",
]


def prose_identifiers(rng: random.Random, n: int = 10) -> list[tuple[str, str, str]]:
    """``n`` planted ``(kind, identifier, sentence)``, every kind at least once, some in backticks."""
    kinds = list(KINDS)
    chosen = kinds + [rng.choice(kinds) for _ in range(max(0, n - len(kinds)))]
    rng.shuffle(chosen)
    out = []
    for kind in chosen[:n]:
        identifier = KINDS[kind](rng)
        shown = f"`{identifier}`" if rng.random() < 0.3 else identifier
        out.append((kind, identifier, rng.choice(TEMPLATES[kind]).format(x=shown)))
    return out


def prose_conversation(seed: int, turns: int = 40, n: int = 10) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """A ``turns``-message debugging chat in plain prose whose older three quarters hold ``n`` planted
    identifiers; returns the messages and the planted ``(kind, identifier)`` pairs."""
    rng = random.Random(seed)
    planted = prose_identifiers(rng, n)
    slots = sorted(rng.sample(range(1, max(n + 1, turns * 3 // 4)), n))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful engineering assistant."}]
    for k in range(turns):
        role = "user" if k % 2 == 0 else "assistant"
        sentences = [rng.choice(PROSE_FILLER) for _ in range(rng.randint(1, 3))]
        for slot, (_, _, sentence) in zip(slots, planted, strict=True):
            if slot == k:
                sentences.insert(rng.randint(0, len(sentences)), sentence)
        messages.append({"role": role, "content": " ".join(sentences)})
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "Please summarise where we are and continue."})
    return messages, [(kind, identifier) for kind, identifier, _ in planted]
