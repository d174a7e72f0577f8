/* SPDX-License-Identifier: ((GPL-2.0 WITH Linux-syscall-note) OR MIT) */
/*
 * p2phub_fakegpu: the lab's stand-in GPU, a test-only driver for the
 * ivshmem-plain device (1af4:1110) whose BAR2 is the "GPU memory".
 *
 * It exports BAR ranges as dma-bufs the way a GPU driver exports VRAM, and
 * provides the NVIDIA P2P kernel API over a fake GPU virtual address space.
 * /dev/p2phub_fakegpu controls it: this header is its ABI, mirrored for the
 * tests in tests/lab/fakegpu.py.
 *
 * Every argument struct starts with { __u32 argsz; __u32 flags; }: argsz
 * below the known size, unknown flags and nonzero reserved fields are
 * refused with -EINVAL. Ioctl numbers carry no size (_IO).
 *
 * mmap() of /dev/p2phub_fakegpu at offset O maps BAR2 bytes [O, O + len)
 * uncached into the caller: the GPU's own view of its memory.
 */
#ifndef _UAPI_P2PHUB_FAKEGPU_H
#define _UAPI_P2PHUB_FAKEGPU_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define P2PHUB_FAKEGPU_DEVICE_NAME	"p2phub_fakegpu"

#define P2PHUB_FAKEGPU_IOCTL_TYPE	0xBA
#define P2PHUB_FAKEGPU_IOCTL_BASE	0x40

/*
 * The fake GPU virtual address space served by nvidia_p2p_get_pages():
 * GPU VA P2PHUB_FAKEGPU_VA_BASE + X is BAR2 offset X, for X below the BAR
 * size, in GPU pages of P2PHUB_FAKEGPU_GPU_PAGE_SIZE bytes.
 */
#define P2PHUB_FAKEGPU_VA_BASE		0x7fe000000000ULL
#define P2PHUB_FAKEGPU_GPU_PAGE_SIZE	0x10000
/* dma-buf exports are made of whole CPU pages. */
#define P2PHUB_FAKEGPU_EXPORT_ALIGN	0x1000

/**
 * P2PHUB_FAKEGPU_QUERY - _IO(P2PHUB_FAKEGPU_IOCTL_TYPE, P2PHUB_FAKEGPU_IOCTL_BASE + 0)
 *
 * Describe the BAR and count what is outstanding now. In: argsz, flags (0).
 * Out: the rest.
 *
 * Return: 0, -EFAULT, or -EINVAL (argsz, flags, reserved).
 */
struct p2phub_fakegpu_query {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__aligned_u64 bar_size;		/* out: BAR2 bytes */
	__aligned_u64 bar_addr;		/* out: BAR2 bus address (CPU physical on x86) */
	__aligned_u64 va_base;		/* out: P2PHUB_FAKEGPU_VA_BASE */
	/* dma-buf exporter */
	__u32	bufs;			/* out: exported dma-bufs alive */
	__u32	bufs_revoked;		/* out: of those, revoked */
	__u32	attachments;		/* out: importer attachments alive */
	__u32	mappings;		/* out: sg tables handed out and not unmapped */
	__u32	pins;			/* out: pins held */
	__u32	attach_refused;		/* out: attachments refused since load */
	/* NVIDIA P2P provider */
	__u32	page_tables;		/* out: page tables alive (get_pages, not yet released) */
	__u32	dma_mappings;		/* out: nvidia_p2p_dma_map_pages() results alive */
	__u32	callbacks;		/* out: free callbacks run since load */
	__u32	callbacks_unacked;	/* out: callbacks that returned without nvidia_p2p_free_page_table() */
	__u32	late_calls;		/* out: put/unmap on a table already revoked (tolerated, returns 0) */
	__u32	misuse;			/* out: calls refused as API misuse since load */
	__aligned_u64 reserved[4];	/* must be 0 */
};

#define P2PHUB_FAKEGPU_QUERY	_IO(P2PHUB_FAKEGPU_IOCTL_TYPE, P2PHUB_FAKEGPU_IOCTL_BASE + 0)

