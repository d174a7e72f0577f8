"""tools/lab's kernel choice: `--kernel debug` finds the debug lab kernel in its cache, and only
a finished build (the hash stamp and the image both there) counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "labkit"))
from p2phub_lab import runner  # noqa: E402


def _kernel(cache: Path, release: str, *, stamp: bool = True, image: bool = True) -> Path:
    top = cache / release
    (top / "boot").mkdir(parents=True)
    (top / "build").mkdir()
    (top / "build" / "Makefile").write_text("# O= tree\n")
    if image:
        (top / "boot" / f"vmlinuz-{release}").write_bytes(b"\0")
    if stamp:
        (top / "config.sha256").write_text("0123456789abcdef\n")
    return top


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(runner, "KERNEL_CACHE", tmp_path)
    return tmp_path


def test_debug_resolves_to_the_newest_finished_build(cache: Path) -> None:
    _kernel(cache, "6.12.117-p2phub-debug")
    _kernel(cache, "6.12.9-p2phub-debug")
    _kernel(cache, "6.13.1-p2phub-debug", stamp=False)  # half built: ignored
    assert runner.resolve_kernel("debug") == "6.12.117-p2phub-debug"
    assert runner.kernel_image("6.12.117-p2phub-debug") == \
        cache / "6.12.117-p2phub-debug" / "boot" / "vmlinuz-6.12.117-p2phub-debug"
    assert runner.headers_dir("6.12.117-p2phub-debug") == cache / "6.12.117-p2phub-debug" / "build"


def test_a_full_debug_release_resolves_to_itself(cache: Path) -> None:
    _kernel(cache, "6.12.117-p2phub-debug")
    assert runner.resolve_kernel("6.12.117-p2phub-debug") == "6.12.117-p2phub-debug"


def test_no_debug_kernel_says_how_to_build_one(cache: Path) -> None:
    _kernel(cache, "6.12.117-p2phub-debug", image=False)
    with pytest.raises(SystemExit, match="tools/setup --debug-kernel"):
        runner.resolve_kernel("debug")


def test_debug_kernels_are_not_debian_lab_kernels(cache: Path) -> None:
    _kernel(cache, "6.12.117-p2phub-debug")
    assert all(not v.endswith("-p2phub-debug") for v in runner.lab_kernels().values())
    assert runner.kernel_image("6.12.117+deb12-amd64") == Path("/boot/vmlinuz-6.12.117+deb12-amd64")


@pytest.fixture
def build_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "buildroot"
    monkeypatch.setattr(runner, "BUILD_ROOT", root)
    return root


def _root_kernel(root: Path, release: str, *, headers: bool = True) -> None:
    mods = root / "usr" / "lib" / "modules" / release
    (mods / "kernel").mkdir(parents=True)
    (mods / "vmlinuz").write_bytes(b"\0")
    if headers:
        (root / "usr" / "src" / f"linux-headers-{release}").mkdir(parents=True)
        (root / "usr" / "src" / f"linux-headers-{release}" / "Makefile").write_text("# headers\n")


def test_a_build_root_kernel_is_built_and_booted_from_the_build_root(build_root: Path) -> None:
    _root_kernel(build_root, "7.2.12+deb13-amd64")
    _root_kernel(build_root, "7.3.4+deb13-amd64")
    _root_kernel(build_root, "7.4.1+deb13-amd64", headers=False)  # no headers: not a lab kernel
    assert runner.build_root_kernels() == ["7.2.12+deb13-amd64", "7.3.4+deb13-amd64"]
    assert runner.resolve_kernel("7.x") == "7.3.4+deb13-amd64"
    assert runner.resolve_kernel("7.2") == "7.2.12+deb13-amd64"
    assert runner.resolve_kernel("7.3.4+deb13-amd64") == "7.3.4+deb13-amd64"
    assert runner.kernel_image("7.3.4+deb13-amd64") == \
        build_root / "usr" / "lib" / "modules" / "7.3.4+deb13-amd64" / "vmlinuz"
    # the build runs in the build root: the headers' path is the one it sees there
    assert runner.build_root_for("7.3.4+deb13-amd64") == build_root
    assert runner.headers_dir("7.3.4+deb13-amd64") == Path("/usr/src/linux-headers-7.3.4+deb13-amd64")
    cmd = runner.in_build_root(build_root, ["make", "-C", "x"])
    assert cmd[:4] == ["unshare", "--mount", "--propagation", "private"]
    assert cmd[-3:] == ["make", "-C", "x"] and str(build_root) in cmd and str(runner.TOP) in cmd


def test_the_default_kernel_is_never_a_build_root_one(build_root: Path) -> None:
    _root_kernel(build_root, "99.1.0+deb13-amd64")
    host = {v for v in runner.lab_kernels().values() if v not in runner.build_root_kernels()}
    if not host:
        pytest.skip("no Debian kernel installed on this host (tools/setup installs them)")
    assert runner.resolve_kernel(None) in host
    assert runner.build_root_for(runner.resolve_kernel(None)) is None
    assert runner.resolve_kernel("99.x") == "99.1.0+deb13-amd64"


def test_no_kernel_of_a_major_version_says_so(build_root: Path) -> None:
    with pytest.raises(SystemExit, match="not installed"):
        runner.resolve_kernel("98.x")
