"""The lab is what tools/lab promises: the devices, the nodes, the IOMMU when asked."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

PCI = Path("/sys/bus/pci/devices")


def test_baseline_nvme_is_on_the_kernel_driver(lab: dict[str, str]) -> None:
    driver = (PCI / lab["nvme_baseline"] / "driver").resolve().name
    assert driver == "nvme"


def test_target_nvme_has_two_namespaces(lab: dict[str, str]) -> None:
    assert (PCI / lab["nvme_target"] / "vendor").read_text().strip() == "0x1b36"
    ctrl = lab["nvme_target_ctrl"]
    if (PCI / lab["nvme_target"] / "driver").resolve().name == "nvme":
        blocks = {p.name for p in Path(f"/sys/class/nvme/{ctrl}").glob(f"nvme*n*")}
        sizes = sorted(int(Path(f"/sys/class/nvme/{ctrl}/{b}/queue/logical_block_size").read_text())
                       for b in blocks)
        assert sizes == [512, 4096]


def test_stand_in_gpu_bar_is_the_host_file(lab: dict[str, str]) -> None:
    resource = (PCI / lab["gpu"] / "resource").read_text().splitlines()
    start, end, _ = (int(x, 16) for x in resource[2].split())
    assert end - start + 1 == os.path.getsize(lab["gpu_file"]) == 64 << 20


def test_two_nodes_with_active_rxe(lab: dict[str, str]) -> None:
    out = subprocess.run(["rdma", "link", "show"], capture_output=True, text=True, check=True).stdout
    for dev in (lab["node_a_rdma"], lab["node_b_rdma"]):
        line = next(l for l in out.splitlines() if f" {dev}/" in l)
        assert "state ACTIVE" in line, line
    ping = subprocess.run(["ip", "netns", "exec", lab["node_a_netns"], "ping", "-c", "1", "-W", "5",
                           lab["node_b_addr"]], capture_output=True, text=True)
    assert ping.returncode == 0, ping.stdout + ping.stderr


def test_iommu_as_asked(lab: dict[str, str]) -> None:
    group = PCI / lab["nvme_target"] / "iommu_group"
    if lab["iommu"] == "1":
        assert (group / "type").read_text().strip().startswith("DMA")
    else:
        assert not group.exists()


def test_vgem_is_loaded() -> None:
    assert Path("/sys/module/vgem").exists()
