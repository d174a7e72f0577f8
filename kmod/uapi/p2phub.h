/* SPDX-License-Identifier: ((GPL-2.0 WITH Linux-syscall-note) OR MIT) */
/*
 * p2phub user-space ABI: the one header shared by p2phub.ko and user space.
 *
 * Every argument struct starts with { __u32 argsz; __u32 flags; }. The kernel
 * rejects an argsz smaller than the struct it knows, any flag bit it does not
 * know, and any nonzero reserved field, so fields can be added at the end
 * later without breaking old binaries. Structs are naturally aligned, padded
 * explicitly, and sized by static asserts in the kernel build; the Python
 * mirror (p2phub/uapi.py) is checked against this header by the unit tests.
 */
#ifndef _UAPI_P2PHUB_H
#define _UAPI_P2PHUB_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define P2PHUB_DEVICE_NAME	"p2phub"
#define P2PHUB_ABI_VERSION	1

#define P2PHUB_IOCTL_TYPE	0xB9
#define P2PHUB_IOCTL_BASE	0x40

/* Capability bits reported by P2PHUB_GET_INFO. */
#define P2PHUB_CAP_DMABUF_IMPORT	(1ULL << 0)	/* pin through dma-buf attach */
#define P2PHUB_CAP_NVIDIA_P2P_BUILT	(1ULL << 1)	/* built against nv-p2p.h */
#define P2PHUB_CAP_NVIDIA_P2P_LIVE	(1ULL << 2)	/* nvidia_p2p_* symbols resolvable now */
#define P2PHUB_CAP_DMABUF_EXPORT	(1ULL << 3)	/* registrations re-exported as dma-bufs */
#define P2PHUB_CAP_NVME		(1ULL << 4)	/* NVMe controller ownership */

/**
 * P2PHUB_GET_INFO - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 0)
 *
 * Report the ABI version, the module version and the capabilities.
 * In: argsz, flags (0). Out: the rest.
 *
 * Return: 0 on success, -EFAULT on a bad pointer, -EINVAL for argsz too
 * small, unknown flags or nonzero reserved fields.
 */
struct p2phub_info {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__u32	abi_version;		/* out: P2PHUB_ABI_VERSION */
	__u32	max_regs_per_file;	/* out: registrations one open file may hold */
	__aligned_u64 caps;		/* out: P2PHUB_CAP_* */
	char	version[32];		/* out: module version, NUL terminated */
	__aligned_u64 reserved[4];	/* must be 0 */
};

#define P2PHUB_GET_INFO		_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 0)

#endif /* _UAPI_P2PHUB_H */