/**
 * P2PHUB_FAKEGPU_EXPORT_DMABUF - _IO(P2PHUB_FAKEGPU_IOCTL_TYPE, P2PHUB_FAKEGPU_IOCTL_BASE + 1)
 *
 * Export BAR2 bytes [offset, offset + length) as a new dma-buf. Importers
 * must be dynamic and allow peer-to-peer; they get bus addresses mapped for
 * their device with dma_map_resource() (IOVAs when an IOMMU translates for
 * them) and no struct pages. In: argsz, flags (0), offset, length (both
 * multiples of P2PHUB_FAKEGPU_EXPORT_ALIGN, inside the BAR). Out: fd
 * (O_RDWR | O_CLOEXEC).
 *
 * Return: 0, -EFAULT, -EINVAL (argsz, flags, reserved, alignment, zero
 * length), -ERANGE (outside the BAR, or offset + length overflows), -ENOMEM,
 * -EMFILE.
 */
struct p2phub_fakegpu_export {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__aligned_u64 offset;		/* BAR2 offset */
	__aligned_u64 length;		/* bytes */
	__s32	fd;			/* out: the dma-buf */
	__u32	reserved;		/* must be 0 */
};

#define P2PHUB_FAKEGPU_EXPORT_DMABUF	_IO(P2PHUB_FAKEGPU_IOCTL_TYPE, P2PHUB_FAKEGPU_IOCTL_BASE + 1)

/**
 * P2PHUB_FAKEGPU_REVOKE - _IO(P2PHUB_FAKEGPU_IOCTL_TYPE, P2PHUB_FAKEGPU_IOCTL_BASE + 2)
 *
 * Revoke a dma-buf exported here, as a GPU driver does when it frees or
 * moves the memory: under the reservation lock, mark it revoked and call
 * every importer's move_notify; then, with the lock dropped, wait for every
 * fence in its reservation object (the importers' work still using the old
 * mapping), as an exporter does before it moves memory. From then on
 * attach, pin and map_dma_buf fail with -ENODEV. Mappings the importers had
 * not dropped by then stay valid (counted in mappings_left) until they
 * unmap. Revoking twice is not an error. In: argsz, flags (0), fd. Out:
 * mappings_left, pins_left.
 *
 * Return: 0, -EFAULT, -EINVAL (argsz, flags, reserved; fd is a dma-buf of
 * another exporter), -EBADF, -EINTR.
 */
struct p2phub_fakegpu_revoke {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__s32	fd;			/* a dma-buf from EXPORT_DMABUF */
	__u32	mappings_left;		/* out: sg tables still mapped after the wait */
	__u32	pins_left;		/* out: pins still held after the wait */
	__u32	reserved;		/* must be 0 */
};

#define P2PHUB_FAKEGPU_REVOKE	_IO(P2PHUB_FAKEGPU_IOCTL_TYPE, P2PHUB_FAKEGPU_IOCTL_BASE + 2)

/**
 * P2PHUB_FAKEGPU_FREE - _IO(P2PHUB_FAKEGPU_IOCTL_TYPE, P2PHUB_FAKEGPU_IOCTL_BASE + 3)
 *
 * Simulate cudaFree() of GPU VA range [va, va + length) while third parties
 * hold it: the free callback of every non-persistent page table overlapping
 * it runs, in this thread, under the driver's API lock (which get_pages,
 * put_pages and dma_map_pages take), before the ioctl returns; then the DMA
 * mappings the consumer left are unmapped and the tables are freed. The
 * range itself stays usable (as if allocated again). In: argsz, flags (0),
 * va, length. Out: callbacks.
 *
 * Return: 0, -EFAULT, -EINVAL (argsz, flags, reserved, zero length),
 * -ERANGE (va + length overflows), -ENOENT (no page table overlaps).
 */
struct p2phub_fakegpu_free {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__aligned_u64 va;		/* fake GPU VA */
	__aligned_u64 length;		/* bytes */
	__u32	callbacks;		/* out: free callbacks run */
	__u32	reserved;		/* must be 0 */
};

#define P2PHUB_FAKEGPU_FREE	_IO(P2PHUB_FAKEGPU_IOCTL_TYPE, P2PHUB_FAKEGPU_IOCTL_BASE + 3)

#endif /* _UAPI_P2PHUB_FAKEGPU_H */
