"""The package's layering: which module may import which (read with ast).

Every ``import`` counts, module level or inside a function: a lazy import is
still a dependency.  Package ``__init__`` files are left out of the paths (they
gather the public names from every layer, so everything reaches them).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import gpucx

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(gpucx.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    deps.add(sub if sub in mods else base)
        graph[name] = {
            d for d in deps if d in mods and d != name and mods[d].name != "__init__.py"
        }
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A path of imports from ``start`` to ``goal``, or None."""
    seen = {start}
    todo: list[list[str]] = [[start]]
    while todo:
        path = todo.pop()
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == goal:
                return path + [nxt]
            if nxt not in seen:
                seen.add(nxt)
                todo.append(path + [nxt])
    return None


@pytest.mark.parametrize(
    ("upper", "lower"),
    [
        # the await path belongs to aio; the request layer knows no event loop
        ("gpucx.aio", "gpucx.request"),
        # arrays are a protocol on top of active messages
        ("gpucx.ops.arrays", "gpucx.ops.am"),
        # buffers call into the CUDA layer (stream sync), not the reverse
        ("gpucx.mem.buffer", "gpucx.mem.cuda"),
    ],
)
def test_one_direction(upper: str, lower: str) -> None:
    graph = _graph()
    assert lower in graph[upper], f"{upper} no longer imports {lower}"
    back = _reaches(graph, lower, upper)
    assert back is None, "import cycle: " + " -> ".join(back or [])


def test_graph_sees_lazy_imports() -> None:
    # The reader must count imports inside functions (the cycles it guards
    # against were lazy ones): gpucx.mem.buffer imports cuda only there.
    tree = ast.parse((ROOT / "mem" / "buffer.py").read_text())
    top = {
        n.module
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.module is not None
    }
    assert "cuda" not in top
    assert "gpucx.mem.cuda" in _graph()["gpucx.mem.buffer"]


def test_info_lives_beside_the_cli() -> None:
    # ``gpucx info`` is gpucx.info; the old home stays an alias of it.
    import gpucx.bench.info
    import gpucx.info

    assert gpucx.bench.info is gpucx.info
    assert not (ROOT / "bench" / "info.py").read_text().count("def ")


# -- layers talk through named internal interfaces ------------------------------

# Packages built on the core that must reach its objects' private state only
# through gpucx._internal (or public API).
_ABOVE_THE_CORE = ("bench",)


def _core_private_names() -> set[str]:
    """Private attribute and method names the core's classes own: assigned
    as ``self._x`` or defined as ``def _x`` in a class, outside the packages
    above the core and outside gpucx._internal."""
    names: set[str] = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in _ABOVE_THE_CORE + ("dask",) or rel.name == "_internal.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(item.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_reaches(path: pathlib.Path, private: set[str]) -> list[str]:
    """``obj._x`` (obj not self/cls) and ``getattr(obj, "_x")`` in a file,
    for the names in ``private``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        name = None
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
        ):
            name = node.args[1].value
        if name in private:
            out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_core_private_names_are_found() -> None:
    # The reader must see the handles and bookkeeping the rule is about.
    private = _core_private_names()
    assert {"_h", "_efd", "_park", "_abandon", "_pending", "_keep"} <= private


@pytest.mark.parametrize("package", _ABOVE_THE_CORE)
def test_no_private_reaches_above_the_core(package: str) -> None:
    private = _core_private_names()
    found = [
        hit
        for path in sorted((ROOT / package).rglob("*.py"))
        for hit in _private_reaches(path, private)
    ]
    assert not found, (
        "use gpucx._internal (or public API) instead of private attributes of "
        "core objects:\n" + "\n".join(found)
    )


def test_remote_key_asks_through_the_internal_interface() -> None:
    # RemoteKey learns what still uses it from gpucx._internal, not by
    # walking the worker's pending set itself.
    text = (ROOT / "mem" / "remote.py").read_text()
    assert "._pending" not in text and "pending_holding(" in text


def test_reach_finder_sees_a_reach(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "class B:\n"
        "    def f(self, w):\n"
        "        return w._h, getattr(w, '_efd'), self._h, w._own\n"
    )
    hits = _private_reaches(bad, {"_h", "_efd"})
    assert [h.rpartition(": ")[2] for h in hits] == ["w._h", "getattr(w, '_efd')"]


# -- one wait loop ----------------------------------------------------------------

# The C calls that sleep on a worker's event fd, and where they may be called:
# gpucx.request holds the waits (block, wait_for, wait_closing, settle,
# abandon); gpucx.aio is the event-loop driver, whose progress thread sleeps
# on the fd by design.  ``time.sleep`` is not for the core at all (the
# benchmark's process management and Dask's own retries are not worker waits).
_SLEEPS = {"gpucx_worker_sleep", "gpucx_wait_sleep"}
_MAY_SLEEP = {"gpucx.request", "gpucx.aio"}


def test_one_module_sleeps_on_the_worker() -> None:
    found = []
    for name, path in _modules().items():
        if name in _MAY_SLEEP:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in _SLEEPS:
                found.append(f"{name}:{node.lineno}: {node.attr}")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr == "sleep"
                and isinstance(node.value, ast.Name)
                and node.value.id == "time"
                and not name.startswith(("gpucx.bench.", "gpucx.dask."))
            ):
                found.append(f"{name}:{node.lineno}: time.sleep")
    assert not found, "wait through gpucx.request (wait_for, block...):\n" + "\n".join(
        found
    )
