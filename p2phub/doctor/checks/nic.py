"""nic.*: RDMA devices and their dma-buf MR support."""

from __future__ import annotations

from .. import probes
from ..model import FAIL, INFO, PASS, SKIP, UNKNOWN, WARN, CheckResult
from .base import Context, R, check

@check("nic.devices", "RDMA devices")
def _nics(ctx: Context) -> CheckResult:
    """RDMA devices with a PCI function are GPU<->NIC P2P candidates; soft devices (rxe, siw) have no
    PCI function and cannot do P2P. A port must be ACTIVE to carry traffic."""
    if not ctx.top.nics:
        return R(SKIP, "no RDMA devices", evidence=ctx.ev("/sys/class/infiniband"))
    rows, down = {}, []
    for n in ctx.top.nics:
        ports = n.info.get("ports", {})
        st = ",".join(f"{p}:{(v.get('state') or '?').split(':')[-1].strip()}" for p, v in ports.items())
        rows[n.id] = f"{n.name} ({'soft, ' if n.info.get('soft') else ''}{n.bdf or 'no PCI'}; "\
                     f"netdev {','.join(n.info.get('netdevs') or []) or '-'}; ports {st})"
        if not n.info.get("soft") and not any("ACTIVE" in (v.get("state") or "") for v in ports.values()):
            down.append(n.id)
    desc = "; ".join(rows.values())
    if all(n.info.get("soft") for n in ctx.top.nics):
        return R(INFO, "only soft RDMA devices (no P2P): " + desc, nics=rows)
    if down:
        return R(WARN, "no ACTIVE port on " + ", ".join(down) + ": " + desc, "bring the link up (cable, switch, "
                 "ip link set <netdev> up)", nics=rows)
    return R(PASS, desc, nics=rows)


@check("nic.dmabuf_mr", "RDMA dma-buf MR support")
def _nic_dmabuf(ctx: Context) -> CheckResult:
    """ibv_reg_dmabuf_mr with fd -1 (NCCL's probe): EOPNOTSUPP, ENOSYS or EPROTONOSUPPORT means the
    kernel or provider cannot register dma-buf memory; any other error (EBADF) means it can. It is
    p2phub.rdma's own probe (p2phub/rdma/probe.py), so this check and the MR path p2phub.rdma picks
    always agree."""
    hw = [n for n in ctx.top.nics if not n.info.get("soft")]
    if not hw:
        return R(SKIP, "no PCI RDMA devices")
    res = probes.ibv_dmabuf(ctx.sys)
    if res.get("error"):
        return R(UNKNOWN, f"probe unavailable: {res['error']}", probe=res)
    bad = [d for d, v in res.get("devices", {}).items() if v is False]
    if bad:
        return R(FAIL, "no dma-buf MR support on " + ", ".join(bad), "use a kernel >= 5.12 and a provider with "
                 "dma-buf support (mlx5, efa, bnxt_re)", probe=res)
    return R(PASS, "dma-buf MRs supported on " + ", ".join(res.get("devices", {})), probe=res)


