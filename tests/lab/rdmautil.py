"""A connected RC queue pair between the lab's two RDMA nodes, for tests that move bytes."""

from __future__ import annotations

import time

import pyverbs.enums as e
from pyverbs.addr import AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR

from p2phub.rdma import MemoryRegion, ProtectionDomain

GID_INDEX = 1  # the IPv4-mapped RoCE v2 GID of the node's address
PORT = 1


class CompletionError(RuntimeError):
    """A work completion with an error status (``status``: an IBV_WC_* code)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"RDMA completion status {status}")
        self.status = status


class Endpoint:
    def __init__(self, pd: ProtectionDomain) -> None:
        self.pd = pd
        self.cq = CQ(pd.ctx, 64)
        cap = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(pd.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.gid = pd.ctx.query_gid(PORT, GID_INDEX)

    def connect(self, peer: "Endpoint") -> None:
        attr = QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RESET)
        attr.qp_access_flags = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
                                | e.IBV_ACCESS_REMOTE_READ)
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = peer.qp.qp_num
        attr.rq_psn = 0
        attr.sq_psn = 0
        attr.max_rd_atomic = 1
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = GlobalRoute(dgid=peer.gid, sgid_index=GID_INDEX)
        attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=PORT)
        self.qp.to_rts(attr)

    def _post(self, opcode: int, local: MemoryRegion, loff: int, remote: MemoryRegion,
              roff: int, length: int, timeout: float) -> None:
        wr = SendWR(opcode=opcode, num_sge=1, sg=[SGE(local.addr + loff, length, local.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(remote.rkey, remote.addr + roff)
        self.qp.post_send(wr)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n, wcs = self.cq.poll()
            if n:
                wc = wcs[0]
                if wc.status != e.IBV_WC_SUCCESS:
                    raise CompletionError(wc.status)
                return
            time.sleep(0.001)
        raise TimeoutError(f"no RDMA completion within {timeout} s")

    def write(self, local: MemoryRegion, remote: MemoryRegion, length: int, loff: int = 0,
              roff: int = 0, timeout: float = 30.0) -> None:
        self._post(e.IBV_WR_RDMA_WRITE, local, loff, remote, roff, length, timeout)

    def read(self, local: MemoryRegion, remote: MemoryRegion, length: int, loff: int = 0,
             roff: int = 0, timeout: float = 30.0) -> None:
        self._post(e.IBV_WR_RDMA_READ, local, loff, remote, roff, length, timeout)

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


def connected_pair(pd_a: ProtectionDomain, pd_b: ProtectionDomain) -> tuple[Endpoint, Endpoint]:
    a, b = Endpoint(pd_a), Endpoint(pd_b)
    a.connect(b)
    b.connect(a)
    return a, b
