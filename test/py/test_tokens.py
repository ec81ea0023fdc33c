"""Counting you can trust: tokenizer choice, the fitted heuristic, tools, reserve, server counting,
window discovery and overflow parsing."""

from __future__ import annotations

import collections
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from builders import COOKBOOK, conversation, user
from conftest import load_session, session_files
from hypothesis import given, settings
from hypothesis import strategies as st
from samples import corpus_pieces, generated_pieces, samples

import context_shrink as cs

pytestmark = pytest.mark.core  # the fast loop: ./test/test.sh --fast

# --------------------------------------------------------------------------- tokenizer choice


@pytest.mark.parametrize("spec", ["auto", "server", "heuristic", "tiktoken", "tiktoken:o200k_base", " TikToken "])
def test_tokenizer_specs(spec: str) -> None:
    assert cs.parse_tokenizer_spec(spec) == spec.strip().lower()


@pytest.mark.parametrize("spec", ["", "sentencepiece", "tiktoken:", "tiktoken:../x", 5])
def test_bad_tokenizer_specs(spec: Any) -> None:
    with pytest.raises(cs.ContextShrinkError, match="is not one of auto, server"):
        cs.parse_tokenizer_spec(spec)


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4o", "o200k_base"),
        ("gpt-4o-mini-2024-07-18", "o200k_base"),
        ("gpt-4.1-nano", "o200k_base"),
        ("gpt-5", "o200k_base"),
        ("o1", "o200k_base"),
        ("o3-mini", "o200k_base"),
        ("openai/o4-mini", "o200k_base"),
        ("gpt-4", "cl100k_base"),
        ("gpt-3.5-turbo", "cl100k_base"),
        ("qwen3-4b", "cl100k_base"),
        ("ollama3", "cl100k_base"),
        (None, "cl100k_base"),
    ],
)
def test_encoding_for_model(model: str | None, encoding: str) -> None:
    assert cs.encoding_for_model(model) == encoding


