"""NVMe requests as ordered accesses: the NVMe engine declares each data request here.

A read fills the registration's range (producer), a write reads it (consumer). Every
access of a batch is entered before anything is submitted, so strict mode refuses the
batch with nothing sent, and two conflicting requests inside one batch are refused
(nothing could order them: the doorbell sends them together). Then the batch waits for
the earlier conflicting accesses outside it, is submitted, and each access is bound to
its request's future (the future becomes the access's fence).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from ..memory import Memory
from .core import Ordering
from .errors import OrderingError
from .tracker import Access, AccessKind

KINDS = {"read": AccessKind.NVME_READ, "write": AccessKind.NVME_WRITE}

Declared = list[tuple[int, Ordering, Access]]  # (index of the op, ordering, access)


def _ordering_of(buf: Any) -> Ordering | None:
    # Registrations (p2phub.memory.Memory) carry an ordering; p2phub's own DMA buffers and
    # page lists do not need one.
    if not isinstance(buf, Memory) or buf.closed:
        return None
    return buf.ordering


def declare(ops: Sequence[Any], what: Iterable[str] | None = None,
            timeout: float | None = None, *, name: Callable[[int], str] | None = None) -> Declared:
    """Enter the accesses of a batch (ops with kind, buf, offset, nbytes), then wait for
    the earlier conflicting ones. Raises OrderingError / OrderingTimeout / FenceError
    with every access of the batch withdrawn. Each access is named what[i], or name(i)
    (called only for the ops that are ordered)."""
    if name is None:
        names = list(what) if what is not None else [""] * len(ops)
        name = names.__getitem__
    out: Declared = []
    orderings: dict[int, Ordering | None] = {}  # per buffer, looked up once per batch
    try:
        mine: set[int] = set()
        for i, op in enumerate(ops):
            kind = KINDS.get(op.kind)
            if kind is None:
                continue
            key = id(op.buf)
            if key in orderings:
                o = orderings[key]
            else:
                o = orderings[key] = _ordering_of(op.buf)
            if o is None:
                continue
            a = o.enter(op.offset, op.nbytes, kind, name(i))
            out.append((i, o, a))
            for d in a.deps:
                if d.seq in mine:
                    raise OrderingError(f"{a} conflicts with {d} in the same batch: nothing orders "
                                        "requests that go out together; submit them one after "
                                        "the other", a, d)
            mine.add(a.seq)
        for _i, o, a in out:
            o.wait_deps(a, o.timeout if timeout is None else timeout)
    except BaseException as exc:
        for _i, o, a in out:
            o.withdraw(a, exc)
        raise
    return out


def declare_span(buf: Any, kind: str, offset: int, nbytes: int, what: str) -> Declared:
    """``declare`` for a batch that is one access: same-sized requests over one span of
    `buf` (Namespace.read_batch/write_batch), entered and waited for with no per-request
    lists. Same errors and withdrawal as ``declare``."""
    k = KINDS.get(kind)
    o = _ordering_of(buf) if k is not None else None
    if o is None:
        return []
    return [(0, o, o.acquire(offset, nbytes, k, what))]


def bind(declared: Declared, futures: Sequence[Any]) -> None:
    """Each access follows its request's future (submitted)."""
    for i, _o, a in declared:
        a.bind(futures[i])


def abandon(declared: Declared, futures: Sequence[Any], exc: BaseException) -> None:
    """Submission failed part way: requests that reached the queue keep their access (bound
    to their future); the others are withdrawn."""
    for i, o, a in declared:
        fut = futures[i]
        if getattr(fut, "cids", None) or fut.done():
            a.bind(fut)
        else:
            o.withdraw(a, exc)
