"""`p2phub doctor`: can GPU<->NVMe and GPU<->NIC peer-to-peer DMA work on this machine, and if not, why.

Everything is read from sysfs/procfs through one :class:`~p2phub.doctor.sysroot.SysRoot`, which can
point at the live system ("/") or at a captured tree (``--root DIR``, made by ``p2phub doctor --capture DIR``).
"""

SCHEMA = "p2phub.doctor/1"
