"""The developer fallback loads compiled code only from directories no other user can change:
a build directory owned by another user, or a group-writable one or `.so`, is refused with
an error naming the path and its owner, and nothing is compiled or loaded from it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from p2phub import _cffi_build
from p2phub._cffi_build import HotPath, check_private

OTHER_UID = 12345


def foreign(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `path` owned by another user: for real as root, else in what os.stat reports."""
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, OTHER_UID)
        return
    real = os.stat

    def fake(p, *a, **kw):
        st = real(p, *a, **kw)
        if Path(p) == path:
            fields = list(st)
            fields[stat.ST_UID] = OTHER_UID
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(_cffi_build.os, "stat", fake)


def fallback_only(monkeypatch: pytest.MonkeyPatch, build: Path) -> HotPath:
    monkeypatch.setenv("P2PHUB_CFFI_DIR", str(build))
    hp = HotPath("kv", "_kvhot")
    monkeypatch.setattr(hp, "prebuilt", lambda: None)
    return hp


def test_own_directory_is_accepted(tmp_path: Path) -> None:
    d = tmp_path / "own"
    d.mkdir(mode=0o755)
    (d / "x.so").write_bytes(b"")
    os.chmod(d / "x.so", 0o755)
    check_private(d)
    check_private(d / "x.so")


def test_foreign_owned_cache_dir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    foreign(cache, monkeypatch)
    hp = fallback_only(monkeypatch, cache)
    with pytest.raises(PermissionError, match=f"{cache}.* is owned by uid {OTHER_UID}") as exc:
        hp.load()
    assert "P2PHUB_CFFI_DIR" in str(exc.value)
    assert list(cache.iterdir()) == []  # nothing made, compiled or loaded there


def test_foreign_owned_directory_above_is_refused(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    top = tmp_path / "checkout"
    (top / "build" / "cffi").mkdir(parents=True, mode=0o755)
    os.chmod(top, 0o755)
    foreign(top, monkeypatch)
    with pytest.raises(PermissionError, match=f"{top} is owned by uid {OTHER_UID}"):
        check_private(top / "build" / "cffi")


def test_group_writable_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o775)
    with pytest.raises(PermissionError, match="mode 775.* writable by its group or others"):
        fallback_only(monkeypatch, cache).load()
    assert list(cache.iterdir()) == []


def test_sticky_root_directory_above_is_allowed_but_not_as_the_build_dir(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("a root-owned sticky directory needs root to make")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "mine").mkdir(mode=0o755)
    check_private(shared / "mine")
    with pytest.raises(PermissionError, match="writable by its group or others"):
        check_private(shared)


def test_group_writable_so_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first load compiles into the user's own directory; once the .so turns group-writable
    a fresh loader refuses it rather than run what someone else may have put in it."""
    old = os.umask(0o002)  # the new .so and its directory must still pass the check
    try:
        mod = fallback_only(monkeypatch, tmp_path).load()
    finally:
        os.umask(old)
    so = Path(mod.__file__)
    assert not so.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    assert not so.parent.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    os.chmod(so, 0o775)
    with pytest.raises(PermissionError, match=f"{so}.* writable by its group or others"):
        fallback_only(monkeypatch, tmp_path).load()
