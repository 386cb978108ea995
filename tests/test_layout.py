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
