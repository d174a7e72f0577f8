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

/*
 * NVMe controller ownership: P2PHUB_IOCTL_BASE + 16 .. + 31.
 *
 * A controller is handed to p2phub by binding it to the PCI driver
 * "p2phub-nvme" (driver_override); P2PHUB_NVME_OPEN then gives the caller a
 * controller fd. On that fd: mmap offset P2PHUB_NVME_MMAP_BAR0 maps BAR0
 * (uncached); P2PHUB_NVME_DMA_ALLOC makes DMA-coherent memory, mapped at the
 * offset it reports; P2PHUB_NVME_IRQ_SET relays an MSI-X vector to an
 * eventfd. Closing the fd disables the controller (CC.EN = 0, bus master
 * off) and then frees everything it held.
 */
#define P2PHUB_NVME_MAX_IRQS		32
#define P2PHUB_NVME_DMA_MAX_BUF		(4ULL << 20)	/* one allocation */
#define P2PHUB_NVME_DMA_MAX_TOTAL	(512ULL << 20)	/* per controller fd */
#define P2PHUB_NVME_DMA_MAX_BUFS	4096
#define P2PHUB_NVME_MMAP_BAR0		0ULL
#define P2PHUB_NVME_MMAP_DMA_SHIFT	32
#define P2PHUB_NVME_MMAP_DMA(id)	(((__u64)(id) + 1) << P2PHUB_NVME_MMAP_DMA_SHIFT)

/**
 * P2PHUB_NVME_OPEN - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 16)
 *
 * On /dev/p2phub: become the one owner of a controller bound to
 * p2phub-nvme. Needs CAP_SYS_RAWIO.
 * In: argsz, flags (0), domain, bus, devfn. Out: out_nr_irqs, out_bar0_size.
 *
 * Return: the new controller fd (O_CLOEXEC) on success; -ENODEV no such PCI
 * device; -ENXIO not bound to p2phub-nvme; -EBUSY another fd owns it or it
 * is being unbound; -EPERM without CAP_SYS_RAWIO; -EINVAL bad argsz, flags
 * or nonzero reserved/out fields; -ENOMEM; -EFAULT.
 */
struct p2phub_nvme_open {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__u32	domain;			/* PCI segment */
	__u8	bus;
	__u8	devfn;
	__u16	__reserved0;		/* must be 0 */
	__u32	out_nr_irqs;		/* out: MSI-X vectors, 0..P2PHUB_NVME_MAX_IRQS-1 */
	__u32	__reserved1;		/* must be 0 */
	__aligned_u64 out_bar0_size;	/* out: BAR0 length in bytes */
	__aligned_u64 reserved[2];	/* must be 0 */
};

/**
 * P2PHUB_NVME_DMA_ALLOC - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 17)
 *
 * On a controller fd: allocate DMA-coherent memory for the controller
 * (queues, PRP lists, host data buffers). mmap out_mmap_offset to use it.
 * In: argsz, flags (0), size (page multiple, <= P2PHUB_NVME_DMA_MAX_BUF).
 * Out: out_dma_addr (the controller's address), out_mmap_offset, out_id.
 *
 * Return: 0; -EINVAL bad size, flags or reserved; -ENOSPC over
 * P2PHUB_NVME_DMA_MAX_TOTAL or P2PHUB_NVME_DMA_MAX_BUFS; -ENOMEM; -EFAULT.
 */
struct p2phub_nvme_dma_alloc {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__aligned_u64 size;
	__aligned_u64 out_dma_addr;
	__aligned_u64 out_mmap_offset;
	__u32	out_id;
	__u32	__reserved;		/* must be 0 */
	__aligned_u64 reserved[2];	/* must be 0 */
};

/**
 * P2PHUB_NVME_DMA_FREE - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 18)
 *
 * On a controller fd: free one P2PHUB_NVME_DMA_ALLOC buffer early (closing
 * the fd frees them all). In: argsz, flags (0), id.
 *
 * Return: 0; -ENOENT unknown id; -EBUSY the buffer is still mapped or the
 * controller is enabled (CC.EN = 1); -EINVAL; -EFAULT.
 */
struct p2phub_nvme_dma_free {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__u32	id;
	__u32	__reserved;		/* must be 0 */
	__aligned_u64 reserved[1];	/* must be 0 */
};

/**
 * P2PHUB_NVME_IRQ_SET - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 19)
 *
 * On a controller fd: signal eventfd on every interrupt of MSI-X vector
 * `vector`, replacing any earlier eventfd; eventfd -1 detaches.
 *
 * Return: 0; -EINVAL vector out of range, flags or reserved; -EBADF not an
 * eventfd; an error of request_irq(); -EFAULT.
 */
struct p2phub_nvme_irq_set {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__u32	vector;
	__s32	eventfd;		/* -1 detaches */
	__aligned_u64 reserved[1];	/* must be 0 */
};

#define P2PHUB_NVME_OPEN	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 16)
#define P2PHUB_NVME_DMA_ALLOC	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 17)
#define P2PHUB_NVME_DMA_FREE	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 18)
#define P2PHUB_NVME_IRQ_SET	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 19)

#endif /* _UAPI_P2PHUB_H */
