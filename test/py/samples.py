"""Text samples by content class, for fitting and checking the token heuristic against cl100k.

Everything is built from files in this repository or generated deterministically, so the samples are
the same on every machine: English prose (`test/data/samples`), code (this project's own sources),
logs (tool outputs of the copied transcripts plus a generated pytest/server log), minified JSON
(the transcripts, `test/js/package-lock.json`), base64/hex, and CJK (hand-written Chinese, Japanese
and Korean).
"""

from __future__ import annotations

import base64
import collections
import datetime
import hashlib
import json
import random
import re
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "test" / "data"


def _pieces(text: str, size: int = 2000) -> list[str]:
    """Cut at line ends into pieces of about ``size`` characters."""
    out, current = [], ""
    for line in text.splitlines(keepends=True):
        current += line
        if len(current) >= size:
            out.append(current)
            current = ""
    if current.strip():
        out.append(current)
    return out


def _generated_log(seed: int = 3) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(400):
        stamp = f"2026-11-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        t = f"{stamp}:{rng.randint(0, 59):02d}.{rng.randint(0, 999):03d}Z"
        kind = rng.random()
        if kind < 0.4:
            name = rng.choice(["core", "tools", "backend"])
            lines.append(f"test/py/test_{name}.py::test_case_{i} PASSED [{i // 4:3d}%]")
        elif kind < 0.6:
            slot, tokens, ms = rng.randint(0, 3), rng.randint(1, 9000), rng.random() * 100
            lines.append(f"{t} INFO srv  update_slots: id {slot} | task {i} | prompt eval {tokens} tokens, {ms:.2f} ms")
        elif kind < 0.75:
            port, attempt = rng.randint(1024, 65535), rng.randint(1, 3)
            lines.append(f"{t} WARNING retrying http://127.0.0.1:{port}/v1/chat/completions (attempt {attempt})")
        elif kind < 0.9:
            where = rng.choice(["request", "message", "event"])
            path = f"/home/user/project/src/app/module_{rng.randint(1, 40)}.py"
            lines.append(f'  File "{path}", line {rng.randint(1, 900)}, in handle_{where}')
        else:
            a, b, c = rng.randint(0, 10**6), rng.randint(0, 10**6), rng.getrandbits(48)
            lines.append(f"E   AssertionError: assert {a} == {b} (0x{c:012x})")
    return "\n".join(lines) + "\n"


