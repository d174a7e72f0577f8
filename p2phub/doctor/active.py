"""`p2phub doctor --active`: confirm one GPU<->NVMe pair with a real DMA through p2phub.ko.

The test is opt-in twice over: `--active` asks for it and `--active-nvme BDF` names the one controller
it may take from the kernel nvme driver for a moment. A controller with a mounted, swapped-on or held
namespace is refused (the checks of p2phub.nvme.bind, the same ones `hub.nvme()` applies).

Read-only by default: bytes [LBA, LBA + N) of namespace 1 are read by the kernel nvme driver first,
then by the controller straight into GPU memory (a dma-buf of it registered with p2phub.ko for the
controller), then, once the controller is back with the kernel, by the kernel driver again. PASS when
the three SHA-256 sums agree. The GPU buffer is first filled with the complement of the expected bytes,
so a DMA that never lands cannot pass.

With `--active-write` (and an explicit `--active-lba`: the user declares that range scratch), random
bytes go GPU -> SSD, the GPU buffer is overwritten, the range is read SSD -> GPU and, after the give-back,
by the kernel driver; all must match the random bytes. The range's previous contents are restored
through the kernel driver afterwards.

GPU memory comes from the GPU's own exporter: the CUDA driver's dma-buf export for NVIDIA GPUs
(p2phub_cuda), or the test buffer of the backend plugin that claimed the GPU (backend.test_buffer).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any

from .. import backend
from ..backend import GpuBuffer
from ..errors import UsageError
from ..pci import normalize
from .model import FAIL, PASS, SKIP, CheckResult

KiB = 1 << 10
DEFAULT_BYTES = 64 * KiB
MAX_BYTES = 4 << 20
NSID = 1


class ActiveUsageError(ValueError):
    """A bad --active-* option (exit code 4)."""


@dataclass
class ActiveOptions:
    nvme: str | None = None
    gpu: str | None = None
    lba: int | None = None
    nbytes: int = DEFAULT_BYTES
    write: bool = False

    def validate(self) -> None:
        if self.nbytes <= 0 or self.nbytes > MAX_BYTES:
            raise ActiveUsageError(f"--active-bytes must be in 1..{MAX_BYTES}")
        if self.lba is not None and self.lba < 0:
            raise ActiveUsageError("--active-lba must be >= 0")
        if self.write and self.lba is None:
            raise ActiveUsageError("--active-write needs --active-lba: name a scratch LBA range; "
                                   "the doctor never picks a range to write on its own")
        if self.nvme is not None:
            try:
                normalize(self.nvme)
            except UsageError as exc:
                raise ActiveUsageError(f"--active-nvme: {exc}") from None


def _pci_or_none(text: str) -> str | None:
    """The kernel's spelling of `text` when it is a PCI address (--active-gpu also takes an id)."""
    try:
        return normalize(text)
    except UsageError:
        return None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- GPU memory


GpuMemory = GpuBuffer  # a GPU buffer exported as a dma-buf, with a CPU path to read and fill it


