"""The lab is what tools/lab promises: the devices, the nodes, the IOMMU when asked."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

PCI = Path("/sys/bus/pci/devices")


def test_baseline_nvme_is_on_the_kernel_driver(lab: dict[str, str]) -> None:
    driver = (PCI / lab["nvme_baseline"] / "driver").resolve().name
    assert driver == "nvme"


def test_target_nvme_has_two_namespaces(lab: dict[str, str]) -> None:
    assert (PCI / lab["nvme_target"] / "vendor").read_text().strip() == "0x1b36"
    ctrl = lab["nvme_target_ctrl"]
    if (PCI / lab["nvme_target"] / "driver").resolve().name == "nvme":
        blocks = {p.name for p in Path(f"/sys/class/nvme/{ctrl}").glob("nvme*n*")}
        sizes = sorted(int(Path(f"/sys/class/nvme/{ctrl}/{b}/queue/logical_block_size").read_text())
                       for b in blocks)
        assert sizes == [512, 4096]


def test_stand_in_gpu_bar_is_the_host_file(lab: dict[str, str]) -> None:
    resource = (PCI / lab["gpu"] / "resource").read_text().splitlines()
    start, end, _ = (int(x, 16) for x in resource[2].split())
    assert end - start + 1 == os.path.getsize(lab["gpu_file"]) == 64 << 20


def _tx_packets(netdev: str) -> int:
    return int(Path(f"/sys/class/net/{netdev}/statistics/tx_packets").read_text())


def test_two_nodes_with_active_rxe(lab: dict[str, str]) -> None:
    out = subprocess.run(["rdma", "link", "show"], capture_output=True, text=True, check=True).stdout
    for dev in (lab["node_a_rdma"], lab["node_b_rdma"]):
        line = next(l for l in out.splitlines() if f" {dev}/" in l)
        assert "state ACTIVE" in line, line


def test_traffic_between_nodes_crosses_the_veth_pair(lab: dict[str, str]) -> None:
    before = _tx_packets(lab["node_a_netdev"])
    ping = subprocess.run(["ping", "-c", "2", "-W", "5", "-I", lab["node_a_addr"], lab["node_b_addr"]],
                          capture_output=True, text=True)
    assert ping.returncode == 0, ping.stdout + ping.stderr
    assert _tx_packets(lab["node_a_netdev"]) >= before + 2


def test_rdma_between_nodes(lab: dict[str, str]) -> None:
    server = subprocess.Popen(["timeout", "60", "ibv_rc_pingpong", "-d", lab["node_b_rdma"], "-g", "1",
                               "-n", "3", "-p", "18515"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        for _ in range(50):  # until the server listens
            ss = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout
            if ":18515" in ss:
                break
            time.sleep(0.2)
        client = subprocess.run(["timeout", "60", "ibv_rc_pingpong", "-d", lab["node_a_rdma"], "-g", "1",
                                 "-n", "3", "-p", "18515", lab["node_b_addr"]],
                                capture_output=True, text=True)
        assert client.returncode == 0, client.stdout + client.stderr
    finally:
        out, _ = server.communicate(timeout=60)
    assert server.returncode == 0, out


def test_iommu_as_asked(lab: dict[str, str]) -> None:
    group = PCI / lab["nvme_target"] / "iommu_group"
    if lab["iommu"] == "1":
        assert (group / "type").read_text().strip().startswith("DMA")
    else:
        assert not group.exists()


def test_vgem_is_loaded() -> None:
    assert Path("/sys/module/vgem").exists()
