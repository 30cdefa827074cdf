"""The user documents say how things are now, and what they name exists: README length, every command
and path in README.md, docs/ and BENCHMARKS.md, no session or run numbers in user documents, every
option documented, the flag table as the engine builds it, and benchmarks/results holding only the
runs BENCHMARKS.md cites. No ComfyUI, no GPU."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
BENCHMARKS = REPO / "BENCHMARKS.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
USER_DOCS = [README, *DOCS]
ALL_DOCS = [*USER_DOCS, BENCHMARKS]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
MAX_README_LINES = 250
MAX_BENCHMARKS_LINES = 400
#: a path-like code span under these prefixes lives on the user's machine, not in this repository
FOREIGN = ("ComfyUI/", "user/", "models/", "input/", "output/", "jobs/", "custom_nodes", "<", "$", "~", "http",
           "comfy_extras/", "comfy_api", "/", "torch.", "out/")
INTERPRETERS = {"python", "python3", ".venv/bin/python", "$PY"}


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in paths]


def _code_spans(text: str) -> list[str]:
    """Inline code spans and the lines of fenced code blocks (shell prompts and comments dropped)."""
    spans = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                spans.append(line)
    spans += re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))
    return spans


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), flags=re.M))


def _module_file(module: str) -> Path | None:
    base = REPO / Path(*module.split("."))
    for cand in (base.with_suffix(".py"), base / "__main__.py"):
        if cand.is_file():
            return cand
    return None


def _check_command(cmd: str) -> str | None:
    """None if the command's program, script, module or target exists here, else what is missing."""
    for part in re.split(r"\s*(?:&&|\|\||;)\s*", cmd):
        try:
            words = shlex.split(part)
        except ValueError:
            words = part.split()
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]  # VAR=value prefixes
        if not words or words[0] == "cd":
            continue
        prog, args = words[0], words[1:]
        if prog == "make":
            missing = [t for t in args if "=" not in t and t not in _makefile_targets()]
            if missing:
                return f"make targets {missing} are not in the Makefile"
        elif prog in INTERPRETERS:
            if args[:1] == ["-m"]:
                module = args[1]
                if module in ("pytest", "pip", "ruff"):
                    continue
                src = _module_file(module)
                if src is None:
                    return f"module {module} does not exist"
                sub = next((a for a in args[2:] if not a.startswith("-") and not a.startswith("<")
                            and "/" not in a and "." not in a), None)
                if sub and sub not in src.read_text():
                    return f"{module} has no {sub!r} command"
            elif args and not args[0].startswith("-") and not (REPO / args[0]).exists():
                return f"script {args[0]} does not exist"
        elif prog == "comfy" and args[:2] == ["node", "install"] and len(args) > 2:
            if args[2] != PYPROJECT["project"]["name"]:
                return f"the registry name is {PYPROJECT['project']['name']!r}, not {args[2]!r}"
        elif prog == "git" and args[:1] == ["clone"] and len(args) > 1:
            if args[1] != PYPROJECT["project"]["urls"]["Repository"]:
                return f"the repository is {PYPROJECT['project']['urls']['Repository']}, not {args[1]}"
        elif prog == "pip" and "-r" in args[:-1]:
            req = args[args.index("-r") + 1]
            if not (REPO / Path(req).name).is_file():
                return f"{req} does not exist"
        elif prog.startswith(("scripts/", "benchmarks/", "./")) and not (REPO / prog).exists():
            return f"{prog} does not exist"
    return None


def _is_command(span: str) -> bool:
    first = span.split()[0] if span.split() else ""
    return " " in span and (first in {"make", "cd", "comfy", "git", "pip", *INTERPRETERS}
                            or first.startswith(("scripts/", "NEXFORT_")))


def _is_path(span: str) -> bool:
    return (" " not in span and not span.startswith(FOREIGN) and "*" not in span and "{" not in span
            and ("/" in span or re.search(r"\.(py|md|json|sh|txt|toml|png|jpg)$", span) is not None)
            and re.fullmatch(r"[\w./-]+", span) is not None)


