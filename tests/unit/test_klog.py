"""The lab's kernel-log scanner: every report kind it must fail a run on, and the
boot chatter of the same subsystems it must let through.

The sample lines are written here after the kernel's printk formats (6.1/6.12:
drivers/iommu/intel/dmar.c, drivers/iommu/amd/iommu.c, mm/kasan/report.c,
kernel/locking/lockdep.c, kernel/rcu/, kernel/sched/core.c, lib/ubsan.c,
kernel/dma/debug.c, mm/kmemleak.c), as `dmesg` prints them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "labkit"))
from p2phub_lab import klog  # noqa: E402

BAD = [
    # IOMMU faults
    ("iommu", "[  41.220331] DMAR: [DMA Write NO_PASID] Request device [00:0a.0] fault addr 0xfffff000 "
              "[fault reason 0x05] PTE Write access is not set"),
    ("iommu", "[  41.220331] DMAR: [DMA Read NO_PASID] Request device [00:04.0] fault addr 0x7ff00000 "
              "[fault reason 0x06] PTE Read access is not set"),
    ("iommu", "[   9.000001] DMAR: [DMA Read] Request device [03:00.0] PASID ffffffff fault addr 0x1000 "
              "[fault reason 0x02] Present bit in context entry is clear"),
    ("iommu", "[  12.5] DMAR: [INTR-REMAP] Request device [00:1f.0] fault index 0x18 "
              "[fault reason 0x25] Blocked a compatibility format interrupt request"),
    ("iommu", "[  41.220300] DMAR: DRHD: handling fault status reg 2"),
    ("iommu", "[  77.1] iommu ivhd0: AMD-Vi: Event logged [IO_PAGE_FAULT device=0000:41:00.0 domain=0x000e "
              "address=0xfffff000 flags=0x0020]"),
    ("iommu", "[  77.1] AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x0000 address=0x1000 flags=0x0000]"),
    ("iommu", "[  77.1] nvme 0000:41:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x0012 "
              "address=0x7ffff000 flags=0x0050]"),
    ("iommu", "[   5.4] arm-smmu-v3 arm-smmu-v3.0.auto: Unhandled context fault: fsr=0x402, iova=0x80000000"),
    # KASAN / KFENCE / UBSAN / SLUB
    ("kasan", "[ 120.4] BUG: KASAN: slab-use-after-free in p2h_dma_pages+0x3a1/0x8c0 [p2phub]"),
    ("kasan", "[ 120.4] BUG: KASAN: stack-out-of-bounds in p2h_reg_lookup+0x51/0x90 [p2phub]"),
    ("kasan", "[ 120.4] BUG: KASAN: double-free in kfree+0xe2/0x3a0"),
    ("kfence", "[  33.0] BUG: KFENCE: out-of-bounds read in p2h_export_map+0x1c/0x80 [p2phub]"),
    ("ubsan", "[  20.2] UBSAN: array-index-out-of-bounds in /build/kmod/p2phub_main.c:412:17"),
    ("ubsan", "[  20.2] UBSAN: shift-out-of-bounds in drivers/nvme/host/core.c:1982:27"),
    ("slub", "[  64.0] BUG kmalloc-128 (Tainted: G    B      O      ): Poison overwritten"),
    ("slub", "[  64.0] BUG p2phub_reg (Not tainted): Redzone overwritten"),
    # lockdep, RCU, might_sleep
    ("lockdep", "[  88.1] WARNING: possible recursive locking detected"),
    ("lockdep", "[  88.1] WARNING: possible circular locking dependency detected"),
    ("lockdep", "[  88.1] WARNING: inconsistent lock state"),
    ("lockdep", "[  88.1] WARNING: possible irq lock inversion dependency detected"),
    ("lockdep", "[  88.1] WARNING: bad unlock balance detected!"),
    ("lockdep", "[  88.1] WARNING: held lock freed!"),
    ("lockdep", "[  88.1] WARNING: lock held when returning to user space!"),
    ("lockdep", "[  88.1] python3/412 is leaving the kernel with locks still held!"),
    ("lockdep", "[  88.1] WARNING: suspicious RCU usage"),
    ("lockdep", "[  88.1] BUG: sleeping function called from invalid context at kernel/locking/mutex.c:585"),
    ("lockdep", "[  88.1] BUG: scheduling while atomic: python3/412/0x00000002"),
    ("lockdep", "[  88.1] BUG: workqueue leaked lock or atomic: kworker/0:1/0x00000000/21"),
    ("lockdep", "[  88.1] DEBUG_LOCKS_WARN_ON(lock->magic != lock)"),
    # DMA-API debugging
    ("dma-api", "[  55.5] DMA-API: nvme 0000:00:04.0: device driver frees DMA memory with wrong function "
                "[device address=0x00000000fffff000] [size=4096 bytes] [mapped as page] [unmapped as single]"),
    ("dma-api", "[  55.5] DMA-API: p2phub-nvme 0000:00:04.0: device driver tries to free DMA memory it has "
                "not allocated [device address=0x0000000012340000] [size=4096 bytes]"),
    ("dma-api", "[  55.5] DMA-API: p2phub 0000:00:05.0: device driver failed to check map error"
                "[device address=0x0000000080000000] [size=65536 bytes] [mapped as scatter-gather]"),
    ("dma-api", "[  55.5] DMA-API: rdma_rxe NULL: cacheline tracking EEXIST, overlapping mappings aren't supported"),
    ("dma-api", "[  55.5] DMA-API: debugging out of memory - disabling"),
    ("dma-api", "[  55.5] DMA-API: cacheline tracking ENOMEM, dma-debug disabled"),
    # leaks
    ("kmemleak", "[ 600.0] kmemleak: 3 new suspected memory leaks (see /sys/kernel/debug/kmemleak)"),
    ("kmemleak", "unreferenced object 0xffff888104a3c000 (size 4096):"),
    ("leak", "[  90.0] p2phub: leak: p2phub.ko still in use after the command"),
    # the generic ones
    ("warn", "[  70.0] WARNING: CPU: 1 PID: 412 at kmod/p2phub_main.c:900 p2h_release+0x1f/0x40 [p2phub]"),
    ("bug", "[  70.0] BUG: unable to handle page fault for address: ffffc90000a3f000"),
    ("bug", "[  70.0] kernel BUG at mm/slub.c:435!"),
    ("oops", "[  70.0] Oops: 0000 [#1] PREEMPT SMP KASAN NOPTI"),
    ("oops", "[  70.0] general protection fault, probably for non-canonical address 0xdffffc0000000001: 0000"),
    ("oops", "[  70.0] Kernel panic - not syncing: Fatal exception"),
    ("corruption", "[  70.0] refcount_t: underflow; use-after-free."),
    ("corruption", "[  70.0] list_del corruption, ffff888100000000->next is LIST_POISON1 (dead000000000100)"),
    ("corruption", "[  70.0] BUG: Bad page state in process python3  pfn:10a3f"),
    ("hang", "[ 240.0] INFO: task python3:412 blocked for more than 120 seconds."),
    ("hang", "[ 240.0] rcu: INFO: rcu_preempt self-detected stall on CPU"),
    ("hang", "[ 240.0] watchdog: BUG: soft lockup - CPU#0 stuck for 26s! [python3:412]"),
    ("trace", "[  70.0] Call Trace:"),
]

CLEAN = [
    "[    0.000000] Linux version 6.12.117-p2phub-debug (root@lab) (gcc (Debian 12.2.0-14) 12.2.0) #1 SMP",
    "[    0.012000] kasan: KernelAddressSanitizer initialized (generic)",
    "[    0.020000] Lock dependency validator: Copyright (c) 2006 Red Hat, Inc., Ingo Molnar",
    "[    0.020000] ... MAX_LOCKDEP_SUBCLASSES:  8",
    "[    0.020000] ... MAX_LOCK_DEPTH:          48",
    "[    0.020000] ... MAX_LOCKDEP_KEYS:        8192",
    "[    0.020000] rcu: RCU lockdep checking is enabled.",
    "[    0.300000] DMA-API: preallocated 65536 debug entries",
    "[    0.300000] DMA-API: debugging enabled by kernel config",
    "[    0.300000] DMA-API: dma_debug_entry pool grown to 131072 (200%)",
    "[    0.400000] kmemleak: Kernel memory leak detector initialized (mem pool available: 15679)",
    "[    0.400000] kmemleak: Automatic memory scanning thread started",
    "[    0.500000] DMAR: IOMMU enabled",
    "[    0.500000] DMAR: Host address width 39",
    "[    0.500000] DMAR-IR: Enabled IRQ remapping in x2apic mode",
    "[    0.600000] pci 0000:00:04.0: Adding to iommu group 3",
    "[    0.700000] AMD-Vi: Interrupt remapping enabled",
    "[    2.000000] p2phub: loading out-of-tree module taints kernel.",
    "[    2.100000] p2phub: p2phub 0.4.0 loaded (abi 1, caps 0x19)",
    "[    2.200000] nvme nvme0: 2/0/1 default/read/poll queues",
    "[    2.300000] udmabuf: size_limit_mb=64",
    "[    3.000000] rdma_rxe: loaded",
]


@pytest.mark.parametrize(("kind", "line"), BAD, ids=[f"{k}-{i}" for i, (k, _) in enumerate(BAD)])
def test_report_line_is_caught_with_its_kind(kind: str, line: str) -> None:
    assert klog.classify(line) == kind
    assert klog.bad_lines([line]) == [line]


@pytest.mark.parametrize("line", CLEAN)
def test_boot_chatter_is_not_a_report(line: str) -> None:
    assert klog.classify(line) is None
    assert klog.bad_lines([line]) == []


def test_a_whole_lockdep_report_is_found_among_clean_lines() -> None:
    log = CLEAN[:5] + [
        "[   88.100000] ======================================================",
        "[   88.100001] WARNING: possible circular locking dependency detected",
        "[   88.100002] 6.12.117-p2phub-debug #1 Tainted: G           O",
        "[   88.100003] ------------------------------------------------------",
        "[   88.100004] python3/412 is trying to acquire lock:",
        "[   88.100005] ffff888104a3c0b8 (&reg->lock){+.+.}-{3:3}, at: p2h_dma_pages+0x51/0x8c0 [p2phub]",
    ] + CLEAN[5:]
    got = klog.reports(log)
    assert [r.kind for r in got] == ["lockdep"]
    assert klog.summary(log) == {"lockdep": 1}


def test_every_kind_has_a_sample() -> None:
    assert {k for k, _ in klog.PATTERNS} == {k for k, _ in BAD}


def test_iommu_faults_marked_as_expected_are_not_reports() -> None:
    """A test brackets the IOMMU faults it expects of one device; the same faults of another
    device, or outside the brackets, and every other kind of report still count."""
    lines = [
        "[1.0] DMAR: [DMA Write NO_PASID] Request device [00:0b.0] fault addr 0x1000",
        "[2.0] p2phub-lab: expected iommu faults of 00:0b.0 begin",
        "[2.1] DMAR: DRHD: handling fault status reg 2",
        "[2.2] DMAR: [DMA Write NO_PASID] Request device [00:0b.0] fault addr 0xfff00000",
        "[2.3] DMAR: [DMA Read NO_PASID] Request device [00:0a.0] fault addr 0x2000",
        "[2.4] WARNING: CPU: 0 PID: 1 at somewhere",
        "[3.0] p2phub-lab: expected iommu faults of 00:0b.0 end",
        "[3.1] DMAR: [DMA Write NO_PASID] Request device [00:0b.0] fault addr 0x3000",
    ]
    got = [r.line.split("] ", 1)[0] for r in klog.reports(lines)]
    assert got == ["[1.0", "[2.3", "[2.4", "[3.1"]
