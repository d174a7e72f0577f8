"""The Python API's errors for the inputs the command line refuses: each names the problem."""

from __future__ import annotations

import pytest

from p2phub import Hub
from p2phub.errors import ModuleNotLoadedError, UsageError

pytestmark = pytest.mark.unit


def test_a_node_that_is_not_p2phubs_is_refused_not_taken_for_p2p(tmp_path) -> None:
    with pytest.raises(UsageError, match="/dev/null is not the p2phub device"):
        Hub("/dev/null")
    plain = tmp_path / "p2phub"
    plain.write_bytes(b"")
    with pytest.raises(UsageError, match="not a character device"):
        Hub(str(plain), mode="p2p")


def test_an_absent_node_is_named(tmp_path) -> None:
    from p2phub.device import get_info
    with pytest.raises(UsageError, match="does not exist"):
        get_info(str(tmp_path / "nope"))
    assert issubclass(ModuleNotLoadedError, Exception)


def test_an_rdma_device_that_is_not_there_is_named(monkeypatch, tmp_path) -> None:
    from p2phub.rdma import mr
    monkeypatch.setattr(mr, "IB_CLASS", str(tmp_path))
    (tmp_path / "rxe0").mkdir()
    with pytest.raises(UsageError, match=r"no RDMA device 'mlx5_0' on this host \(it has rxe0\)"):
        mr.ProtectionDomain("mlx5_0")


def test_nvme_unbind_of_an_absent_address_names_it() -> None:
    from p2phub.nvme import bind
    with pytest.raises(UsageError, match="no PCI device 0000:ff:1f.7"):
        bind.unbind("0000:ff:1f.7")
    with pytest.raises(UsageError, match="not a PCI address"):
        bind.unbind("zz:00.0")
