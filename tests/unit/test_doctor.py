"""p2phub doctor: config-space parsing, classification details, CLI exit codes, JSON, unprivileged mode."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import tarfile
from contextlib import redirect_stdout

import pytest

from p2phub.cli import main
from p2phub.doctor import SCHEMA
from p2phub.doctor.core import diagnose
from p2phub.doctor.pcie import acs_bits_str, parse_config
from p2phub.doctor.route import allow_entry
from p2phub.doctor.sysroot import SysRoot

pytestmark = pytest.mark.unit

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "doctor")


def fx(name: str) -> str:
    return os.path.join(FIX, name)


def run_cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(list(argv))
    return rc, buf.getvalue()


# ---------------------------------------------------------------------------- config space
def _cfg(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_parse_switch_downstream_port_acs() -> None:
    cs = parse_config(_cfg(fx("broadwell-plx-acs/sys/bus/pci/devices/0000:03:08.0/config")))
    assert cs.reason is None and cs.port_type == "downstream-port"
    assert cs.acs_ctrl == 0x001D and cs.acs_redirect is True
    assert acs_bits_str(cs.acs_ctrl) == ("SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- "
                                         "DirectTrans-")


def test_acs_without_redirect_bits() -> None:
    cs = parse_config(_cfg(fx("broadwell-plx-acs/sys/bus/pci/devices/0000:07:08.0/config")))
    assert cs.acs_ctrl == 0x0011 and cs.acs_redirect is False  # SV and UF do not redirect


def test_ats_and_rebar_on_endpoints() -> None:
    nic = parse_config(_cfg(fx("epyc-rome-gpp/sys/bus/pci/devices/0000:01:00.0/config")))
    assert nic.ats_cap and nic.ats_enabled and nic.port_type == "endpoint"
    gpu = parse_config(_cfg(fx("epyc-rome-gpp/sys/bus/pci/devices/0000:41:00.0/config")))
    assert gpu.ats_cap and gpu.ats_enabled is False
    assert gpu.rebar == [(0, 32 << 30)]


def test_unprivileged_config_is_unknown_with_reason() -> None:
    cs = parse_config(_cfg(fx("epyc-rome-gpp/sys/bus/pci/devices/0000:40:01.1/config"))[:64])
    assert cs.reason and "CAP_SYS_ADMIN" in cs.reason
    assert cs.acs_redirect is None


def test_broken_capability_lists_terminate() -> None:
    b = bytearray(4096)
    struct.pack_into("<HH", b, 0, 0x10DE, 0x2335)
    struct.pack_into("<H", b, 6, 0x10)
    b[0x34] = 0x40
    b[0x40:0x42] = bytes([0x01, 0x40])                      # loops onto itself
    struct.pack_into("<I", b, 0x100, 0x000D | (0x100 << 20))  # ext cap pointing at itself
    cs = parse_config(bytes(b))
    assert cs.ext_caps == [0x000D]


def test_allow_list() -> None:
    assert allow_entry(0x8086, 0x2020) == (True, None)
    assert allow_entry(0x8086, 0x2F00) == (True, "same-host-bridge")
    assert allow_entry(0x8086, 0x6F00) == (False, None)   # Broadwell-EP: not listed
    assert allow_entry(0x1AE0, 0x1234)[0]                  # Google: any device


# ---------------------------------------------------------------------------- classification
def test_broadwell_acs_blockers_and_fix() -> None:
    rep = diagnose(SysRoot(fx("broadwell-plx-acs")))
    p = next(p for p in rep.pairs if (p.provider, p.client) == ("GPU0", "NVMe0"))
    assert p.lca == "0000:02:00.0" and p.acs_blockers == ["0000:03:08.0", "0000:03:10.0"]
    assert p.host_bridge["allowed"] is False and "8086:6f00" in p.host_bridge["rule"]
    assert any("pci=disable_acs_redir=0000:03:08.0;0000:03:10.0" in f for f in p.fixes)
    acs = rep.check("pcie.acs")
    assert "0000:03:08.0" in acs.applies_to and "disable_acs_redir" in (acs.fix or "")
    nvme1 = [p for p in rep.pairs if p.client == "NVMe1"]
    assert all("nvme.safety" in p.because for p in nvme1)


def test_epyc_zen_rule_and_direct_switch_pair() -> None:
    rep = diagnose(SysRoot(fx("epyc-rome-gpp")))
    p = next(p for p in rep.pairs if (p.provider, p.client) == ("GPU1", "NVMe1"))
    assert p.map_type == "BUS_ADDR" and p.iommu == "bypassed" and p.gbps == 7.9
    q = next(p for p in rep.pairs if (p.provider, p.client) == ("GPU0", "NIC0"))
    assert q.host_bridge["allowed"] is True and "Zen" in q.host_bridge["rule"]


def test_h200_states_why_p2p_cannot_work() -> None:
    rep = diagnose(SysRoot(fx("h200-firecracker")))
    why = " ".join(rep.why_not())
    # an NVIDIA GPU: p2phub's path (the NVIDIA P2P API) does not need the kernel's P2PDMA
    assert "kernel.p2pdma" not in why and rep.check("kernel.p2pdma").status == "INFO"
    assert "topology.peers" in why and "no P2P peers" in why
    assert "kmod.loadable" in why and "signed modules only" in why
    gpu = rep.top.gpus[0]
    assert gpu.bdf == "0000:00:06.0" and gpu.info["bar_bytes"] == 256 << 30
    assert rep.check("host.virt").details["virt"] == "Firecracker"


# ---------------------------------------------------------------------------- CLI and JSON
def test_json_schema_and_exit_codes() -> None:
    rc, out = run_cli("doctor", "--root", fx("epyc-rome-gpp"), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["schema"] == SCHEMA == "p2phub.doctor/1"
    assert set(doc) >= {"schema", "tool", "host", "devices", "pairs", "checks", "summary"}
    assert doc["summary"]["gpu_nvme"] == "degraded"
    pair = doc["pairs"][0]
    assert set(pair) >= {"provider", "client", "class", "distance", "kernel", "iommu", "verdict", "because"}
    for c in doc["checks"]:
        assert set(c) >= {"id", "title", "status", "summary", "fix", "evidence"}
    assert run_cli("doctor", "--root", fx("epyc-rome-gpp"), "--strict", "-q")[0] == 2
    assert run_cli("doctor", "--root", fx("h200-firecracker"), "-q")[0] == 1
    assert run_cli("doctor", "--root", "/nonexistent/tree", "-q")[0] == 4
    assert run_cli("doctor", "--bogus-option")[0] == 4
    assert run_cli("doctor", "--explain", "no.such.check")[0] == 4
    rc, out = run_cli("doctor", "--explain", "pcie.acs")
    assert rc == 0 and "ACS" in out


def test_rich_report_renders(tmp_path) -> None:
    for name in ("broadwell-plx-acs", "h200-firecracker"):
        rc, out = run_cli("doctor", "--root", fx(name), "--no-color", "-v")
        assert "p2phub doctor" in out and "Traceback" not in out
    rc, out = run_cli("doctor", "--root", fx("h200-firecracker"), "--no-color")
    assert "P2P cannot work here because" in out and "[topology.peers]" in out


def test_tarball_root(tmp_path) -> None:
    tgz = tmp_path / "cap.tar.gz"
    with tarfile.open(tgz, "w:gz") as tf:
        tf.add(fx("h200-firecracker"), arcname="h200")
    rc, out = run_cli("doctor", "--root", str(tgz), "--json")
    assert rc == 1 and json.loads(out)["devices"][0]["bdf"] == "0000:00:06.0"


def _unprivileged_copy(tmp_path, name: str) -> str:
    dst = str(tmp_path / name)
    shutil.copytree(fx(name), dst, symlinks=True)
    for dirpath, _, files in os.walk(os.path.join(dst, "sys", "devices")):
        if "config" in files:
            p = os.path.join(dirpath, "config")
            with open(p, "rb") as f:
                head = f.read(64)
            with open(p, "wb") as f:
                f.write(head)
    meta = os.path.join(dst, "p2phub-capture.json")
    with open(meta) as f:
        m = json.load(f)
    m["euid"] = 65534
    with open(meta, "w") as f:
        json.dump(m, f)
    return dst


def test_unprivileged_mode_reports_unknown(tmp_path) -> None:
    root = _unprivileged_copy(tmp_path, "epyc-rome-gpp")
    rep = diagnose(SysRoot(root))
    assert rep.check("host.privilege").status == "WARN"
    assert rep.check("pcie.acs").status == "UNKNOWN"
    assert rep.check("pcie.ats").status == "UNKNOWN"
    assert {p.verdict for p in rep.pairs} == {"UNKNOWN"}
    assert all(p.map_type == "UNKNOWN" for p in rep.pairs)
    dev = rep.top.pci["0000:40:01.1"]
    assert "CAP_SYS_ADMIN" in (dev.cfg.reason or "")
    assert rep.exit_code() == 3
    rc, _ = run_cli("doctor", "--root", root, "-q")
    assert rc == 3


def test_live_system_does_not_crash() -> None:
    rep = diagnose(SysRoot("/"))
    assert rep.checks and all(c.summary for c in rep.checks)
    assert rep.exit_code() in (0, 1, 2, 3)


def test_active_is_a_clear_skip() -> None:
    rep = diagnose(SysRoot("/"), active=True)  # no p2phub.ko on the development machine
    c = rep.check("pair.active")
    assert c.status == "SKIP" and ("p2phub.ko" in c.summary)


def test_active_outcome_is_shown_in_the_text_report() -> None:
    rc, out = run_cli("doctor", "--root", fx("lab-switch-6.12"), "--no-color")
    assert "pair.active" not in out
    rc, out = run_cli("doctor", "--root", fx("lab-switch-6.12"), "--no-color", "--active",
                      "--active-nvme", "0000:03:00.0")
    assert "pair.active" in out and "live system" in out


def test_active_skips_on_a_captured_tree() -> None:
    from p2phub.doctor.active import ActiveOptions
    rep = diagnose(SysRoot(fx("epyc-rome-gpp")), active=True, active_opts=ActiveOptions(nvme="0000:42:00.0"))
    c = rep.check("pair.active")
    assert c.status == "SKIP" and "live system" in c.summary


@pytest.mark.parametrize("argv, msg", [
    (["--active-nvme", "0000:01:00.0"], "need --active"),
    (["--active", "--active-write", "--active-nvme", "0000:01:00.0"], "needs --active-lba"),
    (["--active", "--active-nvme", "nonsense"], "not a PCI address"),
    (["--active", "--active-nvme", "0000:01:00.0", "--active-bytes", "0"], "--active-bytes"),
    (["--active", "--active-nvme", "0000:01:00.0", "--active-lba", "-1"], "--active-lba"),
])
def test_active_usage_errors(argv: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_cli("doctor", "--root", fx("epyc-rome-gpp"), *argv)
    assert rc == 4 and out == ""
    assert msg in capsys.readouterr().err


def test_active_options_accept_a_short_bdf() -> None:
    from p2phub.doctor.active import ActiveOptions, ActiveUsageError
    ActiveOptions(nvme="01:00.0").validate()
    ActiveOptions(nvme="0000:0A:00.0").validate()
    with pytest.raises(ActiveUsageError, match=r"--active-nvme: not a PCI address: '0000:01:20.0' "
                                               r"\(device number 0x20 is above 0x1f\)"):
        ActiveOptions(nvme="0000:01:20.0").validate()


# ---------------------------------------------------------------------------- the lab's stand-in GPU
STANDIN = "sys/devices/pci0000:00/0000:00:0a.0/0000:01:00.0/0000:02:01.0/0000:04:00.0"


def test_stand_in_gpu_is_a_gpu_only_with_p2phub_fakegpu_bound(tmp_path) -> None:
    rep = diagnose(SysRoot(fx("lab-switch-6.12")))
    [g] = rep.top.gpus
    assert (g.bdf, g.kind, g.vendor, g.driver, g.info["flavour"]) == \
        ("0000:04:00.0", "gpu", "p2phub stand-in", "p2phub_fakegpu", "standin")
    root = tmp_path / "tree"
    shutil.copytree(fx("lab-switch-6.12"), root, symlinks=True)
    os.unlink(root / STANDIN / "driver")  # ivshmem with no driver: an ordinary PCI function
    rep = diagnose(SysRoot(str(root)))
    assert rep.top.gpus == [] and rep.pairs == []
    assert rep.check("topology.peers").status == "FAIL"
    os.symlink("../../../../../../bus/pci/drivers/uio_pci_generic", root / STANDIN / "driver")
    assert diagnose(SysRoot(str(root))).top.gpus == []


def test_doctor_survives_an_unreadable_lab_env(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # in the lab an unprivileged user cannot read $P2PHUB_LAB_ENV; other commands' parsers read it
    monkeypatch.setenv("P2PHUB_LAB_ENV", str(tmp_path))  # a directory: read_text() raises like EACCES
    rc, out = run_cli("doctor", "--root", fx("lab-switch-6.12"), "--json")
    assert rc == 0 and json.loads(out)["schema"] == SCHEMA


def test_unprivileged_acs_is_unknown_even_when_the_verdict_does_not_need_it(tmp_path) -> None:
    # no common bridge and a host bridge that is not allowed: NOT_SUPPORTED whatever the root ports'
    # ACS says, but "no ACS redirect" would be a guess (as root this tree shows ReqRedir+ on 00:0b.0)
    root = _unprivileged_copy(tmp_path, "lab-rootports-iommu-6.12")
    rep = diagnose(SysRoot(root))
    acs = rep.check("pcie.acs")
    assert acs.status == "UNKNOWN" and "0000:00:0b.0" in acs.summary and acs.fix == "run as root"
    # the kernel's P2PDMA would refuse the route; the stand-in's exporter does not consult it
    assert {(p.map_type, p.verdict) for p in rep.pairs} == {("NOT_SUPPORTED", "DEGRADED")}
    # the kernel also asks the provider itself (the stand-in GPU, 02:00.0 here)
    assert all(sorted(p.acs_unknown) == ["0000:00:0b.0", "0000:02:00.0"] for p in rep.pairs)


def test_kmod_loadable_names_the_captured_kernel(tmp_path) -> None:
    rep = diagnose(SysRoot(fx("broadwell-plx-acs")))
    c = rep.check("kmod.loadable")
    assert "the captured kernel 5.15.0-105-generic" in c.summary and c.details["kernel"] == "5.15.0-105-generic"
    # a tree that does not record its kernel's release: say so, never "/lib/modules//build"
    tree = tmp_path / "t"
    shutil.copytree(fx("broadwell-plx-acs"), tree, symlinks=True)
    meta = json.loads((tree / "p2phub-capture.json").read_text())
    meta.pop("uname", None)
    (tree / "p2phub-capture.json").write_text(json.dumps(meta))
    (tree / "proc/sys/kernel/osrelease").unlink(missing_ok=True)
    c = diagnose(SysRoot(str(tree))).check("kmod.loadable")
    assert c.status == "UNKNOWN" and "release not recorded" in c.summary and "//" not in c.summary


# ---------------------------------------------------------------------------- nvme.confined (H5)
def _iommu_lab(tmp_path, interrupts: str | None, unsafe: str | None = None, lockdown: str | None = None) -> str:
    tree = tmp_path / "t"
    shutil.copytree(fx("lab-rootports-iommu-6.12"), tree, symlinks=True)
    if interrupts is not None:
        (tree / "proc" / "interrupts").write_text(interrupts)
    if unsafe is not None:
        p = tree / "sys/module/p2phub/parameters"
        p.mkdir(parents=True, exist_ok=True)
        (p / "allow_unsafe_noiommu").write_text(unsafe + "\n")
    if lockdown is not None:
        p = tree / "sys/kernel/security"
        p.mkdir(parents=True, exist_ok=True)
        (p / "lockdown").write_text(lockdown + "\n")
    return str(tree)


IR = " 24:  0  IR-PCI-MSIX-0000:00:0a.0  0-edge  nvme0q0\n"
NO_IR = " 24:  0  PCI-MSIX-0000:00:0a.0  0-edge  nvme0q0\n"


def test_nvme_confined_with_translation_viable_groups_and_interrupt_remapping(tmp_path) -> None:
    c = diagnose(SysRoot(_iommu_lab(tmp_path, IR))).check("nvme.confined")
    assert c.status == "PASS" and "NVMe0" in c.summary and "NVMe1" in c.summary, c.summary


def test_nvme_not_confined_without_interrupt_remapping_and_what_the_module_does(tmp_path) -> None:
    # a module that predates the ownership gate hands it out: a warning, the pairs stay as they were
    rep = diagnose(SysRoot(_iommu_lab(tmp_path / "a", NO_IR)))
    c = rep.check("nvme.confined")
    assert c.status == "WARN" and "MSIs are not isolated" in c.summary and "predates" in c.summary
    assert not any("nvme.confined" in p.because for p in rep.pairs)
    # the gated module refuses: FAIL, and every GPU<->NVMe pair is blocked by it
    rep = diagnose(SysRoot(_iommu_lab(tmp_path / "b", NO_IR, unsafe="N")))
    c = rep.check("nvme.confined")
    assert c.status == "FAIL" and "will not hand one to user space" in c.summary and c.fix
    assert "iommu=pt" in c.fix or "passthrough" in c.fix
    assert all(p.verdict == "BLOCKED" and "nvme.confined" in p.because for p in rep.pairs)
    # loaded with allow_unsafe_noiommu=Y: the override covers untranslated DMA only, so MSIs
    # without interrupt remapping are still refused
    rep = diagnose(SysRoot(_iommu_lab(tmp_path / "c", NO_IR, unsafe="Y")))
    c = rep.check("nvme.confined")
    assert c.status == "FAIL" and "MSIs are not isolated" in c.summary, c.summary
    assert all(p.verdict == "BLOCKED" and "nvme.confined" in p.because for p in rep.pairs)
    # identity domains (iommu=pt), loaded with allow_unsafe_noiommu=Y: handed out, said to be worth root
    tree = _iommu_lab(tmp_path / "d", IR, unsafe="Y")
    for t in (tmp_path / "d" / "t" / "sys" / "kernel" / "iommu_groups").glob("*/type"):
        t.unlink()
        t.write_text("identity\n")
    rep = diagnose(SysRoot(tree))
    c = rep.check("nvme.confined")
    assert c.status == "WARN" and "allow_unsafe_noiommu=Y" in c.summary and "any memory" in c.summary, c.summary
    assert not any("nvme.confined" in p.because for p in rep.pairs)


def test_nvme_ownership_is_refused_under_lockdown(tmp_path) -> None:
    rep = diagnose(SysRoot(_iommu_lab(tmp_path, IR, lockdown="none [integrity] confidentiality")))
    c = rep.check("nvme.confined")
    assert c.status == "FAIL" and "lockdown=integrity" in c.summary
    assert all("nvme.confined" in p.because for p in rep.pairs)


def test_the_doctor_never_recommends_passthrough_without_its_cost() -> None:
    from p2phub.doctor.checks import REGISTRY, EXPLAIN
    from p2phub.doctor.core import diagnose as _d

    for name in ("broadwell-plx-acs", "lab-rootports-iommu-6.12"):
        for c in _d(SysRoot(fx(name))).checks:
            text = f"{c.summary} {c.fix or ''}"
            if "iommu=pt" in text:
                assert "confine" in text, (name, c.id, text)
    assert all("iommu=pt" not in EXPLAIN[cid] or "confine" in EXPLAIN[cid] for cid, *_ in REGISTRY)


# ---------------------------------------------------------------------------- --capture
def test_capture_of_this_host_reads_back_as_the_live_doctor_saw_it(tmp_path) -> None:
    from p2phub.doctor.capture import capture

    live = diagnose(SysRoot("/"))
    out = tmp_path / "cap"
    meta = capture(str(out))
    assert meta["schema"] == "p2phub.capture/1" and meta["uname"]["release"] == os.uname().release
    back = diagnose(SysRoot(str(out)))
    assert [(c.id, c.status) for c in back.checks] == [(c.id, c.status) for c in live.checks]
    # the same words, but for whose kernel it is
    assert {c.id: c.summary for c in back.checks if c.id != "kmod.loadable"} == \
        {c.id: c.summary for c in live.checks if c.id != "kmod.loadable"}
    assert [d.as_dict(back.top) for d in back.top.devices] == [d.as_dict(live.top) for d in live.top.devices]
    kallsyms = out / "proc" / "kallsyms"
    if kallsyms.exists():   # only the lines the doctor looks for, never the kernel's whole symbol table
        assert len(kallsyms.read_text().splitlines()) < 50


def test_capture_cli_refuses_a_non_empty_dir_and_writes_a_tarball(tmp_path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    rc, _ = run_cli("doctor", "--capture", str(busy))
    assert rc == 4
    rc, _ = run_cli("doctor", "--capture", str(tmp_path / "c"), "--root", fx("h200-firecracker"))
    assert rc == 4
    rc, out = run_cli("doctor", "--capture", str(tmp_path / "c"), "--tar")
    assert rc == 0 and out.strip().endswith("c.tar.gz")
    rc, out = run_cli("doctor", "--root", str(tmp_path / "c.tar.gz"), "--json")
    assert json.loads(out)["tool"]["source"].startswith("capture:")


def test_docs_list_every_check_with_its_phase() -> None:
    import re

    from p2phub.doctor.checks import REGISTRY

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "doctor.md")).read()
    rows = re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \| [^|]+ \| (host|pairs) \|", doc, flags=re.M)
    assert rows == [(cid, phase) for cid, _, _, phase in REGISTRY]
