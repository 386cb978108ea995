"""No swallow-all ``except`` without a word on what it swallows (issue 36).

An ``except Exception``, ``except BaseException`` or bare ``except`` whose
handler neither raises nor uses the exception hides every error behind it,
the ones nobody thought of included.  Such a handler is allowed only with
a comment, on the ``except`` line or the first line of its body, saying
what is swallowed and why.  Handlers that re-raise, or that name the
exception (``except Exception as exc:`` and use ``exc``), are not
swallowing and need no comment.
"""

from __future__ import annotations

import ast
import pathlib
import tokenize

import pytest

import gpucx

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(gpucx.__file__).parent

_BROAD = {"Exception", "BaseException"}


def _is_broad(handler: ast.ExceptHandler) -> bool:
    t = handler.type
    if t is None:
        return True
    names = t.elts if isinstance(t, ast.Tuple) else [t]
    return any(isinstance(n, ast.Name) and n.id in _BROAD for n in names)


def _swallows(handler: ast.ExceptHandler) -> bool:
    """The handler neither raises nor reads the exception it caught."""
    for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
        if isinstance(node, ast.Raise):
            return False
        if handler.name and isinstance(node, ast.Name) and node.id == handler.name:
            return False
    return True


def _comment_lines(path: pathlib.Path) -> set[int]:
    with path.open("rb") as f:
        return {
            tok.start[0]
            for tok in tokenize.tokenize(f.readline)
            if tok.type == tokenize.COMMENT
        }


def silent_swallows(path: pathlib.Path) -> list[int]:
    """The line of each swallow-all handler in ``path`` with no comment."""
    tree = ast.parse(path.read_text(), str(path))
    comments = _comment_lines(path)
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.ExceptHandler)
        and _is_broad(node)
        and _swallows(node)
        and not comments & set(range(node.lineno, node.body[0].lineno + 1))
    )


def test_no_silent_swallow_all_handlers() -> None:
    found = [
        f"{path.relative_to(ROOT.parent)}:{line}"
        for path in sorted(ROOT.rglob("*.py"))
        for line in silent_swallows(path)
    ]
    assert not found, (
        "swallow-all except without a comment saying what it swallows and why:\n  "
        + "\n  ".join(found)
    )


def test_finder_sees_a_silent_swallow(tmp_path: pathlib.Path) -> None:
    probe = tmp_path / "mod.py"
    probe.write_text(
        "try:\n    f()\nexcept Exception:\n    pass\n"  # 3: silent
        "try:\n    f()\nexcept BaseException:\n    g()\n    raise\n"  # re-raises
        "try:\n    f()\nexcept Exception as exc:\n    log(exc)\n"  # uses it
        "try:\n    f()\nexcept Exception:  # f may fail at exit: nobody cares\n"
        "    pass\n"
        "try:\n    f()\nexcept:\n    x = None\n"  # 20: bare, silent
        "try:\n    f()\nexcept (OSError, Exception):\n"
        "    # the comment may open the body\n    pass\n"
        "try:\n    f()\nexcept OSError:\n    pass\n"  # narrow: not this rule's
    )
    assert silent_swallows(probe) == [3, 20]
