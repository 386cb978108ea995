"""Every public name, method and property says what it does."""

from __future__ import annotations

import inspect

import pytest

import gpucx
import gpucx.aio
import gpucx.mem
import gpucx.ops.rma
import gpucx.protocols

pytestmark = pytest.mark.timeout(30)


def _undocumented(owner_name, cls):
    missing = []
    for attr, val in vars(cls).items():
        if attr.startswith("_"):
            continue
        fn = val.fget if isinstance(val, property) else val
        if (callable(fn) or isinstance(val, property)) and not (
            getattr(fn, "__doc__", None) or ""
        ).strip():
            missing.append(f"{owner_name}.{attr}")
    return missing


def test_every_public_name_is_documented():
    missing = []
    modules = [
        ("gpucx", gpucx),
        ("gpucx.mem", gpucx.mem),
        ("gpucx.ops.rma", gpucx.ops.rma),
        ("gpucx.protocols", gpucx.protocols),
    ]
    for modname, mod in modules:
        for name in mod.__all__:
            obj = getattr(mod, name)
            if name.startswith("__") or isinstance(obj, (int, str, tuple)):
                continue
            if not (obj.__doc__ or "").strip():
                missing.append(f"{modname}.{name}")
            if inspect.isclass(obj):
                missing += _undocumented(f"{modname}.{name}", obj)
    for cls in (gpucx.aio.Worker, gpucx.aio.Endpoint, gpucx.aio.ProgressThread):
        missing += _undocumented(f"gpucx.aio.{cls.__name__}", cls)
    assert missing == []


def test_reliability_promises_point_at_real_tests():
    """Every test and test file docs/reliability.md names exists, so a
    promise cannot outlive the test that holds gpucx to it."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    text = (root / "docs" / "reliability.md").read_text()
    sources = "\n".join(p.read_text() for p in (root / "tests").rglob("*.py"))
    names = set(re.findall(r"\b(test_\w+)(?![\w.])", text))
    paths = set(re.findall(r"`(tests/[\w/]+\.py|benchmarks/[\w/]+\.py)", text))
    assert len(names) > 20 and paths
    missing = [n for n in sorted(names) if f"def {n}(" not in sources]
    missing += [p for p in sorted(paths) if not (root / p).is_file()]
    assert missing == []


# -- code blocks of the guides (docs/*.md, the mkdocs site) and the README --------

_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def _python_blocks():
    """``(file:line, source)`` of every fenced ```python block."""
    import re

    blocks = []
    for path in sorted((_ROOT / "docs").rglob("*.md")) + [_ROOT / "README.md"]:
        text = path.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S):
            line = text.count("\n", 0, m.start()) + 1
            blocks.append((f"{path.relative_to(_ROOT)}:{line}", m.group(1)))
    return blocks


def _is_program(src: str) -> bool:
    first = next(ln for ln in src.splitlines() if ln.strip())
    return first.startswith(("import ", "from "))


_BLOCKS = _python_blocks()
# A block of a guide that starts with an import is a complete program: it runs.
# The README's opening example needs a peer on another host: it only compiles.
_PROGRAMS = [
    (where, src)
    for where, src in _BLOCKS
    if where.startswith("docs/") and _is_program(src)
]


@pytest.mark.parametrize("where,src", _BLOCKS, ids=[w for w, _ in _BLOCKS])
def test_code_block_is_python(where, src):
    """Every ```python block parses (signature listings are ```text)."""
    compile(src, where, "exec")


def test_there_are_runnable_examples():
    assert len(_PROGRAMS) >= 4, [w for w, _ in _PROGRAMS]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where,src", _PROGRAMS, ids=[w for w, _ in _PROGRAMS])
def test_program_block_runs(where, src, tmp_path):
    """A complete example in the guides runs as written, outside the tree."""
    import subprocess
    import sys

    script = tmp_path / "example.py"
    script.write_text(src)
    p = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 0, (where, p.stdout[-2000:], p.stderr[-2000:])
