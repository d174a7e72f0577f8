"""User memory whose first fault we hold: a kernel copy_to_user() into it blocks until we let go.

    with HeldPages(4) as mem:            # 4 pages, none present yet
        start a thread whose ioctl copies into mem.addr
        mem.wait_fault(5)                # the kernel is now blocked inside that copy
        ... do something while it is blocked ...
        mem.release()                    # fill the pages; the copy goes on

Built on userfaultfd (missing-page mode, kernel faults included, so root); x86-64 numbers.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import select
import struct
import threading

SYS_USERFAULTFD = 323
UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F          # _IOWR(0xAA, 0x3F, struct uffdio_api)
UFFDIO_REGISTER = 0xC020AA00     # _IOWR(0xAA, 0x00, struct uffdio_register)
UFFDIO_ZEROPAGE = 0xC020AA04     # _IOWR(0xAA, 0x04, struct uffdio_zeropage)
UFFDIO_REGISTER_MODE_MISSING = 1
UFFD_EVENT_PAGEFAULT = 0x12
MSG = struct.Struct("<BBHI QQ Q")  # event, reserved..., flags, address, (union tail)


def available() -> str | None:
    """None when userfaultfd works here, else why not."""
    try:
        fd = _open()
    except OSError as exc:
        return f"userfaultfd: {os.strerror(exc.errno or 0)} (CONFIG_USERFAULTFD?)"
    os.close(fd)
    return None


def _open() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return fd


class HeldPages:
    def __init__(self, pages: int, present: int = 0) -> None:
        """`pages` pages; the first `present` of them are made present now (never held)."""
        self.size = pages * mmap.PAGESIZE
        self.map = mmap.mmap(-1, self.size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for i in range(present):
            self.map[i * mmap.PAGESIZE] = 0
        c = ctypes.c_char.from_buffer(self.map)
        self.addr = ctypes.addressof(c)
        del c
        self.fd = _open()
        api = bytearray(struct.pack("<QQQ", UFFD_API, 0, 0))
        fcntl.ioctl(self.fd, UFFDIO_API, api, True)
        reg = bytearray(struct.pack("<QQQQ", self.addr, self.size, UFFDIO_REGISTER_MODE_MISSING, 0))
        fcntl.ioctl(self.fd, UFFDIO_REGISTER, reg, True)
        self._faulted = threading.Event()
        self._release = threading.Event()
        self._held: list[int] = []
        self._held_lock = threading.Lock()
        self._stop = False
        self.faults = 0
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def _zero(self, addr: int) -> None:
        page = addr & ~(mmap.PAGESIZE - 1)
        arg = bytearray(struct.pack("<QQQq", page, mmap.PAGESIZE, 0, 0))
        try:
            fcntl.ioctl(self.fd, UFFDIO_ZEROPAGE, arg, True)
        except FileExistsError:
            pass    # another fault on the same page was served first

    def _serve(self) -> None:
        while not self._stop:
            r, _, _ = select.select([self.fd], [], [], 0.05)
            if self._release.is_set():
                self._zero_held()
            if not r:
                continue
            try:
                raw = os.read(self.fd, MSG.size)
            except BlockingIOError:
                continue
            event, _, _, _, _flags, address, _ = MSG.unpack(raw)
            if event != UFFD_EVENT_PAGEFAULT:
                continue
            self.faults += 1
            with self._held_lock:
                if not self._release.is_set():
                    self._held.append(address)
                    self._faulted.set()
                    continue
            self._zero(address)

    def wait_fault(self, timeout: float) -> bool:
        """True once something faulted on these pages and is waiting."""
        return self._faulted.wait(timeout)

    def release(self) -> None:
        """Serve the held fault and every later one (zero-filled pages)."""
        self._release.set()

    def release_now(self) -> None:
        """release(), with the held faults served from the calling thread before it returns
        (the serving thread may take up to its poll interval to notice a release())."""
        self._release.set()
        self._zero_held()

    def _zero_held(self) -> None:
        with self._held_lock:
            held, self._held = self._held, []
        for a in held:
            self._zero(a)

    def close(self) -> None:
        self.release()
        self._stop = True
        self._t.join(5)
        os.close(self.fd)
        self.map.close()

    def __enter__(self) -> "HeldPages":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
