"""The shape rules of src/ (issue 49): no module over 500 lines and no function over 60; and no
measured figure or date of measurement in a comment or docstring (issue 61).

Small modules with one job and functions that fit on a screen are what let a newcomer read the code;
these tests name every file and function that breaks a rule, with its length, so a regression is
caught where it is made rather than in the next review. A figure copied into the code goes stale
where no one re-measures it: the code keeps the reason, docs/results/ keeps the figure with its date
and command, and the code links there.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _long_functions(path: Path) -> list[str]:
    """`path:line name (n lines)` for each function or method (nested ones too) over the limit.

    A function's length runs from its `def` line to its last line, decorators excluded.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({length} lines)")
    return sorted(found)


def test_src_is_found():
    assert len(_modules()) > 50, f"expected ferry's sources under {SRC}"


def test_no_module_over_500_lines():
    long = [
        f"{path.relative_to(SRC)} ({n} lines)"
        for path in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, f"{len(long)} modules over {MAX_MODULE_LINES} lines (split them by job):\n" + "\n".join(long)


def test_no_function_over_60_lines():
    long = [entry for path in _modules() for entry in _long_functions(path)]
    assert not long, f"{len(long)} functions over {MAX_FUNCTION_LINES} lines (name their parts):\n" + "\n".join(long)


# A date of measurement (an ISO day, not the timestamp of an example output: 2026-01-02T03:04:05).
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b(?!T\d)")
THROUGHPUT = re.compile(r"\d[\d,.]*\s*tokens/s\b")
# a figure after a verb of measuring in the same sentence: "measured ... 15.5 ms", "ran 1.077x faster"
MEASURING = re.compile(r"\b(?:measured|ran|took|timed)\b", re.IGNORECASE)
FIGURE = re.compile(r"\b\d+(?:[.,]\d+)*(?:\s?(?:GiB|MiB|GB|MB|ms|us|s)\b|x\b|%)")


def _notes(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment block (consecutive comment lines joined) and every string
    statement (docstrings, attribute docstrings) in `path`: the prose, never the code."""
    source = path.read_text()
    comments = [
        (token.start[0], token.string.lstrip("#").strip())
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    blocks: list[tuple[int, str]] = []
    for line, text in comments:
        if blocks and line == blocks[-1][0] + blocks[-1][1].count("\n") + 1:
            blocks[-1] = (blocks[-1][0], blocks[-1][1] + "\n" + text)
        else:
            blocks.append((line, text))
    strings = [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(source, filename=str(path)))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]
    return blocks + strings


def lab_notes(path: Path, root: Path = SRC) -> list[str]:
    """`path:line: sentence` for each date, throughput or figure after a verb of measuring in a
    comment or docstring of `path`."""
    found = []
    for line, text in _notes(path):
        for sentence in re.split(r"\.\s+", " ".join(text.split())):
            verb = MEASURING.search(sentence)
            if DATE.search(sentence) or THROUGHPUT.search(sentence) or (verb and FIGURE.search(sentence, verb.end())):
                found.append(f"{path.relative_to(root)}:{line}: {sentence[:160]}")
    return found


def test_measured_figures_and_dates_live_in_the_docs():
    notes = [entry for path in _modules() for entry in lab_notes(path)]
    assert not notes, (
        f"{len(notes)} comments or docstrings carry a measured figure or a date: move the figure to "
        "docs/results/ (with its date and command) and keep the reason here, linking there:\n" + "\n".join(notes)
    )
