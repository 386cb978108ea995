"""Every public name, method and property says what it does."""

from __future__ import annotations

import inspect

import pytest

import gpucx
import gpucx.aio
import gpucx.mem
import gpucx.ops.rma

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
