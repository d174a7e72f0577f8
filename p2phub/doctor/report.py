"""Rendering: a rich report for people and a versioned JSON document for programs."""

from __future__ import annotations

import json
import re
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


_FULL_BDF = re.compile(r"\b0000:([0-9a-f]{2}:[0-9a-f]{2}\.[0-7])\b")
_ANY_BDF = re.compile(r"\b([0-9a-f]{4,8}):[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]\b")

# Fixes that pull against each other when both are shown, and the line that reconciles them:
# clearing ACS redirect merges the pair's IOMMU groups, which another fix wants kept apart.
CONFLICTS: list[tuple[frozenset[str], frozenset[str], str]] = [
    (frozenset({"pcie.acs", "pcie.host_bridge"}), frozenset({"nvme.confined"}),
     "fixes {a} and {b} pull apart: clearing ACS redirect puts the GPU and the SSD into one IOMMU "
     "group, while {b} wants the SSD in a group of its own. Do one: keep ACS and enable ATS on both "
     "devices (translated requests then go peer-to-peer under ACS Direct Translated P2P), or clear "
     "redirect only on the switch ports between the pair and give that shared group to one owner."),
]


def shortener(rep: Report):  # -> Callable[[str], str]
    """Text with PCI addresses shortened to BB:DD.F when every device here is in domain 0000
    (nothing is ambiguous then); text unchanged otherwise."""
    blob = " ".join(str(k) for k in rep.top.pci) + " " + " ".join(d.bdf or "" for d in rep.top.devices)
    if any(m.group(1).strip("0") for m in _ANY_BDF.finditer(blob)):
        return lambda text: text
    return lambda text: _FULL_BDF.sub(r"\1", text)


def _fmt_link(L: dict) -> str:
    """'8GT/s x4' when the link runs at its best, 'cur 2.5GT/s x1 (max 16GT/s x32)' otherwise."""
    def one(speed: Any, width: Any) -> str:
        return f"{str(speed).replace(' GT/s PCIe', 'GT/s').replace(' GT/s', 'GT/s')} x{width}"
    cur = one(L.get("current_link_speed", "?"), L.get("current_link_width", "?"))
    top = one(L.get("max_link_speed", "?"), L.get("max_link_width", "?"))
    return cur if cur == top else f"{cur} (max {top})"


