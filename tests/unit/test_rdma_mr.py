"""The rights an MR grants: local write only unless the caller asks for remote access, and
what is asked for reaches the registration call unchanged. The NIC is a stand-in that
records the access bits (the lab's test_rdma shows a real NIC refusing a remote WRITE into
a default MR)."""

from __future__ import annotations

import mmap
from types import SimpleNamespace

import pytest

from p2phub.errors import UsageError
from p2phub.hub import Hub
from p2phub.memory import Memory, MemoryInfo, MemoryShare
from p2phub.rdma import Access, MrPath, ProtectionDomain
from p2phub.rdma import mr as mr_mod

SIZE = 64 << 10


class FakeVerbsPd:
    def __init__(self) -> None:
        self.access: list[int] = []

    def reg_dmabuf_mr(self, offset: int, length: int, iova: int, fd: int, access: int):
        self.access.append(access)
        return SimpleNamespace(lkey=1, rkey=2)


class FakeVaMr:
    made: list[int] = []

    def __init__(self, pd: object, length: int, access: int, address: int) -> None:
        FakeVaMr.made.append(access)
        self.lkey, self.rkey = 3, 4

    def close(self) -> None:
        pass


class HostMemory(Memory):
    """The memory contract over plain host memory that claims a dma-buf (fd 7), as memory
    pinned by p2phub.ko would; its paths come from a real Hub's policy."""

    mode = "p2p"
    source = None
    gpu = None

    def __init__(self, hub: Hub) -> None:
        self._owner = hub
        self._share = MemoryShare()
        self.length = SIZE
        self.what = "test memory"
        self.dmabuf_fd = 7

    def info(self) -> MemoryInfo:
        return MemoryInfo(SIZE, self.mode)

    def mmap(self) -> mmap.mmap:
        return mmap.mmap(-1, SIZE)

    def close(self, force: bool = False, timeout: float | None = None) -> None:
        self._closed = True


@pytest.fixture()
def hub():
    with Hub(mode="staged") as h:
        yield h


def fake_reg(hub: Hub) -> HostMemory:
    return HostMemory(hub)


def fake_pd(dmabuf: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[ProtectionDomain, list[int]]:
    pd = ProtectionDomain.__new__(ProtectionDomain)
    pd.device = "fake0"
    pd.pd = object()
    monkeypatch.setattr(mr_mod, "dmabuf_mr_support",
                        lambda dev: (dmabuf, "fake" if dmabuf else "EOPNOTSUPP"))
    if dmabuf:
        vpd = FakeVerbsPd()
        pd._verbs_pd = vpd  # type: ignore[assignment]
        monkeypatch.setattr(mr_mod.verbs.VerbsPd, "dereg_mr", staticmethod(lambda m: None))
        return pd, vpd.access
    pytest.importorskip("pyverbs.mr")
    monkeypatch.setattr("pyverbs.mr.MR", FakeVaMr)
    FakeVaMr.made = []
    return pd, FakeVaMr.made


@pytest.mark.parametrize("dmabuf", [True, False], ids=["dmabuf-mr", "va-mr"])
def test_default_mr_grants_no_remote_access(dmabuf: bool, hub, monkeypatch) -> None:
    pd, seen = fake_pd(dmabuf, monkeypatch)
    mr = pd.reg_mr(fake_reg(hub))  # type: ignore[arg-type]
    assert mr.path is (MrPath.DMABUF if dmabuf else MrPath.HOST_VA)
    assert seen == [Access.LOCAL_WRITE]
    assert not seen[0] & (Access.REMOTE_WRITE | Access.REMOTE_READ)
    mr.close()


@pytest.mark.parametrize("dmabuf", [True, False], ids=["dmabuf-mr", "va-mr"])
@pytest.mark.parametrize("asked, granted", [
    (Access.REMOTE_WRITE, Access.LOCAL_WRITE | Access.REMOTE_WRITE),  # verbs needs both
    (Access.REMOTE_READ, Access.REMOTE_READ),
    (Access.LOCAL_WRITE | Access.REMOTE_READ, Access.LOCAL_WRITE | Access.REMOTE_READ),
    (Access(0), 0),
])
def test_asked_access_is_passed_through(dmabuf: bool, asked: Access, granted: int,
                                        hub, monkeypatch) -> None:
    pd, seen = fake_pd(dmabuf, monkeypatch)
    mr = pd.reg_mr(fake_reg(hub), asked)  # type: ignore[arg-type]
    assert seen == [granted]
    mr.close()


@pytest.mark.parametrize("bad", [-1, 1 << 20])
def test_unknown_access_bits_are_refused(bad: int, hub, monkeypatch) -> None:
    pd, seen = fake_pd(True, monkeypatch)
    with pytest.raises(UsageError, match="IBV_ACCESS"):
        pd.reg_mr(fake_reg(hub), bad)  # type: ignore[arg-type]
    assert seen == []