def test_o200k_unavailable_falls_back_to_cl100k(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiktoken

    real = tiktoken.get_encoding

    def only_cl100k(name: str) -> Any:
        if name.startswith("o200k"):
            raise ConnectionError("offline")
        return real(name)

    monkeypatch.setattr(tiktoken, "get_encoding", only_cl100k)
    cs.resolve_tokenizer.cache_clear()
    try:
        tokenizer = cs.resolve_tokenizer("auto", "gpt-4o")
        assert tokenizer.name == "tiktoken:cl100k_base"
        assert "o200k_base" in tokenizer.note and "counting with tiktoken cl100k_base" in tokenizer.note
    finally:
        cs.resolve_tokenizer.cache_clear()


def test_config_reads_the_new_settings() -> None:
    config = cs.Config.from_env(
        {
            "CONTEXT_SHRINK_TOKENIZER": "tiktoken:o200k_base",
            "CONTEXT_SHRINK_CHAT_FORMAT": "ChatML",
            "CONTEXT_SHRINK_MAX_CONTEXT_TOKENS": "auto",
            "CONTEXT_SHRINK_RESERVE_TOKENS": "2048",
            "CONTEXT_SHRINK_BASE_URL": "http://127.0.0.1:8080/v1",
        }
    )
    assert (config.tokenizer, config.chat_format, config.max_context_tokens) == (
        "tiktoken:o200k_base",
        "chatml",
        "auto",
    )
    assert config.reserve_tokens == 2048 and config.base_url_configured
    with pytest.raises(cs.ConfigError, match="CONTEXT_SHRINK_CHAT_FORMAT"):
        cs.Config.from_env({"CONTEXT_SHRINK_CHAT_FORMAT": "vicuna"})


# --------------------------------------------------------------------------- the content-aware heuristic


@pytest.fixture(scope="module")
def cl100k() -> cs.Tokenizer:
    return cs.resolve_tokenizer("tiktoken:cl100k_base")


@pytest.mark.parametrize("name", list(samples()))
def test_heuristic_near_cl100k_on_the_hand_made_samples(cl100k: cs.Tokenizer, name: str) -> None:
    """Samples the fit never sees (test/py/samples.py): never 5 % under; over by less than a fifth, a quarter for
    the small hand-written multi-script set (its Russian paragraph is counted 43 % high: cl100k knows Russian better
    than the other Cyrillic languages the corpus has, and an overestimate only trims early)."""
    texts = samples()[name]
    ratio = sum(cs.heuristic_tokens(t) for t in texts) / sum(cl100k.count(t) for t in texts)
    assert 0.95 <= ratio <= (1.25 if name == "other scripts" else 1.2), f"{name}: heuristic / cl100k = {ratio:.3f}"


@pytest.mark.parametrize("path", session_files(), ids=lambda p: p.stem[:40])
def test_heuristic_never_far_under_on_a_transcript(cl100k: cs.Tokenizer, path: Path) -> None:
    messages = load_session(path)
    exact = cs.count_messages(messages, cl100k)[1]
    estimate = cs.count_messages(messages, cs.HEURISTIC)[1]
    assert 0.95 <= estimate / exact <= 1.2, f"heuristic / cl100k = {estimate / exact:.3f}"  # over is safe


def test_heuristic_beats_chars_over_four_where_it_matters(cl100k: cs.Tokenizer) -> None:
    for name in ("cjk", "base64", "json"):
        texts = samples()[name]
        exact = sum(cl100k.count(t) for t in texts)
        assert sum(len(t) for t in texts) / 4 < 0.8 * exact  # chars/4 is far under
        assert sum(cs.heuristic_tokens(t) for t in texts) >= 0.95 * exact


def test_heuristic_features_and_sum_agree() -> None:
    text = "Привет, 世界! def f(x): return x*2  # 0xdeadbeef नमस्ते 😀 " * 200  # long: sampled
    kind, gaps, scripts, inside = cs.heuristic_features(text)
    names, own = cs.HEURISTIC_CLASSES, cs.HEURISTIC_KIND_GAPS.get(kind, {})
    weight = lambda pair: own.get((names[pair // 16], names[pair % 16]), cs.HEURISTIC_GAPS[pair // 16][pair % 16])  # noqa: E731
    raw = sum(n * weight(pair) for pair, n in enumerate(gaps)) / cs.HEURISTIC_GAP_UNIT + inside
    raw += 1 + sum(cs.HEURISTIC_SCRIPT_WEIGHTS[name] * n for name, n in scripts.items())
    assert abs(cs.heuristic_tokens(text) - raw) <= 1
    assert {"Cyrillic (U+0400-U+043F)", "Han", "Devanagari", "emoji (U+1E000-U+1FFFF)"} <= set(scripts)
    assert inside > 0  # the number's pieces of three digits, and the tokens inside its Han characters
    sample = cs.HEURISTIC_SAMPLE
    assert sum(gaps) == pytest.approx((sample - 1) * len(text) / sample)  # every gap of the sample, scaled


HELD_BACK = corpus_pieces("held") + generated_pieces("held")


@pytest.mark.parametrize("klass", sorted({klass for klass, _, _ in HELD_BACK}))
def test_the_estimate_is_right_by_class_on_the_held_back_corpus(cl100k: cs.Tokenizer, klass: str) -> None:
    """The fitted heuristic on the half of the corpus its fit never saw (test/data/corpus), and on the generated
    shapes drawn from that half's words: every class within +10 % of cl100k and none more than 5 % under (an
    underestimate is refused by the server)."""
    texts = [text for c, _, text in HELD_BACK if c == klass]
    ratio = sum(map(cs.heuristic_tokens, texts)) / sum(map(cl100k.count, texts))
    assert 0.95 <= ratio <= 1.10, f"{klass}: heuristic / cl100k = {ratio:.3f} on {len(texts)} held-back pieces"


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**60), st.sampled_from(["", " ", "x", "id=", "-", "0."]))
def test_a_number_is_cut_into_pieces_of_three_digits_as_cl100k_cuts_it(
    cl100k: cs.Tokenizer, n: int, before: str
) -> None:
    """Right by construction, not fitted: cl100k's pre-tokenizer cuts a run of digits into pieces of at most three
    (``\\p{N}{1,3}``), so the tokens inside a number are counted, not estimated."""
    digits = str(n)
    assert 1 + cs.heuristic_features(digits)[3] == cl100k.count(digits)
    assert cs.heuristic_features(before + digits)[3] == (len(digits) - 1) // 3


def test_every_han_character_is_weighed_at_the_tokens_cl100k_makes_of_it(cl100k: cs.Tokenizer) -> None:
    """HAN_TOKENS is cl100k's own count for each Han character alone (1 to 3): the tokens inside a Han
    character are read off it, for every one of U+4000-U+9FFF (random common characters were 22 % under when one
    rate per character was fitted to prose)."""
    first, last = cs.HAN_FIRST, 0x9FFF
    for code in range(first, last + 1):
        char = chr(code)
        assert cs.heuristic_features(char)[3] == cl100k.count(char) - 1, hex(code)


WORDS = """about above across action after again against almost along already always among animal answer around became
because become before began begin behind being below better between bring brought build built called cannot
carry caught center certain change children circle city class clear close color common complete could country
course cover cross dance death decide deep develop different direction doctor dollar during early earth eight
either energy enough equal even evening every example except explain family farmer father field figure final
finger finish follow force forest found friend front garden general girl given glass govern great green ground
group happen heard heart heavy history horse house human hundred idea important inch island itself knowledge
language large later laugh learn leave letter light little machine market matter measure middle might minute
modern money month morning mother mountain music nation nature near never night north nothing notice number
object ocean office often order other paper party people perhaps period person picture piece place plain plant
point position power present problem produce product public question quick quite reach ready reason record
region remember report rest result river rock round science second section seem sentence serve settle several
shape short should side simple since single sister small social soldier something sound south space speak
special spell spring square stand start state station still stone story street strong student study subject
suggest summer surface system table teacher there these thing think third those though thought thousand three
through together toward town track trade travel tree trouble under until usual valley village voice water
weather week weight where which while white whole window winter without woman women wonder word work world would
write written young""".split()  # noqa: SIM905
LEGAL = """THE SOFTWARE IS PROVIDED AS WITHOUT WARRANTY OF ANY KIND EXPRESS OR IMPLIED INCLUDING BUT NOT LIMITED TO
WARRANTIES MERCHANTABILITY FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT IN NO EVENT SHALL AUTHORS
COPYRIGHT HOLDERS BE LIABLE CLAIM DAMAGES OTHER LIABILITY WHETHER AN ACTION CONTRACT TORT OTHERWISE ARISING FROM
OUT CONNECTION WITH USE DEALINGS THIS BY CONTRIBUTORS DISCLAIMED DIRECT INDIRECT INCIDENTAL SPECIAL EXEMPLARY
CONSEQUENTIAL PROCUREMENT SUBSTITUTE GOODS SERVICES LOSS DATA PROFITS BUSINESS INTERRUPTION HOWEVER CAUSED ON
THEORY STRICT NEGLIGENCE WAY EVEN IF ADVISED POSSIBILITY SUCH DAMAGE THERE PROGRAM EXTENT PERMITTED APPLICABLE
LAW EXCEPT WHEN STATED WRITING PARTIES ENTIRE RISK AS QUALITY PERFORMANCE WITH YOU SHOULD PROVE DEFECTIVE ASSUME
COST ALL NECESSARY SERVICING REPAIR CORRECTION""".split()  # noqa: SIM905
HAN = (
    "的一是不了人我在有他这中大来上个国到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可里后小么心多天而能好都然没日"
    "于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点"
    "月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并"
    "内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反"
)


def issue_shapes(rng: random.Random) -> dict[str, str]:
    """The shapes an attack run found far off, generated here from lists of this file (not the corpus's)."""
    words = [w for w in WORDS if 4 <= len(w) <= 8]

    def record() -> dict[str, Any]:
        return {"id": rng.randint(1, 10**12), "name": f"{rng.choice(words).title()} {rng.choice(words).title()}",
                "email": f"{rng.choice(words)}{rng.randint(1, 999)}@example.com", "active": rng.random() < 0.5,
                "score": round(rng.random() * 100, rng.randint(0, 6)), "lat": rng.uniform(-90, 90),
                "tags": [rng.choice(words) for _ in range(rng.randint(0, 4))], "parent": None}  # fmt: skip

    def legal() -> str:
        return " ".join(" ".join(rng.choice(LEGAL) for _ in range(rng.randint(8, 30))) + "." for _ in range(8))

    def nested(depth: int = 0) -> Any:  # #58: snake_case keys of common words, any value, lists and objects
        if depth < 3 and rng.random() < 0.3:
            return ({"_".join(rng.choice(words) for _ in range(rng.randint(1, 3))): nested(depth + 1)
                     for _ in range(rng.randint(1, 5))} if rng.random() < 0.6 else
                    [nested(depth + 1) for _ in range(rng.randint(1, 4))])  # fmt: skip
        return rng.choice(
            [
                rng.randint(0, 10**6),
                -rng.randint(1, 5000),
                round(rng.uniform(-99, 99), 3),
                rng.choice(words),
                f"{rng.choice(words)}-{rng.randint(1, 999)}",
                True,
                False,
                None,
            ]
        )

    return {
        "runs of common 4-8-letter English words": " ".join(rng.choice(words) for _ in range(rng.randint(50, 500))),
        "legal text in capitals": legal(),
        "minified JSON records": json.dumps([record() for _ in range(rng.randint(3, 40))], separators=(",", ":")),
        "minified JSON of nested records": json.dumps([nested(1) for _ in range(60)], separators=(",", ":"))[:4300],
        "random common Han characters": "".join(rng.choice(HAN) for _ in range(rng.randint(100, 1500))),
        "random Han characters": "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(rng.randint(100, 1500))),
    }


@pytest.mark.parametrize("shape", list(issue_shapes(random.Random(0))))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_estimate_is_right_on_shapes_generated_apart_from_the_corpus(
    cl100k: cs.Tokenizer, shape: str, seed: int
) -> None:
    """Each shape within +10 % of cl100k and none more than 5 % under, over 30 texts of it (were: English words
    2.27x, capitals 2.32x, JSON records 0.95x, random Han 0.53x; common Han was right, its characters mostly one
    token each)."""
    rng = random.Random(seed)
    texts = [issue_shapes(rng)[shape] for _ in range(30)]
    ratio = sum(map(cs.heuristic_tokens, texts)) / sum(map(cl100k.count, texts))
    assert 0.95 <= ratio <= 1.10, f"{shape}: heuristic / cl100k = {ratio:.3f}"


def utf8_length(name: str) -> int:
    ranges = cs.HEURISTIC_SCRIPTS[name]
    return int(name[6]) if not ranges else 2 if ranges[0][0] < 0x800 else 3 if ranges[0][0] < 0x10000 else 4


def test_every_script_is_weighed_and_every_weight_keeps_the_sum_exact() -> None:
    assert set(cs.HEURISTIC_SCRIPT_WEIGHTS) == set(cs.HEURISTIC_SCRIPTS)
    assert set(cs.HEURISTIC_KIND_GAPS) == set(cs.HEURISTIC_KINDS) - {"ascii"}
    assert len(cs.HEURISTIC_GAPS) == len(cs.HEURISTIC_CLASSES) == 16 and all(
        len(row) == 16 for row in cs.HEURISTIC_GAPS
    )
    weights = [w for row in cs.HEURISTIC_GAPS for w in row]
    weights += [w for extra in cs.HEURISTIC_KIND_GAPS.values() for w in extra.values()]
    assert all(0 <= w <= 127 for w in weights)  # a half of a sample's gaps stays below adler32's modulus
    for name, rate in cs.HEURISTIC_SCRIPT_WEIGHTS.items():  # no more tokens than bytes; the unknown at its bytes
        assert rate >= utf8_length(name) if name.startswith("other ") else 0 <= rate <= 1.1 * utf8_length(name), name
    spans = sorted(span for ranges in cs.HEURISTIC_SCRIPTS.values() for span in ranges)
    for (low, high), (after, _) in zip(spans, [*spans[1:], (0x110000, 0)], strict=True):
        block = 64 if high < 0x10000 else 4096  # what the lead byte, or the lead and the second byte, tell apart
        assert low % block == 0 and (high + 1) % block == 0 and high < after, (hex(low), hex(high))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=2 * cs.HEURISTIC_SAMPLE + 1), st.integers(0, 127))
