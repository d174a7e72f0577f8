"""Access kinds and the range tracker: which live accesses touch which bytes.

The tracker keeps the registration's bytes as a sorted set of disjoint segments; each
segment carries the tuple of live accesses covering all of it, oldest first. Adjacent
segments never carry equal tuples (they are merged), so there are at most 2n+1 segments
for n live accesses. Segment starts live in a blocked sorted list (bisect over block
heads, then within a block of at most 1024 keys), so finding, inserting and removing a
range costs O(log n + k) for k overlapped segments, with no O(n) list moves.

The tracker itself is not thread-safe; p2phub.ordering.Ordering holds a lock around it.
"""

from __future__ import annotations

import enum
import itertools
from bisect import bisect_left, bisect_right
from typing import Any, Iterator, Sequence

from .fence import Fence


__all__ = ["AccessKind", "Access", "AccessRange", "RangeTracker", "PRODUCERS", "CONSUMERS",
           "next_seq"]


class AccessKind(enum.Enum):
    """What an access does to the bytes: producers write them, consumers read them."""

    # producers
    NVME_READ = ("nvme read", True)              # SSD -> buffer
    RDMA_RECV = ("rdma recv", True)              # a SEND lands in a posted RECV
    RDMA_WRITE_TARGET = ("rdma write target", True)  # a peer WRITEs into the buffer
    RDMA_READ_DEST = ("rdma read dest", True)    # a local READ lands in the buffer
    GPU_WRITE = ("gpu write", True)
    SOCKET_RECV = ("socket recv", True)          # bytes from a socket land in the buffer
    # consumers
    NVME_WRITE = ("nvme write", False)           # buffer -> SSD
    RDMA_SEND = ("rdma send", False)             # SEND or WRITE from the buffer
    RDMA_READ_SOURCE = ("rdma read source", False)  # a peer READs the buffer
    GPU_READ = ("gpu read", False)
    SOCKET_SEND = ("socket send", False)         # the buffer's bytes go out on a socket

    def __init__(self, label: str, producer: bool) -> None:
        self.label = label
        self.producer = producer

    @property
    def consumer(self) -> bool:
        return not self.producer

    def conflicts_with(self, other: "AccessKind") -> bool:
        """Consumers overlap consumers; a producer overlaps nothing."""
        return self.producer or other.producer


PRODUCERS = tuple(k for k in AccessKind if k.producer)
CONSUMERS = tuple(k for k in AccessKind if not k.producer)

_seq = itertools.count(1)
next_seq = _seq.__next__     # accesses are ordered by when they were declared


class AccessRange:
    """What an access says of itself from its kind, range, sequence number, owner and words:
    shared by Access and p2phub.ordering.FencedAccess (a fence that is its own access)."""

    __slots__ = ()
    kind: AccessKind
    start: int
    end: int
    seq: int
    owner: str
    what: str

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def producer(self) -> bool:
        return self.kind.producer

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end

    def describe(self) -> str:
        s = f"{self.kind.label} [{self.start:#x}, +{self.length:#x})"
        if self.owner:
            s += f" of {self.owner}"
        if self.what:
            s += f" ({self.what})"
        return f"#{self.seq} {s}"


class Access(AccessRange):
    """One declared access to bytes [start, end) of a registration."""

    __slots__ = ("kind", "start", "end", "what", "owner", "seq", "deps", "fence", "__weakref__")

    def __init__(self, kind: AccessKind, start: int, end: int, what: str = "",
                 owner: str = "") -> None:
        self.kind = kind
        self.start = start
        self.end = end
        self.what = what
        self.owner = owner          # the registration, in words
        self.seq = next(_seq)
        self.deps: list[Access] = []
        self.fence: Any = None       # its ordering.core.AccessFence, set when entered

    def bind(self, source: object) -> Fence:
        """Tie this access to the completion of its work (a Fence or an NVMe future): when
        that completes, the range is released and ``self.fence`` completes the same way."""
        f = self.fence
        assert f is not None
        f._bind(source)
        return f

    def cancel(self, exc: BaseException | None = None) -> None:
        """Withdraw this access (its work never started, or can never complete)."""
        assert self.fence is not None
        self.fence._ordering.withdraw(self, exc)

    def __repr__(self) -> str:
        return self.describe()

    __str__ = __repr__


