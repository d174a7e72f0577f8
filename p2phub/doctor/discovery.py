"""Discovery from sysfs/procfs: PCI tree, GPUs, NVMe controllers and namespaces, RDMA devices, NUMA."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .. import backend
from ..pci import PciAddress, root_bus
from .pcie import ConfigSpace, link_gbps, parse_config
from .sysroot import SysRoot

PCI_DEVICES = "/sys/bus/pci/devices"

VENDORS = {0x10DE: "NVIDIA", 0x1002: "AMD", 0x1022: "AMD", 0x8086: "Intel", 0x15B3: "Mellanox",
           0x14E4: "Broadcom", 0x1000: "Broadcom/LSI", 0x10B5: "PLX/Broadcom", 0x144D: "Samsung",
           0x1AF4: "Red Hat (virtio)", 0x1B36: "Red Hat (QEMU)", 0x1D0F: "Amazon", 0x1AE0: "Google",
           0x1D17: "Zhaoxin", 0x8086 + 0: "Intel", 0x1E0F: "KIOXIA", 0x1C5C: "SK hynix", 0x126F: "Silicon Motion",
           0x1CC1: "ADATA", 0x15AD: "VMware", 0x1234: "QEMU"}

GPU_VENDORS = {0x10DE: "nvidia", 0x1002: "amd"}
# Other GPUs are those a backend plugin claims (p2phub.backend.discover_gpu: entry point group
# p2phub.backends), from the same sysfs facts: vendor, device, class and bound driver.


@dataclass
class PciDev:
    bdf: str
    sysfs: str = ""
    host_bridge: str | None = None
    chain: list[str] = field(default_factory=list)   # upstream bridges, nearest first
    cls: int = 0
    vendor: int = 0
    device: int = 0
    driver: str | None = None
    numa_node: int | None = None
    link: dict[str, Any] = field(default_factory=dict)
    iommu_group: str | None = None
    iommu_type: str | None = None
    cfg: ConfigSpace | None = None
    resources: list[tuple[int, int, int]] = field(default_factory=list)
    p2pmem: dict[str, Any] | None = None
    physfn: str | None = None

    @property
    def is_bridge(self) -> bool:
        return (self.cls >> 8) == 0x0604

    @property
    def vendor_name(self) -> str:
        return VENDORS.get(self.vendor, f"{self.vendor:04x}")

    def bar_size(self, index: int) -> int | None:
        if index >= len(self.resources):
            return None
        start, end, _ = self.resources[index]
        return (end - start + 1) if end > start else 0

    def as_dict(self) -> dict[str, Any]:
        return {"bdf": self.bdf, "vendor": f"0x{self.vendor:04x}", "device": f"0x{self.device:04x}",
                "class": f"0x{self.cls:06x}", "driver": self.driver, "numa_node": self.numa_node,
                "host_bridge": self.host_bridge, "chain": self.chain, "link": self.link,
                "iommu": {"group": self.iommu_group, "type": self.iommu_type},
                "config": self.cfg.as_dict() if self.cfg else None, "p2pmem": self.p2pmem}


@dataclass
class Device:
    """A GPU, NVMe controller or RDMA device the doctor reports on."""

    id: str
    kind: str                     # gpu | nvme | nic
    name: str
    bdf: str | None
    vendor: str = ""
    driver: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def as_dict(self, top: "Topology") -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "kind": self.kind, "name": self.name, "bdf": self.bdf,
                             "vendor": self.vendor, "driver": self.driver}
        d.update(self.info)
        pd = top.pci.get(self.bdf or "")
        if pd is not None:
            d["pci"] = pd.as_dict()
        return d


@dataclass
class Topology:
    sys: SysRoot
    pci: dict[str, PciDev] = field(default_factory=dict)
    host_bridge_ids: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    cpu: dict[str, Any] = field(default_factory=dict)
    gpus: list[Device] = field(default_factory=list)
    nvmes: list[Device] = field(default_factory=list)
    nics: list[Device] = field(default_factory=list)
    numa: dict[str, Any] = field(default_factory=dict)
    modules: set[str] = field(default_factory=set)
    privileged: bool = False

    @property
    def devices(self) -> list[Device]:
        return self.gpus + self.nvmes + self.nics

    def device(self, ident: str) -> Device | None:
        for d in self.devices:
            if d.id == ident or d.name == ident or d.bdf == ident:
                return d
        return None

    def path_gbps(self, bdfs: list[str]) -> float | None:
        vals = [self.pci[b].link.get("gbps") for b in bdfs if b in self.pci]
        vals = [v for v in vals if v]
        return min(vals) if vals else None


def _hex(sr: SysRoot, path: str) -> int:
    v = sr.read_int(path, 16)
    return v if v is not None else 0


def read_pci(sr: SysRoot, bdf: str) -> PciDev:
    base = f"{PCI_DEVICES}/{bdf}"
    real = sr.resolve(base)
    d = PciDev(bdf=bdf, sysfs=real)
    parts = [p for p in real.split("/") if p]
    hb_idx = next((i for i, p in enumerate(parts) if root_bus(p)), None)
    if hb_idx is not None:
        d.host_bridge = parts[hb_idx]
        ups = [p for p in parts[hb_idx + 1:] if PciAddress.is_canonical(p)]
        if ups and ups[-1] == bdf:
            ups = ups[:-1]
        d.chain = list(reversed(ups))
    d.cls = _hex(sr, f"{base}/class")
    d.vendor = _hex(sr, f"{base}/vendor")
    d.device = _hex(sr, f"{base}/device")
    d.driver = sr.readlink_name(f"{base}/driver")
    d.numa_node = sr.read_int(f"{base}/numa_node", 10)
    link: dict[str, Any] = {}
    for k in ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width"):
        v = sr.read(f"{base}/{k}")
        if v is not None:
            link[k] = int(v) if k.endswith("width") and v.isdigit() else v
    if link:
        link["gbps"] = link_gbps(link.get("current_link_speed"), link.get("current_link_width"))
        link["max_gbps"] = link_gbps(link.get("max_link_speed"), link.get("max_link_width"))
    d.link = link
    grp = sr.readlink_name(f"{base}/iommu_group")
    if grp is not None:
        d.iommu_group = grp
        d.iommu_type = sr.read(f"/sys/kernel/iommu_groups/{grp}/type")
    data, reason = sr.read_bytes(f"{base}/config", 4096)
    d.cfg = parse_config(data, reason)
    res = sr.read(f"{base}/resource")
    if res:
        for line in res.splitlines():
            try:
                s, e, f = (int(x, 16) for x in line.split()[:3])
            except ValueError:
                continue
            d.resources.append((s, e, f))
    if sr.isdir(f"{base}/p2pmem"):
        d.p2pmem = {k: sr.read_int(f"{base}/p2pmem/{k}", 10) for k in ("size", "available", "published")}
    pf = sr.readlink_name(f"{base}/physfn")
    d.physfn = pf
    return d


def read_cpu(sr: SysRoot) -> dict[str, Any]:
    u = sr.uname()
    cpu: dict[str, Any] = {"arch": u.get("machine"), "kernel": u.get("release")}
    text = sr.read("/proc/cpuinfo") or ""
    block = text.split("\n\n")[0] if text else ""
    kv: dict[str, str] = {}
    for line in block.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            kv.setdefault(k.strip(), v.strip())
    cpu["vendor"] = kv.get("vendor_id") or kv.get("CPU implementer")
    fam = kv.get("cpu family")
    cpu["family"] = int(fam) if fam and fam.isdigit() else None
    cpu["model_name"] = kv.get("model name")
    cpu["cpu_part"] = kv.get("CPU part")
    flags = (kv.get("flags") or kv.get("Features") or "").split()
    cpu["hypervisor"] = "hypervisor" in flags
    if not cpu.get("arch"):
        if kv.get("vendor_id"):
            cpu["arch"] = "x86_64"
        elif kv.get("CPU implementer"):
            cpu["arch"] = "aarch64"
    return cpu


def read_modules(sr: SysRoot) -> set[str]:
    mods = set(sr.listdir("/sys/module"))
    text = sr.read("/proc/modules")
    if text:
        mods |= {ln.split()[0] for ln in text.splitlines() if ln.strip()}
    return mods


def _ns_sort(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", name))


def discover(sr: SysRoot) -> Topology:
    top = Topology(sys=sr)
    top.cpu = read_cpu(sr)
    top.modules = read_modules(sr)
    top.privileged = sr.euid == 0
    for bdf in sr.listdir(PCI_DEVICES):
        if PciAddress.is_canonical(bdf):
            top.pci[bdf] = read_pci(sr, bdf)
    # host bridges: the first device (devfn 00.0) of each root bus
    for d in top.pci.values():
        if d.host_bridge and d.host_bridge not in top.host_bridge_ids:
            first = root_bus(d.host_bridge)
            assert first
            fd = top.pci.get(str(first))
            top.host_bridge_ids[d.host_bridge] = (fd.vendor, fd.device) if fd else None
    # NUMA
    online = sr.read("/sys/devices/system/node/online")
    nodes = [n for n in sr.listdir("/sys/devices/system/node") if re.match(r"^node\d+$", n)]
    top.numa = {"online": online, "nodes": {}}
    for n in nodes:
        dist = sr.read(f"/sys/devices/system/node/{n}/distance")
        top.numa["nodes"][n] = {"cpulist": sr.read(f"/sys/devices/system/node/{n}/cpulist"),
                                "distance": [int(x) for x in dist.split()] if dist else None}
    _find_gpus(sr, top)
    _find_nvme(sr, top)
    _find_nics(sr, top)
    return top


def _find_gpus(sr: SysRoot, top: Topology) -> None:
    n = 0
    for bdf, d in sorted(top.pci.items()):
        base = d.cls >> 16
        flavour = None
        claim = None
        if base == 0x03 and d.vendor in GPU_VENDORS:
            flavour = GPU_VENDORS[d.vendor]
        else:
            found = backend.discover_gpu(backend.PciFunction(bdf, d.vendor, d.device, d.cls, d.driver))
            if found is not None:
                plugin, claim = found
                flavour = claim.flavour
        if flavour is None:
            continue
        info: dict[str, Any] = {"flavour": flavour, "numa_node": d.numa_node}
        # the peer-visible aperture: NVIDIA's "BAR1" and AMD's VRAM BAR are the largest memory BAR (their
        # sysfs index depends on whether BAR0 is 64-bit); a plugin's GPU names its own
        sizes = [(d.bar_size(i) or 0, i) for i in range(min(6, len(d.resources)))]
        bar_index = claim.p2p_bar if claim else (max(sizes)[1] if sizes and max(sizes)[0] else 1)
        info["p2p_bar"] = bar_index
        info["bar_bytes"] = d.bar_size(bar_index)
        if flavour == "amd":
            b = f"{PCI_DEVICES}/{bdf}"
            info["vram_total"] = sr.read_int(f"{b}/mem_info_vram_total", 10)
            info["vis_vram_total"] = sr.read_int(f"{b}/mem_info_vis_vram_total", 10)
        if claim is not None:
            info.update(claim.info)
            info["backend"] = plugin
            name, vendor = claim.name, claim.vendor
        else:
            name, vendor = {"nvidia": "NVIDIA", "amd": "AMD"}[flavour], d.vendor_name
        top.gpus.append(Device(f"GPU{n}", "gpu", f"{name} {d.vendor:04x}:{d.device:04x}", bdf,
                               vendor, d.driver, info))
        n += 1


def _pci_of(sr: SysRoot, path: str) -> str | None:
    """The BDF of the nearest PCI device above a sysfs path (a class device's ``device`` link)."""
    real = sr.resolve(path)
    bdfs = [p for p in real.split("/") if PciAddress.is_canonical(p)]
    return bdfs[-1] if bdfs else None


def _find_nvme(sr: SysRoot, top: Topology) -> None:
    ctrls = [c for c in sr.listdir("/sys/class/nvme") if re.match(r"^nvme\d+$", c)]
    ctrls.sort(key=_ns_sort)
    # namespaces per controller, from /sys/block (handles native multipath: nvmeXnY under a subsystem)
    ns_of: dict[str, list[str]] = {c: [] for c in ctrls}
    for blk in sr.listdir("/sys/block"):
        if not re.match(r"^nvme\d+n\d+$", blk):
            continue
        real = sr.resolve(f"/sys/block/{blk}")
        parts = real.split("/")
        owners = [p for p in parts if re.match(r"^nvme\d+$", p)]
        if not owners:
            subsys = next((p for p in parts if p.startswith("nvme-subsys")), None)
            if subsys:
                owners = [c for c in sr.listdir(f"/sys/class/nvme-subsystem/{subsys}") if re.match(r"^nvme\d+$", c)]
        for o in owners or [re.sub(r"n\d+$", "", blk)]:
            ns_of.setdefault(o, []).append(blk)
    for i, c in enumerate(ctrls):
        base = f"/sys/class/nvme/{c}"
        transport = sr.read(f"{base}/transport")
        bdf = _pci_of(sr, f"{base}/device") if transport in (None, "pcie") else None
        info: dict[str, Any] = {"transport": transport, "model": sr.read(f"{base}/model"),
                                "firmware": sr.read(f"{base}/firmware_rev")}
        nss = []
        for ns in sorted(set(ns_of.get(c, [])), key=_ns_sort):
            nss.append(_namespace(sr, ns))
        info["namespaces"] = nss
        pd = top.pci.get(bdf or "")
        top.nvmes.append(Device(f"NVMe{i}", "nvme", c, bdf, pd.vendor_name if pd else "",
                                pd.driver if pd else None, info))


def _namespace(sr: SysRoot, ns: str) -> dict[str, Any]:
    base = f"/sys/block/{ns}"
    parts = [p for p in sr.listdir(base) if p.startswith(ns + "p")]
    holders = {ns: sr.listdir(f"{base}/holders")}
    for p in parts:
        holders[p] = sr.listdir(f"{base}/{p}/holders")
    size = sr.read_int(f"{base}/size", 10)
    return {"name": ns, "partitions": parts, "holders": {k: v for k, v in holders.items() if v},
            "size_bytes": size * 512 if size is not None else None}


def _find_nics(sr: SysRoot, top: Topology) -> None:
    n = 0
    for dev in sr.listdir("/sys/class/infiniband"):
        base = f"/sys/class/infiniband/{dev}"
        bdf = None
        if sr.exists(f"{base}/device"):
            bdf = _pci_of(sr, f"{base}/device")
        netdevs = sr.listdir(f"{base}/device/net") if bdf else []
        parent = sr.read(f"{base}/parent") if not bdf else None
        if parent:
            netdevs = [parent]
        ports = {}
        for p in sr.listdir(f"{base}/ports"):
            pb = f"{base}/ports/{p}"
            ports[p] = {k: sr.read(f"{pb}/{k}") for k in ("state", "phys_state", "link_layer", "rate")}
        soft = bdf is None or dev.startswith(("rxe", "siw"))
        info = {"node_type": sr.read(f"{base}/node_type"), "netdevs": netdevs, "ports": ports,
                "soft": soft, "fw_ver": sr.read(f"{base}/fw_ver")}
        pd = top.pci.get(bdf or "")
        top.nics.append(Device(f"NIC{n}", "nic", dev, bdf, pd.vendor_name if pd else "",
                               pd.driver if pd else None, info))
        n += 1