def test_the_gap_sum_is_exact_at_any_size_and_weight(pairs: list[int], top: int) -> None:
    """A sample's gaps are summed by adler32, ADLER_SPAN at a time, without wrapping, whatever the weights."""
    weights = bytes([top]) * 256
    even, odd = bytes(pairs[::2]), bytes(pairs[1::2])
    assert cs._weighed((even, odd), weights) == top * len(pairs)


UNLISTED = st.sampled_from([(0x1800, 0x18A8), (0x2C00, 0x2C5E), (0x2D30, 0x2D67), (0xA980, 0xA9CD), (0x0800, 0x082D),
                            (0x1D400, 0x1D4FF), (0x10330, 0x1034A), (0x13000, 0x1342E), (0xE000, 0xF8FF)])  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(blocks=st.lists(UNLISTED, min_size=1, max_size=3), data=st.data())
def test_a_block_the_corpus_lacks_is_never_under_cl100k(
    cl100k: cs.Tokenizer, blocks: list[tuple[int, int]], data: st.DataObject
) -> None:
    """Mongolian, Glagolitic, Tifinagh, Javanese, Samaritan, math letters, Gothic, hieroglyphs, the private use
    area: weighed at their UTF-8 length per character, the most tokens a byte-level BPE can make of one."""
    alphabet = st.one_of([st.characters(min_codepoint=lo, max_codepoint=hi) for lo, hi in blocks] + [st.just(" ")])
    text = data.draw(st.text(alphabet, min_size=1, max_size=400))
    assert cs.heuristic_tokens(text) >= cl100k.count(text)