class _SortedKeys:
    """A sorted set of ints kept in blocks (bisect on the blocks' first keys)."""

    LOAD = 512

    def __init__(self) -> None:
        self._blocks: list[list[int]] = []
        self._firsts: list[int] = []
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def add(self, x: int) -> None:
        if not self._blocks:
            self._blocks.append([x])
            self._firsts.append(x)
            self._n = 1
            return
        b = max(bisect_right(self._firsts, x) - 1, 0)
        self._insert_at(b, bisect_right(self._blocks[b], x), x)

    def _insert_at(self, b: int, i: int, x: int) -> None:
        """Put x at position i of block b (where it sorts), splitting a block grown too long."""
        blk = self._blocks[b]
        blk.insert(i, x)
        if i == 0:
            self._firsts[b] = x
        self._n += 1
        if len(blk) > 2 * self.LOAD:
            half = blk[self.LOAD:]
            del blk[self.LOAD:]
            self._blocks.insert(b + 1, half)
            self._firsts.insert(b + 1, half[0])

    def remove(self, x: int) -> None:
        self.remove_many((x,))

    def remove_many(self, keys: Sequence[int]) -> None:
        """Remove each key (KeyError at the first one absent): the loop in one frame, for a
        batch of completions that drops thousands."""
        blocks, firsts = self._blocks, self._firsts
        for x in keys:
            b = bisect_right(firsts, x) - 1
            blk = blocks[b]
            i = bisect_left(blk, x)
            if i >= len(blk) or blk[i] != x:
                raise KeyError(x)
            del blk[i]
            self._n -= 1
            if not blk:
                del blocks[b]
                del firsts[b]
            elif i == 0:
                firsts[b] = blk[0]

    def floor(self, x: int) -> int | None:
        """The largest key <= x."""
        b = bisect_right(self._firsts, x) - 1
        if b < 0:
            return None
        blk = self._blocks[b]
        return blk[bisect_right(blk, x) - 1]

    def add_in_gap(self, x: int, limit: int, ends: dict[int, int]) -> bool:
        """Add x when [x, limit) is free: no key in it, and the key below x (if any) ends at
        or before x by `ends`. The new-segment case of RangeTracker.enter in one lookup of
        x's block, which the insertion reuses."""
        firsts = self._firsts
        b = bisect_right(firsts, x) - 1
        if b < 0:
            if not firsts:
                self.add(x)
                return True
            if firsts[0] < limit:
                return False
            b, i = 0, 0
        else:
            blk = self._blocks[b]
            i = bisect_right(blk, x)
            below = blk[i - 1]
            if below == x or ends[below] > x:
                return False
            above = blk[i] if i < len(blk) else (firsts[b + 1] if b + 1 < len(firsts) else None)
            if above is not None and above < limit:
                return False
        self._insert_at(b, i, x)
        return True

    def irange(self, lo: int, hi: int) -> list[int]:
        """Keys k with lo <= k < hi, ascending."""
        out: list[int] = []
        if not self._blocks:
            return out
        b = max(bisect_right(self._firsts, lo) - 1, 0)
        blk = self._blocks[b]
        i = bisect_left(blk, lo)
        nblocks = len(self._blocks)
        while True:
            j = bisect_left(blk, hi, i)
            out.extend(blk[i:j])
            if j < len(blk):
                return out
            b += 1
            if b >= nblocks:
                return out
            blk = self._blocks[b]
            i = 0

    def __iter__(self) -> Iterator[int]:
        for blk in self._blocks:
            yield from blk


def _members(x: "Access | tuple[Access, ...]") -> tuple[Access, ...]:
    """A segment's accesses as a tuple (a lone access is kept bare)."""
    return x if type(x) is tuple else (x,)  # type: ignore[return-value]


def _same(x: object, y: object) -> bool:
    """Two segments hold the same accesses (canonical: bare when alone, a tuple of 2+)."""
    return x is y or (type(x) is tuple and type(y) is tuple and x == y)