@pytest.mark.parametrize("doc", ALL_DOCS, ids=_ids(ALL_DOCS))
def test_every_command_a_document_names_exists(doc):
    bad = {}
    for span in _code_spans(doc.read_text()):
        if _is_command(span):
            problem = _check_command(span)
            if problem:
                bad[span] = problem
    assert not bad, f"{doc.name}: {bad}"


@pytest.mark.parametrize("doc", ALL_DOCS, ids=_ids(ALL_DOCS))
def test_every_path_a_document_names_exists(doc):
    text = doc.read_text()
    missing = []
    for span in _code_spans(text):
        if _is_path(span):
            rel = span.rstrip("/")
            # a bare file name (`prewarm.json`, `child.log`) is a file the pack writes, not ours
            if "/" not in rel and not (REPO / rel).exists() and not (doc.parent / rel).exists():
                continue
            if not (REPO / rel).exists() and not (doc.parent / rel).exists():
                missing.append(span)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        if not (doc.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_the_readme_is_short_and_for_users():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    text = README.read_text()
    for heading in ("## Install", "## The nodes", "## Which preset", "## The compile cache", "## Troubleshooting",
                    "## What it does not do", "## Performance"):
        assert heading in text, f"README.md has no {heading!r} section"
    assert text.count("<!-- perf-table:start -->") == 1 and text.count("<!-- perf-table:end -->") == 1
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("doc", USER_DOCS, ids=_ids(USER_DOCS))
def test_user_documents_carry_no_session_or_run_numbers(doc):
    text = doc.read_text()
    found = re.findall(r"\b\w+(?:-\w+)? session\b|\bsessions? \d+|\bruns? ?\d{1,3}\b|\brun\d+", text, flags=re.I)
    found = [f for f in found if not re.match(r"(?i)(the|a|one|each|whole|this) session", f)]
    assert not found, f"{doc.name}: history belongs in git log, not in a user document: {found[:10]}"


def test_benchmarks_is_current_and_compact():
    text = BENCHMARKS.read_text()
    lines = text.splitlines()
    assert len(lines) <= MAX_BENCHMARKS_LINES, f"BENCHMARKS.md has {len(lines)} lines (at most {MAX_BENCHMARKS_LINES})"
    assert text.count("<!-- per-image:start -->") == 1 and text.count("<!-- per-image:end -->") == 1
    assert not re.search(r"status after the \w+ session", text), "BENCHMARKS.md keeps a session diary"


def test_benchmark_results_hold_only_what_benchmarks_cites():
    """Every run directory under benchmarks/results is cited by BENCHMARKS.md (the rest is in git
    history), and together they stay small."""
    results = REPO / "benchmarks" / "results"
    if not results.is_dir():
        return
    text = BENCHMARKS.read_text()
    files = [p for p in results.rglob("*") if p.is_file()]
    uncited = sorted({str(p.relative_to(REPO).parent) for p in files
                      if not any(str(parent.relative_to(REPO)) in text
                                 for parent in [p, *p.parents] if results in parent.parents)})
    assert not uncited, f"not cited by BENCHMARKS.md (delete them): {uncited[:10]}"
    size = sum(p.stat().st_size for p in files)
    assert size <= 2 * 1024 * 1024, f"benchmarks/results holds {size:,} bytes (at most 2 MiB)"


def test_every_option_is_documented():
    from nexfort_engine.options import PRESETS, TOP_LEVEL_KEYS

    text = (REPO / "docs" / "modes.md").read_text()
    missing = [k for k in (*TOP_LEVEL_KEYS, *PRESETS) if f"`{k}`" not in text]
    assert not missing, f"docs/modes.md does not document {missing}"


def test_the_flag_table_is_the_engines():
    from nexfort_engine.settings import flag_table

    text = (REPO / "docs" / "modes.md").read_text()
    block = re.search(r"<!-- flag-table:start[^>]*-->\n(.*?)\n<!-- flag-table:end -->", text, flags=re.S)
    assert block, "docs/modes.md has no flag-table markers"
    assert block.group(1) == flag_table(), (
        "docs/modes.md's flag table differs from nexfort_engine.settings.flag_table(): paste its output")
