"""gpuguard's code parses, and its regular expressions compile, on Python 3.10 (Ubuntu 22.04).

mypy (python_version 3.10) and ruff (py310) check the library's names; this checks what they do
not: 3.11 grammar (``except*``) and 3.11 regular-expression syntax (possessive quantifiers,
atomic groups), which 3.10 rejects at import time - the package would install on Ubuntu 22.04
and then fail on every start. CI also runs the suites under CPython 3.10 (.ci/run); this check
holds where no 3.10 interpreter is at hand (the Debian archive has none).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SOURCES = sorted((Path(__file__).resolve().parents[2] / "src/gpuguard").rglob("*.py"))
# A quantifier followed by "+" (possessive: a*+ a++ a?+ a{2}+) or "(?>" (atomic group).
_NEWER_REGEX = re.compile(r"(?<!\\)[*+?}]\+|\(\?>")


def patterns(tree: ast.AST) -> list[str]:
    """The literal patterns of every re.compile/match/search/fullmatch/sub/split call."""
    return [
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "re"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ]


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: path.name)
def test_parses_as_python_310_without_newer_regex_syntax(path: Path) -> None:
    """The module is 3.10 grammar; none of its literal patterns uses 3.11-only syntax."""
    tree = ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
    newer = [pattern for pattern in patterns(tree) if _NEWER_REGEX.search(pattern)]
    assert newer == [], f"{path}: Python 3.10's re cannot compile {newer}"


def test_the_check_finds_possessive_quantifiers_and_except_star() -> None:
    """The checks can fail: a possessive quantifier and except* are found."""
    assert patterns(ast.parse('re.compile(r"[^:]*+:")'))[0] == "[^:]*+:"
    assert _NEWER_REGEX.search("[^:]*+:")
    assert _NEWER_REGEX.search(r"(?>a|b)c")
    assert not _NEWER_REGEX.search(r"[^&#\s]*\+")
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* OSError:\n    pass\n", feature_version=(3, 10))
