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
