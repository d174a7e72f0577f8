"""p2phub: one registration makes GPU memory usable by NVMe SSDs and RDMA NICs."""

__version__ = "0.1.0"