class CudaMemory(GpuMemory):
    """cuMemAlloc'd memory on the GPU at `bdf`, exported with cuMemGetHandleForAddressRange."""

    def __init__(self, bdf: str, length: int) -> None:
        from cuda.bindings import driver as cu  # lazy: only on NVIDIA machines
        from p2phub_cuda import backend

        self.cu = cu
        self.length = -(-length // (64 * KiB)) * (64 * KiB)
        (err,) = cu.cuInit(0)
        self._ok(err, "cuInit")
        err, dev = cu.cuDeviceGetByPCIBusId(bdf.encode())
        self._ok(err, f"cuDeviceGetByPCIBusId({bdf})")
        err, self.ctx = cu.cuDevicePrimaryCtxRetain(dev)
        self._ok(err, "cuDevicePrimaryCtxRetain")
        self.dev = dev
        (err,) = cu.cuCtxPushCurrent(self.ctx)
        self._ok(err, "cuCtxPushCurrent")
        err, self.ptr = cu.cuMemAlloc(self.length)
        self._ok(err, "cuMemAlloc")
        self.fd = backend().export_dmabuf(int(self.ptr), self.length, "doctor --active buffer")
        self.describe = f"CUDA device memory {int(self.ptr):#x} +{self.length:#x} on {bdf}"

    def _ok(self, err: Any, what: str) -> None:
        if int(err) != 0:
            raise OSError(f"{what}: {getattr(err, 'name', err)}")

    def write(self, data: bytes) -> None:
        (err,) = self.cu.cuMemcpyHtoD(self.ptr, data, len(data))
        self._ok(err, "cuMemcpyHtoD")

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        (err,) = self.cu.cuMemcpyDtoH(buf, self.ptr, n)
        self._ok(err, "cuMemcpyDtoH")
        return bytes(buf)

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if getattr(self, "ptr", None) is not None:
            self.cu.cuMemFree(self.ptr)
            self.ptr = None
            self.cu.cuCtxPopCurrent()
            self.cu.cuDevicePrimaryCtxRelease(self.dev)


def _plugin(gpu: Any) -> Any:
    """The backend plugin that claimed `gpu` and can give the test a buffer, or None."""
    be = backend.get_backend(gpu.info.get("backend") or "")
    return be if be is not None and hasattr(be, "test_buffer") else None


def gpu_memory(gpu: Any, length: int) -> GpuMemory:
    fl = gpu.info.get("flavour")
    be = _plugin(gpu)
    if be is not None:
        return be.test_buffer(gpu.bdf, length)
    if fl == "nvidia":
        return CudaMemory(gpu.bdf, length)
    raise NotImplementedError(f"no dma-buf exporter for {fl} GPUs in the doctor")


# --------------------------------------------------------------------------- kernel-driver side


def _lba_size(dev: str) -> int:
    with open(f"/sys/class/block/{os.path.basename(dev)}/queue/logical_block_size") as f:
        return int(f.read())


def _wait_dev(bdf: str, nsid: int, timeout_s: float = 30.0) -> str | None:
    from ..nvme import kernel_io
    deadline = time.monotonic() + timeout_s
    while True:
        dev = kernel_io.namespace_device(bdf, nsid)
        if dev and os.path.exists(dev) or time.monotonic() > deadline:
            return dev
        time.sleep(0.1)


# --------------------------------------------------------------------------- the test


def run_active(ctx: Any, opts: ActiveOptions) -> CheckResult:
    """The pair.active check result (also fills the tested pair's `active` dict)."""

    def R(status: str, summary: str, fix: str | None = None, **details: Any) -> CheckResult:
        return CheckResult("pair.active", "Active P2P DMA test", status, summary, fix, details=details)

    if not ctx.sys.exists("/dev/p2phub"):
        return R(SKIP, "needs p2phub.ko loaded (/dev/p2phub absent)", "load p2phub.ko")
    if not opts.nvme:
        return R(SKIP, "no controller named: --active-nvme BDF chooses the one NVMe controller the test may "
                 "take from the kernel nvme driver for a moment (read-only unless --active-write)")
    bdf = normalize(opts.nvme)
    nvme = next((d for d in ctx.top.nvmes if d.bdf == bdf), None)
    pd = ctx.top.pci.get(bdf)
    if nvme is None and pd is not None and pd.cls == 0x010802 and pd.driver != "nvme":
        return R(SKIP, f"{bdf} is bound to {pd.driver or 'no driver'}, not the kernel nvme driver: the test "
                 "compares with the kernel driver's read of the same LBAs", "p2phub nvme unbind " + bdf)
    if nvme is None:
        return R(FAIL, f"--active-nvme {bdf}: not a PCIe NVMe controller known to the kernel nvme driver",
                 "name a controller listed under nvme.controllers")
    if ctx.sys.euid != 0:
        return R(SKIP, "needs root (binds the controller, reads the block device with O_DIRECT)")
    if nvme.driver != "nvme":
        return R(SKIP, f"{bdf} is bound to {nvme.driver or 'no driver'}, not the kernel nvme driver: the test "
                 "compares with the kernel driver's read of the same LBAs")
    from ..nvme import bind, kernel_io
    reasons = bind.busy_reasons(bdf)
    if reasons:
        return R(SKIP, f"refused: {bdf} is in use: " + "; ".join(reasons),
                 "name a controller none of whose namespaces is mounted, swapped on or held", busy=reasons)
    cands = [p for p in ctx.pairs if p.kind == "gpu-nvme" and p.client == nvme.id]
    if opts.gpu:
        g = opts.gpu.lower()
        cands = [p for p in cands if p.provider.lower() == g or
                 next((x.bdf for x in ctx.top.gpus if x.id == p.provider), None) in (g, _pci_or_none(g))]
    gpus = {x.id: x for x in ctx.top.gpus}
    cands = [p for p in cands if gpus[p.provider].info.get("flavour") == "nvidia" or _plugin(gpus[p.provider])]
    if not cands:
        return R(SKIP, f"no GPU with a dma-buf exporter the doctor can drive pairs with {nvme.id}"
                 + (f" (--active-gpu {opts.gpu})" if opts.gpu else ""))
    pair = cands[0]
    gpu = gpus[pair.provider]
    dev = kernel_io.namespace_device(bdf, NSID)
    if dev is None:
        return R(SKIP, f"{bdf} has no namespace {NSID} block device")
    lbs = _lba_size(dev)
    lba = opts.lba or 0
    n = -(-opts.nbytes // lbs) * lbs
    with open(f"/sys/class/block/{os.path.basename(dev)}/size") as f:
        sectors = int(f.read())
    if (lba * lbs + n) > sectors * 512:
        return R(FAIL, f"LBA range {lba}+{n // lbs} is past the end of {dev}", "choose a range inside the namespace")

    ev: dict[str, Any] = {"gpu": gpu.id, "gpu_bdf": gpu.bdf, "nvme": nvme.id, "nvme_bdf": bdf, "namespace": dev,
                          "nsid": NSID, "lba": lba, "lba_size": lbs, "bytes": n,
                          "mode": "write+read" if opts.write else "read"}
    ev["pair_verdict"] = pair.verdict
    ev["pair_class"] = pair.cls
    status, summary, fix = _run(gpu, bdf, dev, lba, lbs, n, opts.write, ev)
    if status == PASS and pair.verdict != "OK":
        # p2phub.ko maps the GPU's dma-buf for the controller itself; the static verdict models the
        # kernel's P2PDMA routing, which this path does not go through. Say so rather than hide either.
        summary += f" (the static verdict for this pair is {pair.verdict}: " + "; ".join(pair.reasons) + \
            "; it models the kernel's P2PDMA routing, while this DMA used the GPU driver's dma-buf mapping " \
            "through p2phub.ko)"
    pair.active = {"status": status, "summary": summary, **ev}
    return R(status, f"{gpu.id}<->{nvme.id}: {summary}", fix, **ev)


def _run(gpu: Any, bdf: str, dev: str, lba: int, lbs: int, n: int, write: bool,
         ev: dict[str, Any]) -> tuple[str, str, str | None]:
    from ..hub import Hub
    from ..nvme import bind, kernel_io
    from ..nvme.errors import ControllerBusyError

    off = lba * lbs
    before = kernel_io.read(dev, off, n)
    ev["sha256_kernel_before"] = sha256(before)
    expected = os.urandom(n) if write else before
    poison = bytes(b ^ 0xFF for b in expected)
    got = b""
    given_back = False
    mem: GpuMemory | None = None
    try:
        mem = gpu_memory(gpu, n)
        ev["gpu_buffer"] = mem.describe
        with Hub() as hub:
            ctrl = hub.nvme(bdf)  # binds it to p2phub.ko; refuses a controller that became busy
            try:
                reg = hub.register_dmabuf(mem.fd, 0, n, device=bdf)
                try:
                    pages = reg.dma_pages(bdf)
                    ev["dma_addresses"] = [f"{a:#x}" for a in pages[:8]]
                    ev["dma_pages"] = len(pages)
                    if mem.bus_address is not None and pages:
                        # an IOVA (not the BAR's bus address): the controller's DMA goes through the IOMMU
                        ev["dma_translated"] = pages[0] != mem.bus_address
                    ns = ctrl.namespace(NSID)
                    if ns.lba_size != lbs:
                        return FAIL, f"namespace LBA size {ns.lba_size} != kernel's {lbs}", None
                    if write:
                        mem.write(expected)
                        ns.write(reg, lba=lba, nbytes=n)
                    mem.write(poison)
                    ns.read(reg, lba=lba, nbytes=n)
                    got = mem.read(n)
                finally:
                    reg.close()
            finally:
                ctrl.close()
                bind.unbind(bdf)
                given_back = True
    except ControllerBusyError as exc:  # claimed between the check above and the bind
        return SKIP, f"refused: {exc}", None
    except ImportError as exc:  # raised before anything was bound
        return SKIP, f"no exporter for {gpu.id}'s memory: {exc} (NVIDIA: the CUDA backend p2phub_cuda " \
            "needs cuda-python)", "install cuda-python (cuda.bindings) in p2phub's environment"
    except Exception as exc:  # noqa: BLE001 - reported as the check's result
        if not given_back and bind.current_driver(bdf) != "nvme":
            try:
                bind.unbind(bdf)
            except Exception:  # noqa: BLE001
                pass
        return FAIL, f"the DMA test failed: {type(exc).__name__}: {exc}", \
            "see the kernel log (dmesg) and the pair's verdict"
    finally:
        if mem is not None:
            mem.close()
    dev2 = _wait_dev(bdf, NSID) or dev
    after = kernel_io.read(dev2, off, n)
    if write:
        kernel_io.write(dev2, off, before)  # restore the scratch range
        ev["restored"] = sha256(kernel_io.read(dev2, off, n)) == sha256(before)
    ev["sha256_expected"] = sha256(expected)
    ev["sha256_gpu"] = sha256(got)
    ev["sha256_kernel_after"] = sha256(after)
    if got == expected and after == expected:
        return PASS, f"{n} bytes moved by DMA {'GPU->SSD->GPU' if write else 'SSD->GPU'}, SHA-256 " \
            f"{ev['sha256_expected'][:16]}... matches the kernel driver's read", None
    if got == poison:
        what = "no data arrived in GPU memory (the buffer still holds the fill pattern)"
    elif got != expected:
        bad = next(i for i in range(n) if got[i] != expected[i])
        what = f"GPU memory differs from the kernel driver's read from byte {bad}"
    else:
        what = "the kernel driver reads different bytes after the test"
    return FAIL, f"checksum mismatch: {what}", \
        "the route silently drops or corrupts data: do not use this pair (check IOMMU/ACS and the pair's verdict)"
