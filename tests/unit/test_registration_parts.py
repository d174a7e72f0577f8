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
    assert a.fields() == {"domain": 1, "bus": 2, "devfn": 0x1C}


@pytest.mark.parametrize("text,want", [
    ("00:0a.0", (0, 0, 0x0A, 0)), ("0000:00:0a.0", (0, 0, 0x0A, 0)), ("00:0A.0", (0, 0, 0x0A, 0)),
    ("0000:C1:1F.7", (0, 0xC1, 0x1F, 7)), ("ffff:ff:1f.7", (0xFFFF, 0xFF, 0x1F, 7)),
    ("ffffffff:00:00.0", (0xFFFFFFFF, 0, 0, 0)), ("0:0:0.0", (0, 0, 0, 0)), ("\t0000:04:00.0\n", (0, 4, 0, 0)),
])
def test_pci_address_short_domain_and_upper_case_forms(text: str, want: tuple[int, int, int, int]) -> None:
    a = PciAddress.parse(text)
    assert (a.domain, a.bus, a.device, a.function) == want
    assert PciAddress.parse(str(a)) == a and PciAddress.is_canonical(str(a))


@pytest.mark.parametrize("text,why", [
    ("0000:100:00.0", "bus 0x100 is above 0xff"),
    ("0000:00:20.0", "device number 0x20 is above 0x1f"),
    ("0000:00:1f.8", "function 0x8 is above 0x7"),
    ("100000000:00:00.0", "domain 0x100000000 is above 0xffffffff"),
    ("0000:00:00", "want [DDDD:]BB:DD.F"), ("0000:00:00.0.0", "want [DDDD:]BB:DD.F"),
    ("0:0000:00:00.0", "want [DDDD:]BB:DD.F"), ("00:0x1.0", "want [DDDD:]BB:DD.F"),
    ("00 :00.0", "want [DDDD:]BB:DD.F"), ("-1:00.0", "want [DDDD:]BB:DD.F"), ("pci0000:00", "want [DDDD:]BB:DD.F"),
])
def test_a_bad_pci_address_error_names_the_text_and_the_field(text: str, why: str) -> None:
    """The ctypes fields of the UAPI structs would truncate an oversized value silently: the parser
    refuses it first, saying which field is out of range and quoting what the user typed."""
    with pytest.raises(UsageError) as exc:
        PciAddress.parse(text)
    assert str(exc.value).startswith(f"not a PCI address: {text!r} (") and why in str(exc.value)


def test_root_bus_directories_name_device_0_of_their_bus() -> None:
    from p2phub.pci import root_bus
    assert root_bus("pci0000:00") == PciAddress(0, 0, 0)
    assert str(root_bus("pci10000:e0")) == "10000:e0:00.0"
    assert root_bus("0000:00:00.0") is None and root_bus("pci0000:00:00.0") is None and root_bus("pci") is None


def test_nvme_bind_split_bdf_is_the_one_parser() -> None:
    from p2phub.nvme import bind
    assert bind.split_bdf("0A:00.1") == (0, 0x0A, 1) == tuple(PciAddress.parse("0000:0a:00.1").fields().values())
    with pytest.raises(UsageError, match="not a PCI address: 'nvme0'"):
        bind.split_bdf("nvme0")


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
    from p2phub import _resource
    monkeypatch.setattr(_resource, "this_pid", r._pid + 1)   # as in a forked child
    assert r.foreign
    with pytest.raises(UsageError, match="forked child"):
        r._check_owner()


def test_a_real_forked_child_is_refused() -> None:
    """The owner check follows a real fork() (the pid is kept current by an at-fork hook)."""
    r = Resource()
    r._mark_owner()
    pid = os.fork()
    if pid == 0:
        try:
            r._check_owner()
            code = 1
        except UsageError:
            code = 0 if r.foreign else 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    r._check_owner()                  # the parent still owns it


def test_the_package_root_exports_the_public_api() -> None:
    from p2phub import Hub, PciAddress as P, Registration, RevokedError  # noqa: F401
    assert {"Hub", "Registration", "PciAddress", "RevokedError", "UsageError"} <= set(p2phub.__all__)
    for name in p2phub.__all__:
        assert getattr(p2phub, name) is not None
    with pytest.raises(AttributeError):
        p2phub.NoSuchThing  # noqa: B018
