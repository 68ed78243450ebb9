"""The shape rules of src/ (issue 49): no module over 500 lines and no function over 60.

Small modules with one job and functions that fit on a screen are what let a newcomer read the code;
these tests name every file and function that breaks a rule, with its length, so a regression is
caught where it is made rather than in the next review.
"""

import ast
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
