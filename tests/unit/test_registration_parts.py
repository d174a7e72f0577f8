"""The host-side parts of a registration: PCI addresses, sources and their cache keys, backend plugins,
the resource base, and the package's public names."""

from __future__ import annotations

import os

import pytest

import p2phub
from p2phub import backend, sources
from p2phub._resource import Resource
from p2phub.errors import UsageError
from p2phub.pci import PciAddress, normalize

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------ PCI addresses


@pytest.mark.parametrize("text,want", [
    ("0000:04:00.0", "0000:04:00.0"), ("4:0.0", "0000:04:00.0"), ("04:1f.7", "0000:04:1f.7"),
    (" 0000:0A:00.1 ", "0000:0a:00.1"), ("10000:e1:00.0", "10000:e1:00.0"),
])
def test_pci_addresses_parse_to_the_kernels_spelling(text: str, want: str) -> None:
    assert str(PciAddress.parse(text)) == normalize(text) == want
    assert PciAddress.parse(PciAddress.parse(text)) == PciAddress.parse(want)


@pytest.mark.parametrize("text", ["", "04:00", "0000:04:20.0", "0000:04:00.8", "g0:00.0", "0000:100:00.0",
                                  "123456789:00:00.0"])
def test_bad_pci_addresses_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError, match="not a PCI address"):
        PciAddress.parse(text)


def test_a_pci_address_is_not_an_int() -> None:
    with pytest.raises(UsageError):
        PciAddress.parse(4)  # type: ignore[arg-type]


def test_canonical_spelling_is_what_sysfs_names() -> None:
    assert PciAddress.is_canonical("0000:04:00.0") and PciAddress.is_canonical("10000:e1:00.0")
    assert not PciAddress.is_canonical("4:0.0") and not PciAddress.is_canonical("0000:0A:00.0")


def test_pci_address_fields() -> None:
    a = PciAddress.parse("0001:02:03.4")
    assert (a.domain, a.bus, a.device, a.function, a.devfn) == (1, 2, 3, 4, 0x1C)


# ------------------------------------------------------------------ sources


def test_a_file_is_keyed_by_inode_offset_and_length(tmp_path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"\0" * 8192)
    fd = os.open(p, os.O_RDONLY)
    dup = os.dup(fd)
    try:
        k = sources.cache_key(fd)
        assert k == sources.cache_key(dup) == sources.cache_key(fd, 0, 8192)
        assert k != sources.cache_key(fd, 4096) and k != sources.cache_key(fd, 0, 4096)
    finally:
        os.close(fd)
        os.close(dup)
    assert sources.cache_key(fd) is None  # closed: nothing to name


@pytest.mark.parametrize("obj", [None, True, -1, object(), b"abc"])
def test_what_cannot_be_named_is_never_cached(obj) -> None:
    assert sources.cache_key(obj) is None


def test_resolve_refuses_what_is_not_a_dmabuf(tmp_path) -> None:
    with open(tmp_path / "plain", "wb") as f:
        with pytest.raises(UsageError, match="not a dma-buf"):
            sources.resolve(f.fileno())
    with pytest.raises(UsageError, match="alloc_host"):
        sources.resolve(bytearray(16))
    with pytest.raises(UsageError, match="not memory p2phub knows"):
        sources.resolve(object())
    with pytest.raises(UsageError, match="multiple of 4096"):
        sources.host(1000)


# ------------------------------------------------------------------ backend plugins


def test_backends_come_from_the_entry_point_group() -> None:
    import importlib.metadata
    names = {ep.name for ep in importlib.metadata.entry_points(group=backend.GROUP)}
    assert {"cuda", "rocm"} <= names
    loaded = {name for name, _ in backend.backend_modules()}
    assert loaded | set(backend.unavailable()) >= names
    assert set(backend.backend_names()) <= loaded


def test_a_plugin_claims_a_pci_function_as_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    class Fake:
        name = "fake"

        def claims(self, obj: object) -> bool:
            return False

        def discover_gpu(self, fn: backend.PciFunction) -> backend.GpuClaim | None:
            if fn.vendor == 0x1234 and fn.driver == "fakedrv":
                return backend.GpuClaim("fake", "Fake GPU", "Fake Inc", 2)
            return None

    class Broken(Fake):
        name = "broken"

        def discover_gpu(self, fn: backend.PciFunction) -> None:
            raise RuntimeError("boom")

    monkeypatch.setattr(backend, "backends", lambda: (Broken(), Fake()))
    fn = backend.PciFunction("0000:04:00.0", 0x1234, 0x1, 0x030000, "fakedrv")
    name, claim = backend.discover_gpu(fn)  # type: ignore[misc]
    assert name == "fake" and claim.p2p_bar == 2
    assert backend.discover_gpu(backend.PciFunction("0000:04:00.0", 0x1234, 0x1, 0x030000, None)) is None
    assert "broken.discover_gpu" in backend.unavailable()


# ------------------------------------------------------------------ resources and the package


def test_resource_closes_once_and_only_when_release_succeeded() -> None:
    calls = []

    class R(Resource):
        fail = True

        def _close(self) -> None:
            calls.append(1)
            if self.fail:
                raise OSError("busy")

    r = R()
    with pytest.raises(OSError):
        r.close()
    assert not r.closed
    r.fail = False
    with r:
        pass
    r.close()
    assert r.closed and calls == [1, 1]


def test_a_forked_child_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    r = Resource()
    r._mark_owner()
    r._check_owner()
    monkeypatch.setattr(os, "getpid", lambda: r._pid + 1)
    assert r.foreign
    with pytest.raises(UsageError, match="forked child"):
        r._check_owner()


def test_the_package_root_exports_the_public_api() -> None:
    from p2phub import Hub, PciAddress as P, Registration, RevokedError  # noqa: F401
    assert {"Hub", "Registration", "PciAddress", "RevokedError", "UsageError"} <= set(p2phub.__all__)
    for name in p2phub.__all__:
        assert getattr(p2phub, name) is not None
    with pytest.raises(AttributeError):
        p2phub.NoSuchThing  # noqa: B018