def script_of(char: str) -> str:
    """The script a character belongs to, straight from HEURISTIC_SCRIPTS' ranges."""
    code = ord(char)
    for name, ranges in cs.HEURISTIC_SCRIPTS.items():
        if any(low <= code <= high for low, high in ranges):
            return name
    return "other 4-byte characters" if code >= 0x10000 else "other 3-byte characters"


@settings(max_examples=300, deadline=None)
@given(
    st.text(
        st.characters(codec=None, exclude_categories=()) | st.sampled_from(" a.\n\u200d\u2014\u201c\u201d\uff0c"),
        max_size=1000,
    )
)
def test_every_character_counts_once_in_its_own_script(text: str) -> None:
    """Whatever the lead byte (one script, or several told apart by the second byte), each character that is not
    ASCII is counted once, in the script whose range holds it."""
    expected = collections.Counter(script_of(c) for c in text if ord(c) >= 0x80)
    assert cs._script_counts(text.encode("utf-8", "surrogatepass")) == expected


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("The committee met on Tuesday and agreed to publish the report of the working group. " * 3, "ascii"),
        ("Setiap orang berhak atas kebebasan berpikir, berkeyakinan dan beragama; hak ini mencakup " * 3, "plain"),
        ("Toute personne a droit à la liberté de pensée, de conscience et de religion ; ce droit " * 3, "latin"),
        ("def tokens(text: str) -> int:\n    return max(1, len(text) // 4)  # rough\n" * 3, "ascii"),
        ("人人有思想、良心和宗教自由的权利\uff1b此项权利包括改变他的宗教或信仰的自由。" * 3, "ascii"),
        ('THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED. ' * 3, "capitals"),
        ("garden mountain picture letter simple family river though school picture " * 3, "ascii"),  # no "the"
        ("Kila mtu ana haki ya uhuru wa mawazo, dhamira na dini; haki hii inajumuisha uhuru " * 3, "plain"),
    ],
)
def test_the_kind_tells_languages_apart(text: str, kind: str) -> None:
    assert cs._measured(text)[1] == kind


def agent_shapes() -> dict[str, str]:
    """Shapes agents send that the corpus has little of, built from common words."""
    rnd = random.Random(1)
    words = ["the", "request", "message", "context", "window", "model", "token", "server", "history", "agent"]
    pick = lambda: rnd.choice(words)  # noqa: E731
    return {
        "Title Case": " ".join(pick().title() for _ in range(300)),
        "markdown headings": "\n".join(f"## {pick().title()} {pick().title()} {pick()}" for _ in range(100)),
        "names": "\n".join(f"{rnd.choice(['Ada', 'Linus', 'Grace', 'Alan'])} {pick().title()}" for _ in range(100)),
        "paths": "\n".join(f"/home/user/{pick()}/{pick()}_{pick()}.py:{rnd.randint(1, 999)}" for _ in range(100)),
        "urls": "\n".join(f"https://example.com/{pick()}/{pick()}?id={rnd.randint(1, 99999)}" for _ in range(100)),
        "snake_case": " ".join("_".join(pick() for _ in range(3)) for _ in range(100)),
        "UPPER_CASE": " ".join("_".join(pick().upper() for _ in range(2)) for _ in range(100)),
        "typographic prose": " ".join(
            pick() + rnd.choice(["", "", "\u2014", "\u2019s", "\u201d", "\u2026"]) for _ in range(300)
        ),
    }


