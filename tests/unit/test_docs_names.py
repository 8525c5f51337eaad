"""The documentation names only what exists: every ``lightning_bfpp.…`` name in backticks resolves, and every
repository path in backticks or in a relative link (with a test name after ``::``, that test) is there."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import lightning_bfpp  # noqa: F401  (imported at collection, as the rest of the unit tier does)

REPO = Path(__file__).resolve().parents[2]
PATH_PREFIXES = ("lightning_bfpp/", "tests/", "benchmarks/", "examples/", "docs/")
TEST_FOLDERS = ("tests/distributed", "tests/unit")  # where a bare `test_x.py` is looked for

FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")  # may wrap lines, not paragraphs
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DOTTED = re.compile(r"\blightning_bfpp(?:\.[A-Za-z_]\w*)+")
BARE_TEST_FILE = re.compile(r"^test_\w+\.py$")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _text_outside_fences(doc: Path) -> str:
    return FENCE.sub("", doc.read_text(encoding="utf-8"))


def _resolves(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute path below the longest importable module prefix."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module_name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            continue
        if cut == len(parts):
            return True  # a module: found without running it (an optional dependency may be missing)
        try:
            target = importlib.import_module(module_name)
        except ImportError:
            return False
        for attribute in parts[cut:]:
            try:
                target = getattr(target, attribute)
            except (AttributeError, ImportError):
                return False
        return True
    return False


def _existing(pattern: str, base: Path) -> list[Path]:
    """The files ``pattern`` names under ``base``; ``*`` and placeholders such as ``<N>`` match any text."""
    pattern = re.sub(r"<[^<>/]*>", "*", pattern).rstrip("/")
    if "*" in pattern:
        return sorted(base.glob(pattern))
    return [base / pattern] if (base / pattern).exists() else []


def _missing_tests(file: Path, names: list[str]) -> list[str]:
    text = file.read_text(encoding="utf-8")
    return [n for n in names if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(n)}\b", text, re.M)]


def _check_path(reference: str, base: Path, bare_tests: bool) -> str | None:
    """What is wrong with a path reference (``None``: nothing); ``::name`` parts must be functions or classes of
    the file, ``[…]`` parameters and ``#anchors`` are left out."""
    path, *tests = reference.split("::")
    path = path.split("#", 1)[0]
    tests = [re.sub(r"\[.*\]$", "", t) for t in tests]
    if not path:
        return None
    if bare_tests and BARE_TEST_FILE.match(path):
        candidates = [f for folder in TEST_FOLDERS if (f := REPO / folder / path).exists()]
        if not candidates:
            return f"no {path} in {' or '.join(TEST_FOLDERS)}"
    else:
        candidates = _existing(path, base)
        if not candidates:
            return "no such file or folder"
    files = [f for f in candidates if f.is_file()]
    if tests and (not files or all(_missing_tests(f, tests) for f in files)):
        return f"no test {', '.join(tests)} in {path}"
    return None


def _path_tokens(span: str) -> list[str]:
    """The words of a code span that are repository paths (or bare test files), trailing punctuation left off."""
    tokens = []
    for word in span.split():
        word = word.strip("\"'()[],;").rstrip(":.")
        word = re.sub(r"^[\w-]+=", "", word)  # --out=docs/x.json
        if word.startswith(PATH_PREFIXES) or BARE_TEST_FILE.match(word.split("::")[0]):
            tokens.append(word)
    return tokens


def unresolved() -> list[str]:
    problems = []
    for doc in doc_files():
        where = doc.relative_to(REPO)
        text = _text_outside_fences(doc)
        for span in CODE_SPAN.findall(text):
            for name in DOTTED.findall(span):
                if not _resolves(name):
                    problems.append(f"{where}: `{name}` does not resolve")
            for token in _path_tokens(span):
                if (why := _check_path(token, REPO, bare_tests=True)) is not None:
                    problems.append(f"{where}: `{token}`: {why}")
        for target in LINK.findall(CODE_SPAN.sub("", text)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # a URL, or an anchor on the same page
            if (why := _check_path(target, doc.parent, bare_tests=False)) is not None:
                problems.append(f"{where}: link ({target}): {why}")
    return sorted(set(problems))


def test_every_name_and_path_in_the_docs_exists():
    problems = unresolved()
    assert not problems, f"{len(problems)} stale name(s) or path(s) in the docs:\n" + "\n".join(problems)
