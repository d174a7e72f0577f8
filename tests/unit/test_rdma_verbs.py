"""The cffi binding behind dma-buf MRs: it loads the real libibverbs and checks arguments first."""

from __future__ import annotations

import errno

import pytest

from p2phub.errors import P2PHubOSError, UsageError
from p2phub.rdma import verbs


def test_libibverbs_has_every_call_p2phub_binds() -> None:
    lib = verbs.lib()
    for name in ("ibv_reg_dmabuf_mr", "ibv_dereg_mr", "ibv_import_device", "ibv_import_pd",
                 "ibv_unimport_pd", "ibv_open_device", "ibv_alloc_pd", "ibv_get_device_list"):
        assert getattr(lib, name) is not None


def test_mr_struct_layout_matches_libibverbs() -> None:
    # struct ibv_mr: context, pd, addr, length, handle, lkey, rkey (infiniband/verbs.h)
    assert verbs.ffi.offsetof("struct ibv_mr", "lkey") == 36
    assert verbs.ffi.offsetof("struct ibv_mr", "rkey") == 40
    assert verbs.ffi.sizeof("struct ibv_mr") == 48


@pytest.mark.parametrize("offset, length, iova, fd, access, match", [
    (-1, 4096, 0, 3, 1, "offset"),
    (0, 0, 0, 3, 1, "length"),
    (0, -4096, 0, 3, 1, "length"),
    (0, 4096, -1, 3, 1, "iova"),
    (1 << 64, 4096, 1 << 64, 3, 1, "overflows"),
    (0, 4096, (1 << 64) - 4096 + 0x1000, 3, 1, "overflows"),
    (0x100, 4096, 0x200, 3, 1, "low 12 bits"),
    (0, 4096, 0, -2, 1, "not a file descriptor"),
    (0, 4096, 0, 3, 1 << 20, "unknown access"),
])
def test_bad_arguments_are_refused_before_the_call(offset, length, iova, fd, access, match) -> None:
    with pytest.raises(UsageError, match=match):
        verbs.check_dmabuf_args(offset, length, iova, fd, access)


def test_good_arguments_pass() -> None:
    verbs.check_dmabuf_args(0x1000, 1 << 20, 0x7F00_0000_1000, 5,
                            verbs.Access.LOCAL_WRITE | verbs.Access.REMOTE_WRITE)


def test_unknown_device_is_a_clear_error() -> None:
    with pytest.raises(P2PHubOSError) as exc:
        verbs.VerbsPd.open("no-such-rdma-device")
    assert exc.value.errno in (errno.ENODEV, errno.ENOSYS, errno.ENOENT)