@pytest.mark.parametrize("name", list(agent_shapes()))
def test_the_estimate_is_never_far_under_on_shapes_the_corpus_lacks(cl100k: cs.Tokenizer, name: str) -> None:
    """Generated shapes, not fitted on: never a third under (the fit holds every gap near what cl100k does there,
    so a shape the corpus lacks still costs about its word starts)."""
    text = agent_shapes()[name]
    ratio = cs.heuristic_tokens(text) / cl100k.count(text)
    assert 0.67 <= ratio <= 2.5, f"{name}: heuristic / cl100k = {ratio:.3f}"


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(codec=None, exclude_categories=()), max_size=3000))
def test_the_estimate_takes_any_text(text: str) -> None:
    """Any string, lone surrogates (JSON can carry one) and control characters included: a count, never an error."""
    tokens = cs.heuristic_tokens(text)
    assert tokens >= (1 if text else 0)


def test_cache_counts_each_text_once() -> None:
    calls: list[str] = []
    cached = cs.cached_count(lambda t: calls.append(t) or len(t), max_chars=100)
    assert [cached("x" * 40), cached("x" * 40), cached("y" * 40)] == [40, 40, 40]
    assert len(calls) == 2
    cached.__self__.begin(40)  # type: ignore[attr-defined]  # a new pass: what the last one stored may go
    cached("z" * 40)  # 120 chars > 100: the oldest entry goes
    cached("x" * 40)
    assert len(calls) == 4


def history_texts(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"message {k} " + "word " * 40} for k in range(start, start + n)]


@pytest.mark.parametrize("cap", [2_000, 20_000])
def test_a_history_larger_than_the_cache_is_not_counted_again(cap: int) -> None:
    """A bound smaller than one history made the history evict its own start while it was counted: every
    warm pass missed on every text (30,000 messages warm took longer than cold, #30). Now a pass over a
    history counted before misses only what is new, at any size against the bound."""
    misses: list[str] = []
    tok = cs.Tokenizer("counting", cs.cached_count(lambda t: misses.append(t) or len(t) // 4, max_chars=cap))
    history = history_texts(400)  # ~90,000 characters: far over either bound
    cs.count_messages(history, tok)
    first = len(misses)
    cs.count_messages([dict(m) for m in history], tok)  # the same texts, as fresh objects
    assert len(misses) == first  # warm: nothing counted again
    for turn in range(20):  # the history grows every turn; each pass costs what changed, not the history
        history += history_texts(5, start=400 + 5 * turn)
        before = len(misses)
        cs.count_messages(history, tok)
        assert len(misses) - before <= 2 * 5 + 1, (turn, len(misses) - before)  # the new, and as many evicted


def test_the_count_cache_stays_bounded_over_many_histories() -> None:
    """Many distinct conversations, each counted a few times: the cache keeps about the bound, not all."""
    count = cs.cached_count(lambda t: len(t) // 4, max_chars=50_000)
    tok, cache = cs.Tokenizer("counting", count), count.__self__  # type: ignore[attr-defined]
    for other in range(200):
        history = [{"role": "user", "content": f"{other} {k} " + "word " * 40} for k in range(20)]
        for _ in range(3):
            cs.count_messages(history, tok)
    held = sum(map(len, cache))
    assert held <= 50_000 + sum(len(m["content"]) for m in history) + 1000, held


# --------------------------------------------------------------------------- what counts


def test_cookbook_tools_example(cl100k: cs.Tokenizer) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_current_weather",
                "description": "Get the current weather in a given location",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                        "unit": {
                            "type": "string",
                            "description": "The unit of temperature to return",
                            "enum": ["celsius", "fahrenheit"],
                        },
                    },
                    "required": ["location"],
                },
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You are a helpful assistant that can answer to questions about the weather."},
        {"role": "user", "content": "What's the weather like in San Francisco?"},
    ]
    # The cookbook's figure for gpt-4 / gpt-3.5-turbo (cl100k_base), verified there against the API.
    assert cs.count_messages(messages, cl100k)[1] + cs.count_tools(tools, cl100k) == 105
    nested = json.loads(json.dumps(tools))
    nested[0]["function"]["parameters"]["properties"]["options"] = {
        "type": "object",
        "properties": {"depth": {"type": "integer", "description": "How deep to look"}},
    }
    assert cs.count_tools(nested, cl100k) > cs.count_tools(tools, cl100k) + 10


@pytest.mark.parametrize(
    ("tools", "expected"),
    [
        ({}, "tools must be a list"),
        ([{"type": "function"}], "tools[0].function.name"),
        ([{"function": {"name": "x", "description": 3}}], "tools[0].function.description"),
        ([{"function": {"name": "x", "parameters": []}}], "tools[0].function.parameters"),
    ],
)
def test_bad_tools(tools: Any, expected: str) -> None:
    with pytest.raises(cs.ContextShrinkError) as info:
        cs.validate_tools(tools)
    assert expected in str(info.value)


def test_chat_formats_change_the_overhead(cl100k: cs.Tokenizer) -> None:
    chatml = cs.resolve_tokenizer("tiktoken:cl100k_base", None, "chatml")
    messages = conversation(2, size=3)
    openai_total = cs.count_messages(messages, cl100k)[1]
    assert cs.count_messages(messages, chatml)[1] == openai_total + len(messages) * (4 - 3)
    with pytest.raises(cs.ContextShrinkError, match="chat format"):
        cs.resolve_tokenizer("auto", None, "vicuna")


