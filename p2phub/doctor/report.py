"""Rendering: a rich report for people and a versioned JSON document for programs."""

from __future__ import annotations

import json
import sys
from typing import IO, Any

from .core import Report
from .model import BLOCKED, DEGRADED, FAIL, INFO, OK, PASS, SKIP, UNKNOWN, WARN

STYLE = {PASS: "green", INFO: "cyan", WARN: "yellow", FAIL: "bold red", SKIP: "dim", UNKNOWN: "magenta"}
GLYPH = {OK: "✓", DEGRADED: "~", BLOCKED: "✗", UNKNOWN: "?"}
VSTYLE = {OK: "green", DEGRADED: "yellow", BLOCKED: "bold red", UNKNOWN: "magenta"}


def render_json(rep: Report, version: str, out: IO[str] | None = None) -> None:
    out = out or sys.stdout
    json.dump(rep.as_dict(version), out, indent=2, sort_keys=False, default=str)
    out.write("\n")


def _fmt_bytes(n: int | None) -> str:
    if not n:
        return "-"
    for unit, sh in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << sh:
            return f"{n / (1 << sh):.0f} {unit}"
    return f"{n} B"


def render_rich(rep: Report, verbose: bool = False, color: bool | None = None, out: IO[str] | None = None) -> None:
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table
    from rich.markup import escape
    from rich.text import Text

    console = Console(file=out or sys.stdout, no_color=(color is False), force_terminal=color or None,
                      highlight=False, soft_wrap=False, width=None if (out is None and color is None) else 120)
    t = rep.top
    cpu = t.cpu
    virt = rep.check("host.virt").details.get("virt")
    fam = cpu.get("family")
    head = Text()
    head.append(f"kernel {cpu.get('kernel')}  {cpu.get('arch')}  {cpu.get('vendor')} "
                f"family {('0x%x' % fam) if isinstance(fam, int) else '?'}  virt: {virt}\n")
    head.append(f"source: {rep.sys.source()}   privileged: {'yes' if t.privileged else 'no (config space limited)'}\n")
    kc = rep.ctx.kconfig
    head.append("kernel: " + "  ".join(f"{k}={kc.get(k, 'absent')}" for k in ("PCI_P2PDMA", "ZONE_DEVICE",
                                                                            "DMABUF_MOVE_NOTIFY"))
                + (f"  (from {rep.ctx.kconfig_source})" if rep.ctx.kconfig_source else "  (no kernel config)"))
    st = rep.status
    console.print(Panel(head, title=f"p2phub doctor — [{STYLE.get(st, '')}]{st}[/]", expand=False))

    # devices
    dt = Table(title="Devices", show_lines=False)
    for col in ("id", "name", "BDF", "driver", "NUMA", "link (cur/max)", "IOMMU", "ACS / ATS", "BAR / info"):
        dt.add_column(col)
    for d in t.devices:
        pd = t.pci.get(d.bdf or "")
        link = iommu = acs = "-"
        numa = "-"
        if pd is not None:
            L = pd.link
            if L:
                link = (f"{L.get('current_link_speed', '?')} x{L.get('current_link_width', '?')} / "
                        f"{L.get('max_link_speed', '?')} x{L.get('max_link_width', '?')}")
            iommu = f"{pd.iommu_group}:{pd.iommu_type}" if pd.iommu_group else "none"
            numa = str(pd.numa_node)
            if pd.cfg and pd.cfg.reason:
                acs = "? (needs root)"
            elif pd.cfg:
                acs = ("ACS " + (f"0x{pd.cfg.acs_ctrl:04x}" if pd.cfg.acs_ctrl is not None else "-") + " / ATS " +
                       ("on" if pd.cfg.ats_enabled else "cap" if pd.cfg.ats_cap else "-"))
        extra = "-"
        if d.kind == "gpu":
            extra = f"BAR{d.info.get('p2p_bar')} {_fmt_bytes(d.info.get('bar_bytes'))}"
        elif d.kind == "nvme":
            nss = d.info.get("namespaces", [])
            extra = f"{d.info.get('transport')}; ns: {', '.join(n['name'] for n in nss) or '-'}"
        elif d.kind == "nic":
            extra = f"netdev {', '.join(d.info.get('netdevs') or []) or '-'}" + (" (soft)" if d.info.get("soft") else "")
        dt.add_row(d.id, d.name, d.bdf or "-", d.driver or "-", numa, link, iommu, acs, extra)
    if t.devices:
        console.print(dt)
    else:
        console.print("[dim]no GPUs, NVMe controllers or RDMA devices found[/]")

    # pair matrix
    if rep.pairs:
        peers = list(dict.fromkeys(p.client for p in rep.pairs))
        mt = Table(title="Pair matrix (class, verdict)")
        mt.add_column("")
        for p in peers:
            mt.add_column(p)
        for g in t.gpus:
            cells = []
            for peer in peers:
                pv = next((p for p in rep.pairs if p.provider == g.id and p.client == peer), None)
                if pv is None:
                    cells.append("")
                else:
                    cells.append(f"[{VSTYLE[pv.verdict]}]{pv.cls} {GLYPH[pv.verdict]} {pv.verdict}[/]")
            mt.add_row(g.id, *cells)
        console.print(mt)
        console.print("[dim]X self, PIX one switch, PXB several switches, PHB through the host bridge, NODE across "
                      "host bridges, SYS across NUMA nodes.  ✓ OK  ~ DEGRADED  ✗ BLOCKED  ? UNKNOWN[/]")
        legend = "  ".join(f"{d.id}: {d.name} ({d.bdf})" for d in t.devices if d.id in peers)
        console.print(f"[dim]{legend}[/]")
        for pv in rep.pairs:
            if pv.p2p:
                console.print(f"  {pv.provider}<->{pv.client} path: {pv.p2p['path']} "
                              f"({escape(pv.p2p['why'])})")
            if pv.verdict != OK or verbose:
                why = "; ".join(pv.reasons) or "-"
                console.print(f"  [{VSTYLE[pv.verdict]}]{pv.provider}<->{pv.client}[/] {pv.cls} dist {pv.distance} "
                              f"{pv.map_type} iommu {pv.iommu} "
                              f"{('%.1f GB/s' % pv.gbps) if pv.gbps else ''}: {escape(why)}")

    # checks
    ct = Table(title="Checks" + ("" if verbose else " (PASS and SKIP hidden; -v shows all)"))
    ct.add_column("status")
    ct.add_column("id")
    ct.add_column("finding", overflow="fold")
    for c in rep.checks:
        if not verbose and c.status in (PASS, SKIP) and not (c.id == "pair.active" and rep.ctx.active):
            continue  # (the outcome of an --active test is always shown when one was asked for)
        ct.add_row(f"[{STYLE[c.status]}]{c.status}[/]", c.id, escape(c.summary))
        if verbose and c.evidence:
            ev = "; ".join(f"{e['path']}={e.get('value', e.get('error'))}" for e in c.evidence[:6])
            ct.add_row("", "", f"[dim]{escape(ev)}[/]")
    console.print(ct)

    # fixes: numbered, deduplicated, worst first
    order = {FAIL: 0, WARN: 1, UNKNOWN: 2, INFO: 3}
    fixes: list[tuple[str, str]] = []
    for c in sorted(rep.checks, key=lambda c: order.get(c.status, 9)):
        if c.fix and c.status in (FAIL, WARN, UNKNOWN) and c.fix not in [f for _, f in fixes]:
            fixes.append((c.id, c.fix))
    if fixes:
        console.print("[bold]Fixes[/]")
        for i, (cid, fx) in enumerate(fixes, 1):
            console.print(f"  {i}. {escape('[' + cid + ']')} {escape(fx)}")
    why = rep.why_not()
    if why:
        console.print("[bold red]P2P cannot work here because:[/]")
        for w in why:
            console.print(f"  - {escape(w)}")
    counts = rep.counts()
    console.print(f"GPU<->NVMe: {rep.class_summary('gpu-nvme')}; GPU<->NIC: {rep.class_summary('gpu-nic')} — "
                  + ", ".join(f"{n} {k.upper()}" for k, n in counts.items() if n))


def explain(cid: str) -> str | None:
    from .checks import EXPLAIN
    return EXPLAIN.get(cid)