class RangeTracker:
    """Live accesses of one registration, on disjoint segments. A segment is two dict
    entries under its start, its end and its accesses: the access itself when it is alone
    there, else a tuple of them (no per-segment container, and no tuple for a lone access:
    each is an object less per live access for the cycle collector)."""

    def __init__(self) -> None:
        self._keys = _SortedKeys()
        self._end: dict[int, int] = {}                      # start -> end
        # start -> its access, or a tuple of 2+ accesses oldest first (_members)
        self._accs: dict[int, Any] = {}
        self._live = 0

    def __len__(self) -> int:
        """Live accesses."""
        return self._live

    @property
    def nsegments(self) -> int:
        return len(self._keys)

    def _first_key(self, start: int) -> int:
        """The key to start a walk of [start, ...) from."""
        k = self._keys.floor(start)
        if k is not None and self._end[k] > start:
            return k
        return start

    def overlapping(self, start: int, end: int) -> list[Access]:
        """Every live access overlapping [start, end), oldest first."""
        seen: dict[int, Access] = {}
        accs = self._accs
        for k in self._keys.irange(self._first_key(start), end):
            for a in _members(accs[k]):
                seen[a.seq] = a
        return [seen[s] for s in sorted(seen)]

    def conflicts(self, start: int, end: int, kind: AccessKind) -> list[Access]:
        """Live accesses an access of `kind` on [start, end) must come after, oldest first."""
        seen: dict[int, Access] = {}
        accs = self._accs
        producer = kind.producer
        for k in self._keys.irange(self._first_key(start), end):
            for a in _members(accs[k]):
                if producer or a.kind.producer:
                    seen[a.seq] = a
        if len(seen) < 2:
            return list(seen.values())
        return [seen[s] for s in sorted(seen)]

    def _split(self, at: int) -> None:
        """Make `at` a segment boundary when a segment spans it."""
        k = self._keys.floor(at)
        if k is None or k == at:
            return
        end = self._end[k]
        if end > at:
            self._end[at] = end
            self._accs[at] = self._accs[k]
            self._end[k] = at
            self._keys.add(at)

    def enter(self, a: Access, strict: bool = False) -> list[Access]:
        """The live accesses `a` must come after (oldest first), and `a` entered, in one
        walk; with `strict`, `a` is entered only when there are none."""
        s, e = a.start, a.end
        if s >= e:
            raise ValueError(f"empty range {a}")
        if self._keys.add_in_gap(s, e, self._end):
            # nothing live in [s, e): one new segment, no neighbour can equal it
            self._end[s] = e
            self._accs[s] = a
            self._live += 1
            return []
        keys = self._keys.irange(self._first_key(s), e)
        seen: dict[int, Access] = {}
        accs = self._accs
        producer = a.kind.producer
        for k in keys:
            for x in _members(accs[k]):
                if producer or x.kind.producer:
                    seen[x.seq] = x
        deps = [seen[q] for q in sorted(seen)]
        if not (strict and deps):
            self.insert(a)
        return deps

    def insert(self, a: Access) -> None:
        s, e = a.start, a.end
        if s >= e:
            raise ValueError(f"empty range {a}")
        self._split(s)
        self._split(e)
        ends, accs = self._end, self._accs
        pos = s
        for k in self._keys.irange(s, e):
            if k > pos:
                ends[pos], accs[pos] = k, a
                self._keys.add(pos)
            accs[k] = _members(accs[k]) + (a,)
            pos = ends[k]
        if pos < e:
            ends[pos], accs[pos] = e, a
            self._keys.add(pos)
        self._live += 1

    def _drop(self, k: int) -> None:
        del self._end[k]
        del self._accs[k]
        self._keys.remove(k)

    def remove(self, a: Access) -> None:
        s, e = a.start, a.end
        ends, accs = self._end, self._accs
        if accs.get(s) is a and ends[s] == e:
            # Alone on its own segment: drop it; a gap is left, so nothing to merge.
            del ends[s]
            del accs[s]
            self._keys.remove(s)
            self._live -= 1
            return
        found = False
        for k in self._keys.irange(s, e):
            here = _members(accs[k])
            if any(x is a for x in here):
                found = True
                rest = tuple(x for x in here if x is not a)
                if len(rest) > 1:
                    accs[k] = rest
                elif rest:
                    accs[k] = rest[0]
                else:
                    self._drop(k)
        if not found:
            raise KeyError(f"{a} is not live")
        self._live -= 1
        # Merge equal neighbours around and inside [s, e).
        left = self._keys.floor(s - 1) if s > 0 else None
        keys = self._keys.irange(left if left is not None else s, e + 1)
        prev: int | None = None
        for k in keys:
            if prev is not None and ends[prev] == k and _same(accs[prev], accs[k]):
                ends[prev] = ends[k]
                self._drop(k)
                continue
            prev = k

    def remove_all(self, accesses: list[Access]) -> None:
        """remove() for each, skipping those not live (withdrawn meanwhile); one frame for
        the usual case of an access alone on its own segment (a batch of completions)."""
        ends, accs = self._end, self._accs
        drop: list[int] = []     # their keys, out of the key set together
        for a in accesses:
            s = a.start
            if accs.get(s) is a and ends[s] == a.end:
                del ends[s]
                del accs[s]
                drop.append(s)
                continue
            if drop:            # remove() walks the keys: they agree with the segments first
                self._keys.remove_many(drop)
                self._live -= len(drop)
                drop = []
            try:
                self.remove(a)
            except KeyError:
                pass
        if drop:
            self._keys.remove_many(drop)
            self._live -= len(drop)

    def segments(self) -> list[tuple[int, int, tuple[Access, ...]]]:
        """(start, end, accesses) of every segment, ascending (for tests and debugging)."""
        return [(k, self._end[k], _members(self._accs[k])) for k in self._keys]

    def accesses(self) -> list[Access]:
        seen: dict[int, Access] = {}
        for _s, _e, accs in self.segments():
            for a in accs:
                seen[a.seq] = a
        return [seen[s] for s in sorted(seen)]
