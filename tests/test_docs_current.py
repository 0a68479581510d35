"""The user docs (README.md, docs/*.md) against the repository: names and numbers that drift.

Each test reads the docs as a new user would and compares a fact with its source: the
quickstart's figures with docs/performance.md's measurement, the full set's size with the
builder's registry, the catalog schema with the code, the API reference with ``__all__``; and
no wording from working notes reaches the user docs.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

import aotriton_rt
from aotriton_rt.catalog import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parent.parent
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Working-note wording, as (regex, what it is). Matched case-insensitively on the raw text.
INTERNAL = [
    (r"\bsessions?\b", "a numbered working period ('first session', 'device session')"),
    (r"(?<![-/])\blevers?\b", "'lever(s)': say what the change or optimisation is"),
    (r"\bacceptance grid\b", "'the acceptance grid': the benchmark grid"),
    (r"\bGPU-[0-9a-f]{8}", "a GPU serial number"),
    (r"\bthe H200 machine\b", "'the H200 machine': the H200 host"),
    (r"\bissue #?\d+\b|\bissues #\d+", "an issue number"),
]
#: An issue number written as "#14" (configs are "#0".."#9"); fenced code blocks are left out,
#: as tool output there quotes tuning rules ("rule #14 of ...").
ISSUE_HASH = re.compile(r"(?<![\w#])#\d{2,}\b")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _internal_words(text: str) -> list[str]:
    found = []
    for pattern, what in INTERNAL:
        for m in re.finditer(pattern, text, re.I):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"line {line}: {m.group(0)!r} ({what})")
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in ISSUE_HASH.finditer(prose):
        found.append(f"line {prose.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r} (an issue number)")
    return found


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_user_docs_hold_no_working_note_words(path):
    found = _internal_words(_read(path))
    assert not found, f"{path.name} uses working-note wording:\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "measured in the sixth session", "the first session's table", "Lever B", "two build-time levers",
    "the acceptance grid", "H200 `GPU-3c52f3aa`", "on the H200 machine", "kept with issue 25", "see #14",
])
def test_internal_word_check_catches_working_notes(text):
    assert _internal_words(text)


@pytest.mark.parametrize("text", [
    "`bench/sm90_levers.py --levers ws,ours`", "config #0, #6 and #7", "the image issues 32 scalar loads",
    "```\nrule #14 of tuning['attn_fwd']\n```",
])
def test_internal_word_check_spares_names_and_configs(text):
    assert not _internal_words(text)


def _quickstart_figures(text: str, where: str) -> tuple[str, int, int]:
    """(wall time "M min S s", variants, seconds of building) of the quickstart sentence."""
    wall = re.search(r"(\d+ min \d+ s)", text)
    variants = re.search(r"(\d+) variants", text)
    building = re.search(r"(\d+)(?:\.\d+)? s(?: of it)? (?:of )?building", text)
    assert wall and variants and building, f"{where}: no quickstart wall time, variant count and building time"
    return wall.group(1), int(variants.group(1)), int(building.group(1))


def test_readme_quickstart_figures_are_performance_md_measurement():
    readme = _read(ROOT / "README.md")
    quick = readme[readme.index("## Quickstart"):readme.index("## Installing from wheels")]
    perf = _read(ROOT / "docs" / "performance.md")
    section = perf[perf.index("## Build time and sizes"):]
    headline = section[section.index("**Measured now"):section.index("| default set |")]
    assert "examples/quickstart.sh" in headline and "clean clone" in headline
    assert _quickstart_figures(quick, "README.md") == _quickstart_figures(headline, "docs/performance.md")


@functools.cache
def _full_set_count() -> int:
    """What `python -m builder list --set full` counts for the default targets."""
    from builder import registry, targets

    kernels = registry.load_kernels()
    chosen = targets.parse_targets("default")
    return sum(len(registry.expand(k, chosen, "full", "3.6.0")) for k in kernels.values())


def test_catalog_md_full_set_size_is_the_registry_count():
    pytest.importorskip("triton", reason="the builder's registry imports the kernels, which need triton")
    count = _full_set_count()
    text = _read(ROOT / "docs" / "catalog.md")
    m = re.search(r"tens of thousands of variants \((?:about )?([\d ]+?) for the seven default", text)
    assert m, "docs/catalog.md no longer states the full set's size"
    assert int(m.group(1).replace(" ", "")) == count, (
        f"docs/catalog.md says {m.group(1)} full-set variants; `python -m builder list --set full` counts {count}")


def test_builder_md_and_readme_full_set_size_is_the_registry_count():
    pytest.importorskip("triton", reason="the builder's registry imports the kernels, which need triton")
    count = _full_set_count()
    builder = _read(ROOT / "docs" / "builder.md")
    m = re.search(r"`python -m builder list --set full`: ([\d,]+) variants for the seven default", builder)
    assert m, "docs/builder.md no longer states the full set's size in 'How long the full set takes'"
    assert int(m.group(1).replace(",", "")) == count, f"docs/builder.md says {m.group(1)}; the registry counts {count}"
    m = re.search(r"The full set\s+\(([\d,]+) variants", _read(ROOT / "README.md"))
    assert m and int(m.group(1).replace(",", "")) == count, f"README.md's full-set size is not {count}"


def test_noimage_md_examples_carry_the_catalog_schema_version():
    text = _read(ROOT / "docs" / "noimage.md")
    found = [int(v) for v in re.findall(r'"catalog_schema_version":\s*(\d+)', text)]
    assert found, "docs/noimage.md shows no catalog_schema_version"
    assert set(found) == {SCHEMA_VERSION}, (
        f"docs/noimage.md shows {found}; the code's SCHEMA_VERSION is {SCHEMA_VERSION}")


def test_api_md_documents_every_public_name():
    text = _read(ROOT / "docs" / "api.md")
    missing = [n for n in aotriton_rt.__all__ if not re.search(rf"`aotriton_rt\.{re.escape(n)}\b", text)]
    assert not missing, f"docs/api.md has no `aotriton_rt.NAME` entry for: {', '.join(missing)}"


PERFORMANCE_MD = ROOT / "docs" / "performance.md"
#: The page's structure: current results per product benchmark, what was tried, how it is measured.
PERFORMANCE_SECTIONS = [
    "Current results",
    "Attention forward and backward",
    "Against cuDNN and FlashAttention (SDPA backends)",
    "Against the Triton JIT",
    "Decode",
    "Host cost per call and the first call",
    "Launch overhead",
    "JAX under `jax.jit`",
    "Build time and sizes",
    "What a variant costs to compile",
    "The cost of private global scratch per stream",
    "What we tried",
    "Methodology",
]


def _headings(text: str) -> set[str]:
    prose = FENCE.sub("", text)
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", prose, re.M)}


def test_performance_md_is_one_page_of_current_results():
    text = _read(PERFORMANCE_MD)
    lines = text.count("\n") + (not text.endswith("\n"))
    assert lines < 350, f"docs/performance.md has {lines} lines; keep it under 350 (history lives in git)"
    missing = [s for s in PERFORMANCE_SECTIONS if s not in _headings(text)]
    assert not missing, f"docs/performance.md lacks the sections: {missing}"


def test_docs_cite_performance_md_sections_that_exist():
    """A doc that names a section ("docs/performance.md", "Launch overhead") names a real heading."""
    headings = _headings(_read(PERFORMANCE_MD))
    cited = []
    for path in [*USER_DOCS, *sorted((ROOT / "builder").rglob("*.py")), *sorted((ROOT / "aotriton_rt").rglob("*.py"))]:
        text = re.sub(r"\s*\n\s*(?:#:?\s*)?", " ", _read(path))  # join wrapped lines and comment prefixes
        for m in re.finditer(r"performance\.md`?\)?,\s+\"([^\"]+)\"", text):
            cited.append((path.relative_to(ROOT), m.group(1)))
    assert cited, "no doc cites a section of docs/performance.md any more; is the pattern stale?"
    stale = [f"{p}: {name!r}" for p, name in cited if name not in headings]
    assert not stale, "sections of docs/performance.md cited but missing:\n" + "\n".join(stale)