def test_tools_and_reserve_shrink_the_budget(cl100k: cs.Tokenizer) -> None:
    messages = conversation(6, size=100)
    tools = [{"type": "function", "function": {"name": "bash", "description": "run a command " * 100}}]
    plain = cs.trim_messages(messages, cl100k, 3000, keep_last=2, strategy="drop")
    with_tools = cs.trim_messages(messages, cl100k, 3000, keep_last=2, tools=tools, reserve_tokens=500, strategy="drop")
    assert with_tools["tools_tokens"] > 200 and with_tools["reserve_tokens"] == 500
    assert with_tools["tokens_after"] <= 2500 and with_tools["fits"]
    assert with_tools["dropped"] > plain["dropped"]
    assert (
        with_tools["tokens_after"] == cs.count_messages(with_tools["messages"], cl100k)[1] + with_tools["tools_tokens"]
    )
    estimate = cs.estimate_messages(messages, cl100k, 3000, tools=tools, reserve_tokens=500)
    assert estimate["remaining"] == 2500 - estimate["tokens"]
    with pytest.raises(cs.ContextShrinkError, match="reserve_tokens"):
        cs.trim_messages(messages, cl100k, 3000, reserve_tokens=3000)


# --------------------------------------------------------------------------- overflow refusals

OVERFLOWS: list[tuple[Any, int | None, int | None]] = [
    (
        {
            "error": {
                "code": 400,
                "message": "request (6010 tokens) exceeds the available context size (2048 tokens), try increasing it",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": 6010,
                "n_ctx": 2048,
            }
        },
        2048,
        6010,
    ),
    ("input (9000 tokens) is larger than the max context size (8192 tokens). skipping", 8192, 9000),
    (
        {
            "object": "error",
            "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
            "(4500 in the messages, 500 in the completion). Please reduce the length of the messages or completion.",
            "type": "BadRequestError",
        },
        4096,
        4500,
    ),
    (
        "This model's maximum context length is 8192 tokens. However, your request has 9100 input tokens. "
        "Please reduce the length of the input messages.",
        8192,
        9100,
    ),
    (
        "'max_tokens' or 'max_completion_tokens' is too large: 1000. This model's maximum context length is "
        "4096 tokens and your request has 3500 input tokens (1000 > 4096 - 3500).",
        4096,
        3500,
    ),
    (
        "You passed 7000 input tokens and requested 1000 output tokens. However, the model's context length is "
        "only 4096 tokens, resulting in a maximum input length of 3096 tokens. Please reduce the length of the "
        "input prompt.",
        4096,
        7000,
    ),
    (
        {
            "error": {
                "message": "This model's maximum context length is 32768 tokens. However, you requested 1024 output "
                "tokens and your prompt contains at least 32769 input tokens, for a total of at least 33793 tokens. "
                "Please reduce the length of the input prompt or the number of requested output tokens. "
                "(parameter=input_tokens, value=32769)",
                "type": "BadRequestError",
                "param": "input_tokens",
                "code": 400,
            }
        },
        32768,
        32769,
    ),
    (
        {
            "object": "error",
            "message": "The input (5000 tokens) is longer than the model's context length (4096 tokens).",
            "type": "BadRequest",
        },
        4096,
        5000,
    ),
    (
        "Requested token count exceeds the model's maximum context length of 8192 tokens. You requested a total "
        "of 9000 tokens: 8000 tokens from the input messages and 1000 tokens for the completion.",
        8192,
        8000,
    ),
    (
        "Input length (9000 tokens) exceeds the maximum allowed length (8192 tokens). Use a shorter input or "
        "enable --allow-auto-truncate.",
        8192,
        9000,
    ),
    (
        {
            "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 "
            "`inputs` tokens and 200 `max_new_tokens`",
            "error_type": "validation",
        },
        4096,
        4000,
    ),
    ({"error": "Input validation error: `inputs` must have less than 4096 tokens. Given: 5000"}, 4096, 5000),
    (
        {
            "error": {
                "message": "the prompt is longer than the context length currently available to the model; shorten "
                "the prompt, adjust the context length in settings, or use a model with a longer context length",
                "type": "invalid_request_error",
            }
        },
        None,
        None,
    ),
    (
        {
            "error": '{"error":{"code":400,"message":"request (5000 tokens) exceeds the available context size '
            '(4096 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":5000,'
            '"n_ctx":4096}}'
        },
        4096,
        5000,
    ),
    ("the input length exceeds the context length", None, None),
    (
        {
            "error": "Trying to keep the first 9000 tokens when context the overflows. However, the model is loaded "
            "with context length of only 4096 tokens, which is not enough. Try to load the model with a larger "
            "context length, or provide a shorter input"
        },
        4096,
        9000,
    ),
    (
        {
            "error": "The number of tokens to keep from the initial prompt is greater than the context length "
            "(n_keep: 9000>= n_ctx: 4096). Try to load the model with a larger context length, or provide a "
            "shorter input."
        },
        4096,
        9000,
    ),
    (
        {
            "error": {
                "message": "Prompt too long: 40000 tokens exceeds max context window of 32768 tokens",
                "type": "invalid_request_error",
            }
        },
        32768,
        40000,
    ),
    ("prompt is too long: 40000 tokens > 32768 maximum; the prompt exceeds max context window of 32768", 32768, 40000),
    (
        {
            "error": {
                "code": 500,
                "message": "rpc error: code = Internal desc = request (5000 tokens) exceeds the available context "
                "size (4096 tokens), try increasing it",
                "type": "",
            }
        },
        4096,
        5000,
    ),
    (
        {
            "error": {
                "message": "litellm.ContextWindowExceededError: litellm.BadRequestError: OpenAIException - This "
                "model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens. "
                "Please reduce the length of the messages.",
                "code": "400",
            }
        },
        8192,
        9000,
    ),
    (
        {
            "error": {
                "message": "This model's maximum context length is 128000 tokens. However, your messages resulted in "
                "130000 tokens. Please reduce the length of the messages.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
        128000,
        130000,
    ),
    (
        {
            "error": {
                "message": "Your input exceeds the context window of this model. Please adjust your input and try "
                "again.",
                "param": "input",
            }
        },
        None,
        None,
    ),
    (
        "Input tokens exceed the configured limit of 272000 tokens. Your messages resulted in 509178 tokens. "
        "Please reduce the length of the messages.",
        272000,
        509178,
    ),
    (
        {
            "error": {
                "message": "Provider returned error",
                "code": 400,
                "metadata": {
                    "raw": '{"object":"error","message":"This model\'s maximum context length is 32768 tokens. '
                    "However, you requested 33000 tokens (32000 in the messages, 1000 in the completion). Please "
                    'reduce the length of the messages or completion.","type":"BadRequestError"}',
                    "provider_name": "Parasail",
                },
            }
        },
        32768,
        32000,
    ),
    (
        "This endpoint's maximum context length is 131072 tokens. However, you requested about 140000 tokens "
        '(140000 of text input). Please reduce the length of either one, or use the "middle-out" transform.',
        131072,
        140000,
    ),
    (
        {
            "error": {
                "message": "Please reduce the length of the messages or completion.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
        None,
        None,
    ),
    (
        {
            "error": {
                "message": "This model's maximum context length is 131072 tokens. However, you requested 140000 "
                "tokens (139000 in the messages, 1000 in the completion). Please reduce the length of the messages "
                "or completion.",
                "type": "invalid_request_error",
                "code": "invalid_request_error",
            }
        },
        131072,
        139000,
    ),
    ("Prompt contains 40000 tokens, too large for model with 32768 maximum context length", 32768, 40000),
    ("The input (40000 tokens) is longer than the model's context length (32768 tokens).", 32768, 40000),
    ("Please reduce the length of the messages or completion. Current length is 9000 while limit is 8192", 8192, 9000),
]


@pytest.mark.parametrize(("body", "limit", "prompt"), OVERFLOWS)
def test_every_overflow_shape_is_recognised(body: Any, limit: int | None, prompt: int | None) -> None:
    overflow = cs.parse_overflow(body)
    assert overflow is not None
    assert (overflow.limit, overflow.prompt_tokens) == (limit, prompt)


def test_vllm_lower_bound_is_flagged() -> None:
    assert cs.parse_overflow(OVERFLOWS[6][0]).at_least is True
    assert cs.parse_overflow(OVERFLOWS[0][0]).at_least is False


@pytest.mark.parametrize(
    "body",
    [
        {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}},
        {"error": "model 'llama3' not found"},
        "Internal Server Error",
        None,
        {"detail": "Not Found"},
    ],
)
def test_other_errors_are_not_overflows(body: Any) -> None:
    assert cs.parse_overflow(body) is None


def test_wire_capture_of_llama_server_is_recognised() -> None:
    wire = Path(__file__).resolve().parents[1] / "data" / "wire"
    for name in ("chat_overflow_error.json", "chat_overflow_error_stream.json", "completion_prompt_2048_tokens.json"):
        overflow = cs.parse_overflow(json.loads((wire / name).read_text()))
        assert overflow is not None and overflow.limit == 2048 and overflow.prompt_tokens >= 2048


# --------------------------------------------------------------------------- server counting and discovery (mock)


def backend(handler: Callable[[httpx2.Request], httpx2.Response], caches: cs.BackendCaches | None = None) -> cs.Backend:
    client = httpx2.AsyncClient(transport=httpx2.MockTransport(handler))
    return cs.Backend(client, "http://srv.test/v1", caches=caches or cs.BackendCaches())


def routes(table: dict[str, Any]) -> tuple[Callable[[httpx2.Request], httpx2.Response], list[str]]:
    seen: list[str] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        key = f"{request.method} {request.url.path}"
        seen.append(key)
        if key in table:
            return httpx2.Response(200, json=table[key])
        return httpx2.Response(404, json={"error": {"message": "File Not Found", "type": "not_found_error"}})

    return handler, seen


@pytest.mark.parametrize(
    ("table", "expected", "method"),
    [
        ({"POST /v1/chat/completions/input_tokens": {"input_tokens": 77}}, 77, cs.COUNT_METHODS[0]),
        (
            {"POST /apply-template": {"prompt": "<|im_start|>"}, "POST /tokenize": {"tokens": [1, 2, 3]}},
            3,
            cs.COUNT_METHODS[1],
        ),
        ({"POST /tokenize": {"count": 42, "max_model_len": 4096, "tokens": []}}, 42, cs.COUNT_METHODS[2]),
        ({"POST /chat_tokenize": {"tokenize_response": [{"id": 1}] * 9}}, 9, cs.COUNT_METHODS[3]),
    ],
)
def test_server_counting_methods(table: dict[str, Any], expected: int, method: str) -> None:
    handler, seen = routes(table)
    b = backend(handler)
    assert anyio.run(lambda: b.count_tokens([user("hi")])) == (expected, method)
    probes = len(seen)
    assert anyio.run(lambda: b.count_tokens([user("hi")])) == (expected, method)
    assert len(seen) - probes == len(seen[:probes]) - seen[:probes].index(seen[probes])  # only the known method


def test_server_that_cannot_count_is_remembered() -> None:
    handler, seen = routes({})
    caches = cs.BackendCaches()
    with pytest.raises(cs.ContextShrinkError, match="cannot count tokens"):
        anyio.run(lambda: backend(handler, caches).count_tokens([user("hi")]))
    probes = len(seen)
    with pytest.raises(cs.ContextShrinkError, match="cannot count tokens"):
        anyio.run(lambda: backend(handler, caches).count_tokens([user("hi")]))
    assert len(seen) == probes  # not probed again


@pytest.mark.parametrize(
    ("table", "window", "source"),
    [
        ({"GET /props": {"default_generation_settings": {"n_ctx": 4096}}}, 4096, "llama.cpp /props"),
        ({"GET /v1/models": {"data": [{"id": "m", "meta": {"n_ctx": 2048}}]}}, 2048, "/v1/models"),
        ({"GET /v1/models": {"data": [{"id": "x"}, {"id": "m", "max_model_len": 32768}]}}, 32768, "/v1/models"),
        ({"GET /v1/models": {"data": [{"id": "m", "context_window": 131072}]}}, 131072, "/v1/models"),
        ({"GET /v1/models": {"data": [{"id": "m", "context_length": 200000}]}}, 200000, "/v1/models"),
        ({"GET /v1/models": {"data": [{"id": "m", "max_context_length": 128000}]}}, 128000, "/v1/models"),
        ({"GET /api/ps": {"models": [{"name": "m", "context_length": 8192}]}}, 8192, "Ollama /api/ps"),
        (
            {"POST /api/show": {"model_info": {"general.architecture": "qwen3", "qwen3.context_length": 40960}}},
            40960,
            "Ollama /api/show",
        ),
        ({"POST /api/show": {"parameters": "num_ctx                        16384"}}, 16384, "Ollama /api/show"),
        ({"GET /info": {"max_input_tokens": 8191, "max_total_tokens": 8192}}, 8191, "TGI /info"),
        (
            {"GET /api/v0/models": {"data": [{"id": "m", "max_context_length": 32768, "loaded_context_length": 8192}]}},
            8192,
            "LM Studio /api/v0/models",
        ),
    ],
)
def test_window_discovery(table: dict[str, Any], window: int, source: str) -> None:
    handler, seen = routes(table)
    b = backend(handler)
    assert anyio.run(lambda: b.context_window("m")) == (window, source)
    calls = len(seen)
    assert anyio.run(lambda: b.context_window("m")) == (window, source)
    assert len(seen) == calls  # cached


def test_window_discovery_failure_names_every_probe() -> None:
    handler, _ = routes({})
    with pytest.raises(cs.ContextShrinkError) as info:
        anyio.run(lambda: backend(handler).context_window("m"))
    for probe in ("llama.cpp /props", "/v1/models", "Ollama /api/ps", "TGI /info"):
        assert probe in str(info.value)


def test_chat_errors_carry_the_overflow() -> None:
    body = OVERFLOWS[0][0]
    b = backend(lambda r: httpx2.Response(400, json=body))
    with pytest.raises(cs.ContextShrinkError) as info:
        anyio.run(lambda: b.chat("m", [user("x")], 16))
    assert info.value.overflow == cs.Overflow(2048, 6010)


def test_cookbook_messages_still_129(cl100k: cs.Tokenizer) -> None:
    assert cs.count_messages(COOKBOOK, cl100k)[1] == 129


def test_a_request_the_server_rejects_is_not_remembered_as_unsupported() -> None:
    seen: list[str] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.url.path)
        message = "Cannot continue an assistant message that contains tool calls."
        return httpx2.Response(400, json={"error": {"code": 400, "message": message, "type": "invalid_request_error"}})

    caches = cs.BackendCaches()
    for _ in range(2):
        with pytest.raises(cs.ContextShrinkError, match="Cannot continue an assistant message"):
            anyio.run(lambda: backend(handler, caches).count_tokens([user("hi")]))
    assert seen.count("/v1/chat/completions/input_tokens") == 2  # asked again: it may be this request only


def test_a_warm_trim_of_a_history_larger_than_the_cache_counts_only_what_is_new() -> None:
    """A trim counts the whole history and many parts of it (spans, candidates): the parts must not push the
    history out of the cache (a bound following only the latest passes did, 30,000 messages warm: 1.5 s).
    With a bound far below the history, repeated trims count exactly what an unbounded cache counts."""

    def misses_with(cap: int) -> list[int]:
        misses: list[str] = []
        tok = cs.Tokenizer("counting", cs.cached_count(lambda t: misses.append(t) or len(t) // 4, max_chars=cap))
        history, counted = conversation(60, size=300), []
        for turn in range(6):
            history += [user(f"turn {60 + turn}: and now file_{turn}.txt " + "word " * 300)]
            cs.trim_messages([dict(m) for m in history], tok, 4000, target_ratio=0.6 if turn % 2 else 1.0)
            counted.append(len(misses))
        return counted

    assert misses_with(2_000) == misses_with(10**9)
