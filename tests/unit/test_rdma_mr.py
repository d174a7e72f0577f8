"""The rights an MR grants: local write only unless the caller asks for remote access, and
what is asked for reaches the registration call unchanged. The NIC is a stand-in that
records the access bits (the lab's test_rdma shows a real NIC refusing a remote WRITE into
a default MR)."""

from __future__ import annotations

import mmap
from types import SimpleNamespace

import pytest

from p2phub.errors import UsageError
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


class FakeSource:
    def mmap(self) -> mmap.mmap:
        return mmap.mmap(-1, SIZE)


def fake_reg() -> SimpleNamespace:
    return SimpleNamespace(closed=False, length=SIZE, dmabuf_fd=7, source=FakeSource(),
                           info=lambda: SimpleNamespace(revoked=False),
                           add_dependent=lambda dep: None)


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
def test_default_mr_grants_no_remote_access(dmabuf: bool, monkeypatch) -> None:
    pd, seen = fake_pd(dmabuf, monkeypatch)
    mr = pd.reg_mr(fake_reg())  # type: ignore[arg-type]
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
                                        monkeypatch) -> None:
    pd, seen = fake_pd(dmabuf, monkeypatch)
    mr = pd.reg_mr(fake_reg(), asked)  # type: ignore[arg-type]
    assert seen == [granted]
    mr.close()


@pytest.mark.parametrize("bad", [-1, 1 << 20])
def test_unknown_access_bits_are_refused(bad: int, monkeypatch) -> None:
    pd, seen = fake_pd(True, monkeypatch)
    with pytest.raises(UsageError, match="IBV_ACCESS"):
        pd.reg_mr(fake_reg(), bad)  # type: ignore[arg-type]
    assert seen == []
