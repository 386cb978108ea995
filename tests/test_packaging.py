"""The sdist is complete and the wheel built from it works anywhere.

``python -m build`` (no build isolation: the test venv has the build
requirements, see the ``test`` extra) makes the sdist, then the wheel from the
sdist, as a release would.  The wheel goes into a fresh venv outside the source
tree, where a send/recv, ``gpucx info`` and a short ``gpucx bench`` run.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(300)


def _build(*args, cwd=ROOT, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _tracked(prefix: str) -> set[str]:
    out = subprocess.run(
        ["git", "ls-files", prefix],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line for line in out.splitlines() if line}


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """sdist and the wheel built from it (one build for the module)."""
    out = tmp_path_factory.mktemp("dist")
    _build("-o", str(out), ".")
    (sdist,) = out.glob("gpucx-*.tar.gz")
    (wheel,) = out.glob("gpucx-*.whl")
    return sdist, wheel


def _sdist_names(sdist: pathlib.Path) -> set[str]:
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        return {n[len(top) + 1 :] for n in tar.getnames() if n.startswith(top + "/")}


def test_sdist_has_every_source_file(dist):
    """Every tracked file of the package (C sources and cdefs included), the
    build files, tests and docs are in the sdist."""
    sdist, _ = dist
    names = _sdist_names(sdist)
    tracked = _tracked("gpucx") | _tracked("tests") | _tracked("docs")
    if not tracked:  # pragma: no cover - not a git checkout (an unpacked sdist)
        tracked = {
            str(p.relative_to(ROOT))
            for d in ("gpucx", "tests", "docs")
            for p in (ROOT / d).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".so"
        }
    tracked = {t for t in tracked if (ROOT / t).is_file()}
    assert tracked - names == set()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        assert name in names
    for name in ("gpucx/_ucx_helpers.c", "gpucx/_build_ucx.py"):
        assert name in names
    assert {n for n in names if n.startswith("gpucx/_csrc/")}
    assert {n for n in names if n.startswith("gpucx/_cdefs/")}
    assert not [n for n in names if n.endswith((".so", ".o", ".pyc"))]


def test_wheel_is_one_abi3_wheel_for_every_cpython(dist):
    """The extension is built against the stable ABI, and the wheel says so:
    one wheel installs on every CPython from 3.10 on (pip refuses a wheel
    tagged for one interpreter on another)."""
    _, wheel = dist
    assert wheel.name.split("-")[2:4] == ["cp310", "abi3"], wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.startswith("gpucx/_ucx.") and n.endswith(".so")] == [
        "gpucx/_ucx.abi3.so"
    ]


def test_wheel_is_self_contained(dist):
    """The wheel has the compiled extension and every runtime module, and none
    of the build-time-only files (builder, cdefs, C sources)."""
    _, wheel = dist
    names = set(zipfile.ZipFile(wheel).namelist())
    assert [n for n in names if n.startswith("gpucx/_ucx.") and n.endswith(".so")]
    runtime = {
        t
        for t in _tracked("gpucx")
        if t.endswith(".py")
        and not t.startswith("gpucx/_cdefs/")
        and t != "gpucx/_build_ucx.py"
    }
    assert runtime - names == set()
    assert {"gpucx/py.typed", "gpucx/_ucx.pyi"} <= names
    build_only = [
        n
        for n in names
        if n.startswith(("gpucx/_cdefs/", "gpucx/_csrc/"))
        or n.endswith((".c", ".h"))
        or n == "gpucx/_build_ucx.py"
    ]
    assert build_only == []


def test_missing_c_source_is_a_build_error(dist, tmp_path):
    """A C source missing from an (incomplete) source tree fails the build,
    naming the file, instead of building an extension without it."""
    sdist, _ = dist
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    (src,) = tmp_path.glob("gpucx-*")
    (src / "gpucx" / "_csrc" / "rma.c").unlink()
    proc = _build("--wheel", "-o", str(tmp_path / "out"), ".", cwd=src, check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "missing source file(s) gpucx/_csrc/rma.c" in out, out[-3000:]
    assert not list((tmp_path / "out").glob("*.whl"))


SEND_RECV = """
import numpy as np, gpucx, sys
assert "site-packages" in gpucx.__file__, gpucx.__file__
with gpucx.Context() as ctx:
    a, b = ctx.create_worker(), ctx.create_worker()
    ep = a.connect(b.address)
    out = np.zeros(100_000, np.float64)
    r = b.recv_nb(out, tag=5)
    s = ep.send_nb(np.arange(100_000, dtype=np.float64), tag=5)
    while not (r.done() and s.done()):
        a.progress(); b.progress()
    assert (out == np.arange(100_000)).all()
    print("send/recv ok", r.result(), gpucx.__file__)
"""


def test_wheel_works_in_a_fresh_venv(dist, tmp_path):
    """pip installs the wheel (dependencies from the index, the versions this
    venv has, so pip's cache serves them) into a new venv; outside the source
    tree it sends and receives, and ``gpucx info`` and ``gpucx bench`` run."""
    _, wheel = dist
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py, bindir = venv / "bin" / "python", venv / "bin"
    pins = subprocess.run(
        [sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True
    ).stdout.splitlines()
    deps = ("numpy", "cffi", "pycparser", "libucx-cu12", "tqdm")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(
        "\n".join(p for p in pins if p.split("==")[0].lower() in deps) + "\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "-c", str(constraints), str(wheel)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    def run(*cmd, timeout=120):
        p = subprocess.run(
            cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=timeout
        )
        assert p.returncode == 0, (cmd, p.stdout[-3000:], p.stderr[-3000:])
        return p.stdout

    out = run(str(py), "-c", SEND_RECV)
    assert "send/recv ok" in out and str(venv) in out
    info = run(str(bindir / "gpucx"), "info")
    assert "UCX" in info and "gpucx" in info
    table = run(
        str(bindir / "gpucx"),
        "bench",
        *("-t", "tag_lat,tag_bw", "-s", "8,64K", "-n", "50", "-w", "5"),
        *("--no-progress", "--timeout", "60"),
    )
    rows = [line.split() for line in table.splitlines() if line.startswith("tag_")]
    assert len(rows) == 4, table