def _transcript_texts(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["messages"]


def samples() -> dict[str, list[str]]:
    """Content class -> list of text samples (each a few KB)."""
    transcripts = sorted(DATA.glob("*.json"))
    tool_outputs = [
        m["content"]
        for path in transcripts
        for m in _transcript_texts(path)
        if m["role"] == "tool" and isinstance(m["content"], str) and len(m["content"]) > 300
    ]
    rng = random.Random(11)
    blobs = [base64.b64encode(rng.randbytes(1500)).decode() for _ in range(4)]
    blobs.append("\n".join(hashlib.sha256(str(i).encode()).hexdigest() for i in range(40)))
    cjk = (DATA / "samples" / "cjk.txt").read_text(encoding="utf-8").splitlines()
    return {
        "prose": _pieces((DATA / "samples" / "prose.txt").read_text(encoding="utf-8"))
        + _pieces((DATA / "samples" / "prose-apache-2.0.txt").read_text(encoding="utf-8")),
        "code": _pieces((ROOT / "context_shrink.py").read_text(encoding="utf-8"))[:12]
        + _pieces((ROOT / "test" / "js" / "stdio.test.js").read_text(encoding="utf-8")),
        "logs": _pieces(_generated_log()) + tool_outputs[:12],
        "json": _pieces(
            "\n".join(json.dumps(m, separators=(",", ":")) for p in transcripts for m in _transcript_texts(p))
        )[:12]
        + _pieces(
            json.dumps(json.loads((ROOT / "test" / "js" / "package-lock.json").read_text()), separators=(",", ":")),
            2000,
        )[:6],
        "base64": blobs,
        "cjk": [line for line in cjk if line.strip()],
        "other scripts": [
            line for line in (DATA / "samples" / "other-scripts.txt").read_text(encoding="utf-8").splitlines() if line
        ],
    }


CORPUS = DATA / "corpus"  # see test/data/corpus/SOURCES.md: sources, licenses, and which half is held back
PIECE_SIZES = (200, 500, 1000, 2000, 4000)  # characters: messages as agents send them, from a line to a file


def corpus() -> list[dict[str, str]]:
    """The manifest of the token-estimate corpus: every document's file, class, part (fit/held), source."""
    return json.loads((CORPUS / "manifest.json").read_text(encoding="utf-8"))


def corpus_pieces(part: str | None = None) -> list[tuple[str, str, str]]:
    """(class, part, text) of every piece of every corpus document (of ``part`` only, when given): each document
    cut at line ends into pieces of sizes drawn from :data:`PIECE_SIZES` (seeded by the file's name)."""
    out = []
    for entry in corpus():
        if part is not None and entry["part"] != part:
            continue
        text = (CORPUS / entry["file"]).read_text(encoding="utf-8")
        rng, start = random.Random(entry["file"]), 0
        while start < len(text):
            size = rng.choice(PIECE_SIZES)
            end = min(len(text), start + size)
            if end < len(text):
                cut = text.rfind("\n", start + size // 2, end)
                end = cut + 1 if cut > start else end
            out.append((entry["class"], entry["part"], text[start:end]))
            start = end
    return out


# --- shapes the corpus has little of, generated from its own documents' words ----------------------------------------
GENERATED_PIECES = 24  # pieces of each shape in each part
COMMON_WORDS = 800  # "common": the words (4 to 8 letters) and Han characters a part's documents use most


def _part_text(klass: str, part: str) -> str:
    return "\n".join(
        (CORPUS / e["file"]).read_text(encoding="utf-8") for e in corpus() if (e["class"], e["part"]) == (klass, part)
    )


def _common(items: list[str], keep: int) -> list[str]:
    return [item for item, _ in collections.Counter(items).most_common(keep)]


START = datetime.datetime(2026, 1, 1)


def _record(rng: random.Random, words: list[str]) -> dict:
    """A generated record: ids, numbers, dates, flags, names and addresses, a nested list and object."""
    word = lambda: rng.choice(words)  # noqa: E731
    return {
        "id": rng.randint(1, 10**9),
        "uuid": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
        "name": f"{word().title()} {word().title()}",
        "email": f"{word()}.{word()}{rng.randint(1, 99)}@example.org",
        "created": f"{START + datetime.timedelta(seconds=rng.randrange(10**8)):%Y-%m-%dT%H:%M:%SZ}",
        "active": rng.random() < 0.5,
        "score": round(rng.uniform(0, 1000), rng.randint(0, 4)),
        "parent": None if rng.random() < 0.3 else rng.randint(1, 10**6),
        "tags": [word() for _ in range(rng.randint(0, 4))],
        "address": {"street": f"{rng.randint(1, 999)} {word().title()} Street", "zip": f"{rng.randint(0, 99999):05d}"},
    }


def _shapes(rng: random.Random, part: str) -> dict[str, Callable[[int], str]]:
    """Each shape: a text of about ``size`` characters, from the words of this part's documents."""
    english = _part_text("English prose", part)
    words = re.findall(r"[a-z]+", english)
    common = _common([w for w in words if 4 <= len(w) <= 8], COMMON_WORDS)
    han = _common(re.findall(r"[\u4e00-\u9fff]", _part_text("Chinese", part)), COMMON_WORDS)

    def run(pick: Callable[[], str], sep: str = " ") -> Callable[[int], str]:
        return lambda size: sep.join(pick() for _ in range(max(1, size // 7)))

    legal = re.findall(r"[A-Z]+", _part_text("capitals (legal)", part))

    def capitals(size: int) -> str:
        sentences = []
        while sum(map(len, sentences)) < size:
            words = [rng.choice(legal) for _ in range(rng.randint(8, 30))]
            sentences.append(", ".join(" ".join(words[i : i + 6]) for i in range(0, len(words), 6)) + ".")
        return " ".join(sentences)

    return {
        "English word runs": run(lambda: rng.choice(common)),
        "Title Case words": run(lambda: rng.choice(common).title()),
        "legal words in capitals": capitals,
        "JSON records": lambda size: json.dumps(
            [_record(rng, common) for _ in range(1 + size // 400)], separators=(",", ":")
        ),
        "Han characters": lambda size: "".join(rng.choice(han) for _ in range(size // 2)),
    }


def generated_pieces(part: str | None = None) -> list[tuple[str, str, str]]:
    """(class, part, text) of generated shapes: runs of common 4-8-letter English words (plain and Title Case),
    sentences of the words of the licenses' disclaimers in capitals, minified JSON records, random common Han
    characters. The fitted pieces draw on the fitted documents' words, the held-back ones on the held-back
    documents' (seeded)."""
    out = []
    for name in ("fit", "held") if part is None else (part,):
        rng = random.Random(f"generated-{name}")
        for klass, make in _shapes(rng, name).items():
            out += [(klass, name, make(rng.choice(PIECE_SIZES))) for _ in range(GENERATED_PIECES)]
    return out