def render_rich(rep: Report, verbose: bool = False, color: bool | None = None, out: IO[str] | None = None,
                width: int | None = None) -> None:
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table
    from rich.markup import escape
    from rich.text import Text

    console = Console(file=out or sys.stdout, no_color=(color is False), force_terminal=color or None,
                      highlight=False, soft_wrap=False,
                      width=width or (None if (out is None and color is None) else 120))
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
    short = shortener(rep)
    rows = []
    for d in t.devices:
        pd = t.pci.get(d.bdf or "")
        link = iommu = acs = "-"
        numa = "-"
        if pd is not None:
            L = pd.link
            if L:
                link = _fmt_link(L)
            iommu = f"{pd.iommu_group}:{pd.iommu_type}" if pd.iommu_group else "none"
            numa = "-" if pd.numa_node in (None, -1, "-1") else str(pd.numa_node)
            if pd.cfg and pd.cfg.reason:
                acs = "? (root)"
            elif pd.cfg:
                a = f"0x{pd.cfg.acs_ctrl:04x}" if pd.cfg.acs_ctrl is not None else "-"
                b = "on" if pd.cfg.ats_enabled else "cap" if pd.cfg.ats_cap else "-"
                acs = "-" if a == b == "-" else f"{a}/{b}"
        extra = "-"
        if d.kind == "gpu":
            extra = f"BAR{d.info.get('p2p_bar')} {_fmt_bytes(d.info.get('bar_bytes'))}"
        elif d.kind == "nvme":
            nss = d.info.get("namespaces", [])
            extra = f"{d.info.get('transport')}; ns: {', '.join(n['name'] for n in nss) or '-'}"
        elif d.kind == "nic":
            extra = f"netdev {', '.join(d.info.get('netdevs') or []) or '-'}" + (" (soft)" if d.info.get("soft") else "")
        rows.append((d.id, d.name, short(d.bdf or "-"), d.driver or "-", numa, link, iommu, acs, extra))
    cols = ["id", "name", "BDF", "driver", "NUMA", "link", "IOMMU", "ACS/ATS", "BAR / info"]
    keep = [i for i, c in enumerate(cols)   # a column that says nothing for any device is left out
            if c in ("id", "name", "BDF") or any(r[i] not in ("-", "none", "") for r in rows)]
    dt = Table(title="Devices", show_lines=False, pad_edge=False)
    for i in keep:
        dt.add_column(cols[i], no_wrap=cols[i] in ("id", "BDF", "NUMA"),
                      overflow="fold", ratio=2 if cols[i] in ("name", "BAR / info") else None)
    for r in rows:
        dt.add_row(*(escape(r[i]) for i in keep))
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
        legend = "  ".join(f"{d.id}: {d.name} ({short(d.bdf or '-')})" for d in t.devices if d.id in peers)
        console.print(f"[dim]{legend}[/]")
        for pv in rep.pairs:
            if pv.p2p:
                console.print(f"  {pv.provider}<->{pv.client} path: {pv.p2p['path']} "
                              f"({escape(pv.p2p['why'])})")
            if pv.verdict != OK or verbose:
                why = "; ".join(pv.reasons) or "-"
                console.print(f"  [{VSTYLE[pv.verdict]}]{pv.provider}<->{pv.client}[/] {pv.cls} dist {pv.distance} "
                              f"{pv.map_type} iommu {pv.iommu} "
                              f"{('%.1f GB/s' % pv.gbps) if pv.gbps else ''}: {escape(short(why))}")

    # checks
    ct = Table(title="Checks" + ("" if verbose else " (PASS and SKIP hidden; -v shows all)"))
    ct.add_column("status", no_wrap=True)
    ct.add_column("id", no_wrap=True)
    ct.add_column("finding", overflow="fold")
    shown: set[str] = set()   # -v: each piece of evidence once, where it is first used
    for c in rep.checks:
        if not verbose and c.status in (PASS, SKIP) and not (c.id == "pair.active" and rep.ctx.active):
            continue  # (the outcome of an --active test is always shown when one was asked for)
        ct.add_row(f"[{STYLE[c.status]}]{c.status}[/]", c.id, escape(short(c.summary)))
        if verbose and c.evidence:
            ev = [e for e in c.evidence if e["path"] not in shown][:6]
            shown.update(e["path"] for e in ev)
            text = "; ".join(f"{e['path']}={_one_line(e.get('value', e.get('error')))}" for e in ev)
            if text:
                ct.add_row("", "", f"[dim]{escape(short(text))}[/]")
    console.print(ct)

    # fixes: numbered, deduplicated, worst first
    order = {FAIL: 0, WARN: 1, UNKNOWN: 2, INFO: 3}
    fixes: list[tuple[str, str]] = []
    for c in sorted(rep.checks, key=lambda c: order.get(c.status, 9)):
        if c.fix and c.status in (FAIL, WARN, UNKNOWN) and c.fix not in [f for _, f in fixes]:
            fixes.append((c.id, c.fix))
    def hanging(items: list[tuple[str, str]]) -> None:
        """Items whose wrapped lines stay indented under their text."""
        g = Table.grid(padding=(0, 1))
        g.add_column(no_wrap=True, justify="right")
        g.add_column(overflow="fold")
        for mark, text in items:
            g.add_row(mark, text)
        console.print(g)

    if fixes:
        console.print("[bold]Fixes[/]")
        hanging([(f"  {i}.", f"{escape('[' + cid + ']')} {escape(short(fx))}")
                 for i, (cid, fx) in enumerate(fixes, 1)]
                + [("  [yellow]note[/]", escape(note)) for note in reconcile([cid for cid, _ in fixes])])
    why = rep.why_not()
    if why:
        console.print("[bold red]P2P cannot work here because:[/]")
        hanging([("  -", escape(short(w))) for w in why])
    counts = rep.counts()
    console.print(f"GPU<->NVMe: {rep.class_summary('gpu-nvme')}; GPU<->NIC: {rep.class_summary('gpu-nic')} — "
                  + ", ".join(f"{n} {k.upper()}" for k, n in counts.items() if n))


def reconcile(fix_ids: list[str]) -> list[str]:
    """The notes for fixes (numbered as listed) that would undo each other if both were done."""
    notes = []
    for left, right, text in CONFLICTS:
        a = [i for i, cid in enumerate(fix_ids, 1) if cid in left]
        b = [i for i, cid in enumerate(fix_ids, 1) if cid in right]
        if a and b:
            notes.append(text.format(a=a[0], b=b[0]))
    return notes


def _one_line(value: Any, limit: int = 160) -> str:
    """Evidence as one line: a multi-line file shows its first line and how many more."""
    text = str(value)
    lines = text.strip().splitlines()
    if len(lines) > 1:
        text = f"{lines[0].strip()} (+{len(lines) - 1} lines)"
    return text if len(text) <= limit else text[:limit - 1] + "…"


def explain(cid: str) -> str | None:
    from .checks import EXPLAIN
    return EXPLAIN.get(cid)
