"""The wheels users install: p2phub ships its C hot paths (NVMe engine, KV transfer) compiled, and the vendor backends are
separate distributions found through the ``p2phub.backends`` entry-point group.

Builds the three wheels from a copy of the checkout's files (what git would ship, so a file that
only exists in this checkout cannot hide a missing package-data entry), installs them into a fresh
venv outside the checkout, and imports from there. No network: the build uses this interpreter's
setuptools and cffi (--no-build-isolation; tools/setup installs Debian's python3-setuptools,
python3-wheel and python3-cffi, which the venv sees, since Python 3.12's venvs carry no setuptools)
and the install --no-deps (the fresh venv sees the system's cffi).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

TOP = Path(__file__).resolve().parents[2]


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{cmd}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (TOP / ".git").exists():
        pytest.skip("needs a git checkout to list the shipped files")
    tmp = tmp_path_factory.mktemp("pkg")
    src, dist = tmp / "src", tmp / "dist"
    files = _run("git", "ls-files", "-co", "--exclude-standard", "-z", cwd=TOP).split("\0")
    for rel in files:
        if not rel or rel.startswith("tests/fixtures/") or not (TOP / rel).is_file():
            continue
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(TOP / rel, src / rel)
    # absolute paths: pip reads a bare directory name as a requirement
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", dist,
         src, src / "backends" / "cuda", src / "backends" / "rocm", cwd=tmp)
    base = getattr(sys, "_base_executable", sys.executable)
    _run(base, "-m", "venv", "--system-site-packages", tmp / "venv", cwd=tmp)
    _run(tmp / "venv" / "bin" / "python", "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         *sorted(dist.glob("*.whl")), cwd=tmp)
    return tmp


def test_three_wheels_p2phub_platform_specific_backends_pure(installed: Path) -> None:
    names = sorted(p.name for p in (installed / "dist").glob("*.whl"))
    assert len(names) == 3, names
    core = next(n for n in names if n.startswith("p2phub-"))
    assert "linux" in core, f"{core}: the core wheel carries a compiled module, so it is platform-specific"
    assert any(n.startswith("p2phub_cuda-") and n.endswith("-none-any.whl") for n in names), names
    assert any(n.startswith("p2phub_rocm-") and n.endswith("-none-any.whl") for n in names), names
    # the core names no backend: each backend distribution brings its own entry point
    with zipfile.ZipFile(installed / "dist" / core) as z:
        eps = [n for n in z.namelist() if n.endswith("entry_points.txt")]
        assert eps and "p2phub.backends" not in z.read(eps[0]).decode()
        assert not [n for n in z.namelist() if n.startswith(("p2phub_cuda/", "p2phub_rocm/"))]
        # the C sources: the compiled modules are checked against them, the developer fallback reads them
        for src in ("p2phub/nvme/_hot.c", "p2phub/nvme/_hot.h", "p2phub/kv/_kvhot.c", "p2phub/kv/_kvhot.h"):
            assert src in z.namelist(), f"{core} lacks {src}"


def test_installed_wheel_imports_the_compiled_hot_path_without_compiling(installed: Path) -> None:
    nocompile = installed / "fallback-dir"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "P2PHUB_CFFI_DIR")}
    env["P2PHUB_CFFI_DIR"] = str(nocompile)   # where the developer fallback would compile
    code = ("import json, importlib.metadata as md, p2phub, p2phub.nvme\n"
            "from p2phub.nvme import _build\n"
            "from p2phub.kv import _build as _kvbuild\n"
            "hot, kv = _build.load(), _kvbuild.load()\n"
            "print(json.dumps({'p2phub': p2phub.__file__, 'hot': hot.__name__, 'so': hot.__file__,"
            " 'calls': [n for n in dir(hot.lib) if n.startswith('p2h_')],"
            " 'kv': kv.__name__, 'kv_so': kv.__file__, 'kv_calls': [n for n in dir(kv.lib) if n.startswith('kv_')],"
            " 'backends': sorted([e.name, e.value] for e in md.entry_points(group='p2phub.backends'))}))\n")
    out = json.loads(_run(installed / "venv" / "bin" / "python", "-c", code, cwd=installed, env=env))
    site = str(installed / "venv")
    assert out["p2phub"].startswith(site), out           # not the checkout
    assert out["hot"] == "p2phub.nvme._hotlib", out       # the module built with the wheel
    assert out["so"].startswith(site), out
    assert out["calls"], out                              # the hot path's C entry points
    assert out["kv"] == "p2phub.kv._kvhotlib" and out["kv_so"].startswith(site) and out["kv_calls"], out
    assert not nocompile.exists(), "the installed wheel fell back to compiling the hot path"
    assert ["cuda", "p2phub_cuda"] in out["backends"] and ["rocm", "p2phub_rocm"] in out["backends"], out


@pytest.mark.parametrize("name", ["NVME", "KV"])
def test_a_compiled_hot_path_older_than_its_sources_is_not_loaded(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from p2phub import _cffi_build

    hp = getattr(_cffi_build, name)
    try:
        __import__(hp.module)
    except ImportError:
        pytest.skip(f"no compiled {hp.module} in this install (checkout without an editable build)")
    assert hp.prebuilt() is not None
    monkeypatch.setattr(hp, "sources_tag", lambda: "0" * 16)   # as if the .c file had been edited
    assert hp.prebuilt() is None


def test_the_developer_fallback_compiles_the_same_definition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiled module that matches the sources: the loader compiles them into P2PHUB_CFFI_DIR,
    under a name keyed by the sources, and the module it loads answers the sources' tag."""
    from p2phub._cffi_build import HotPath

    monkeypatch.setenv("P2PHUB_CFFI_DIR", str(tmp_path))
    hp = HotPath("kv", "_kvhot")
    monkeypatch.setattr(hp, "prebuilt", lambda: None)
    mod = hp.load()
    assert mod.__name__.startswith("_p2phub_kv_kvhot_") and mod.__file__.startswith(str(tmp_path))
    assert mod.ffi.string(mod.lib.p2phub_kvhot_tag()).decode() == hp.sources_tag()
    assert hp.load() is mod


def test_the_core_wheel_ships_the_nixl_plugin_built(installed: Path) -> None:
    """`pip install` builds libplugin_P2PHUB.so into the wheel (g++ and make are here), and the
    installed package finds it there, not in a checkout."""
    core = next((installed / "dist").glob("p2phub-*.whl"))
    with zipfile.ZipFile(core) as z:
        assert "p2phub/nixl/plugin/lib/libplugin_P2PHUB.so" in z.namelist(), sorted(
            n for n in z.namelist() if "nixl/plugin" in n)[:20]
    out = _run(installed / "venv" / "bin" / "python", "-I", "-c",
               "from p2phub.nixl.plugins import plugin_library; print(plugin_library())",
               cwd=Path("/"))
    lib = Path(out.strip())
    assert lib.is_file() and str(installed / "venv") in str(lib), lib
