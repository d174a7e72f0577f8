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


def test_one_notice_when_an_auto_hub_chooses_staged_mode(tmp_path, monkeypatch) -> None:
    import io
    import logging

    from p2phub import hub as hubmod
    from p2phub.log import configure
    monkeypatch.setattr(hubmod, "_said", set())
    out = io.StringIO()
    log = logging.getLogger("p2phub")
    saved = (log.level, list(log.handlers), log.propagate)
    try:
        configure("info", stream=out)
        Hub(str(tmp_path / "absent")).close()
        Hub(str(tmp_path / "absent")).close()
    finally:
        log.setLevel(saved[0])
        log.handlers[:] = saved[1]
        log.propagate = saved[2]
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "staged mode" in lines[0] and "absent" in lines[0], lines


def test_p2phub_log_debug_configures_the_logger_for_a_library_user() -> None:
    import subprocess
    import sys
    code = ("import logging, p2phub\n"
            "logging.getLogger('p2phub.kv').debug('hello from the library')\n")
    import os
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, P2PHUB_LOG="debug"))
    assert "p2phub.kv DEBUG: hello from the library" in r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "P2PHUB_LOG"})
    assert r.stderr == ""


def test_register_over_rlimit_memlock_names_the_limit(monkeypatch) -> None:
    """REGISTER's ENOMEM over RLIMIT_MEMLOCK says so, with the figures and how to raise it; an
    ENOMEM the limit cannot explain gets no such claim."""
    import errno
    import resource

    from p2phub import device, uapi
    monkeypatch.setattr(resource, "getrlimit", lambda _: (64 << 10, 64 << 10))
    fields = {"CapEff": "0000000000000000", "VmPin": "60 kB"}
    monkeypatch.setattr(device, "_status_field", lambda name: fields.get(name, ""))
    exc = device.ioctl_error(OSError(errno.ENOMEM, "x"), uapi.REGISTER, "P2PHUB_REGISTER m", 8192)
    assert exc.errno == errno.ENOMEM
    assert "over RLIMIT_MEMLOCK" in str(exc) and "ulimit -l" in str(exc) and "68 KiB" in str(exc)
    assert "RLIMIT_MEMLOCK" not in str(device.ioctl_error(OSError(errno.ENOMEM, "x"), uapi.REGISTER,
                                                          "r", 4096))   # 64 KiB fits
    fields["CapEff"] = f"{1 << device.CAP_IPC_LOCK:016x}"                 # exempt
    assert "RLIMIT_MEMLOCK" not in str(device.ioctl_error(OSError(errno.ENOMEM, "x"), uapi.REGISTER,
                                                          "r", 8192))


def test_open_over_max_files_per_user_names_the_parameter(monkeypatch, tmp_path) -> None:
    from p2phub import device
    (tmp_path / "max_files_per_user").write_text("3\n")
    monkeypatch.setattr(device, "PARAMS", str(tmp_path))
    assert "max_files_per_user (3)" in device.files_limit_detail()
    monkeypatch.setattr(device, "PARAMS", str(tmp_path / "absent"))
    assert device.files_limit_detail() == ""
