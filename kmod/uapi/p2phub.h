/* SPDX-License-Identifier: ((GPL-2.0 WITH Linux-syscall-note) OR MIT) */
/*
 * p2phub user-space ABI: the one header shared by p2phub.ko and user space.
 *
 * Every argument struct starts with { __u32 argsz; __u32 flags; }. The kernel
 * rejects an argsz smaller than the struct it knows, any flag bit it does not
 * know, any nonzero reserved field and any nonzero output field (out_*, and
 * GET_INFO's fields after flags): outputs must come in as 0. So fields can be
 * added at the end, and outputs given an input meaning, later without
 * breaking old binaries. Structs are naturally aligned, padded
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
 * In: argsz, flags (0), the rest 0. Out: the rest.
 *
 * Return: 0 on success, -EFAULT on a bad pointer, -EINVAL for argsz too
 * small, unknown flags or nonzero reserved or output fields.
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
 * Registrations: P2PHUB_IOCTL_BASE + 1 .. + 15.
 *
 * A registration pins a window of device memory once (a dma-buf window, or
 * an NVIDIA GPU virtual address range through the NVIDIA P2P API) and hands
 * out, per PCI device, the DMA addresses of its pages as that device must use
 * them (IOVAs when an IOMMU translates for it). A handle is private to the
 * open file of /dev/p2phub that made it; closing that file releases every
 * registration it holds.
 *
 * Revocation: when the owner of the memory takes it back (dma-buf
 * move_notify, NVIDIA free callback), the registration turns REVOKED, its
 * generation is bumped, its DMA mappings are torn down, and every later use
 * fails with -ESTALE; only P2PHUB_REG_INFO and P2PHUB_UNREGISTER still work.
 */
#define P2PHUB_PROVIDER_DMABUF		1	/* dma-buf importer */
#define P2PHUB_PROVIDER_NVIDIA		2	/* NVIDIA P2P API */

#define P2PHUB_REG_STATE_LIVE		1
#define P2PHUB_REG_STATE_REVOKED	2	/* the owner took the memory back */

#define P2PHUB_DMA_PAGES_MAX		(1U << 20)	/* entries per P2PHUB_DMA_PAGES call */

/**
 * P2PHUB_REGISTER - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 1)
 *
 * Pin memory and make a registration. Exactly one of F_DMABUF, F_NVIDIA.
 * F_DMABUF: fd, offset, length (page aligned, inside the dma-buf); va = 0.
 * F_NVIDIA: va, length (64 KiB aligned); fd = -1, offset = 0.
 * F_DEVICE: also map for PCI device domain:bus:devfn right away (a dma-buf
 * exporter pins per attached device, so this is what pins a dma-buf).
 * Out: out_handle, out_page_size, out_provider.
 *
 * Return: 0; -EINVAL bad argsz, flags, reserved or out field, zero length,
 * unaligned offset/length/va, or fd not a dma-buf; -EBADF fd not open;
 * -EOVERFLOW offset + length wraps; -ERANGE the window ends past the
 * dma-buf; -ENOSPC the file holds P2PHUB_INFO.max_regs_per_file already;
 * -EOPNOTSUPP F_NVIDIA without NVIDIA P2P support built in; -ENXIO the
 * nvidia_p2p_* symbols are not loaded; -ENODEV F_DEVICE names no PCI device,
 * or one no driver is bound to;
 * -ENOMEM, also when length would take the caller's pinned memory (VmPin,
 * which every registration is charged to until it is released) past its
 * RLIMIT_MEMLOCK and the caller lacks CAP_IPC_LOCK; -EFAULT; or the
 * exporter's / NVIDIA driver's error.
 */
struct p2phub_register {
	__u32	argsz;
	__u32	flags;
#define P2PHUB_REGISTER_F_DMABUF	(1 << 0)	/* fd + offset + length */
#define P2PHUB_REGISTER_F_NVIDIA	(1 << 1)	/* va + length, NVIDIA P2P */
#define P2PHUB_REGISTER_F_DEVICE	(1 << 2)	/* map for domain/bus/devfn now */
	__s32	fd;			/* dma-buf fd, or -1 */
	__u32	domain;			/* F_DEVICE: PCI segment */
	__u8	bus;			/* F_DEVICE */
	__u8	devfn;			/* F_DEVICE */
	__u16	__reserved0;		/* must be 0 */
	__u32	__reserved1;		/* must be 0 */
	__aligned_u64 va;		/* F_NVIDIA: GPU virtual address */
	__aligned_u64 offset;		/* F_DMABUF: byte offset in the dma-buf */
	__aligned_u64 length;		/* bytes */
	__aligned_u64 out_handle;	/* out: nonzero handle */
	__u32	out_page_size;		/* out: bytes per registration page */
	__u32	out_provider;		/* out: P2PHUB_PROVIDER_* */
	__aligned_u64 reserved[2];	/* must be 0 */
};

/**
 * P2PHUB_UNREGISTER - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 2)
 *
 * Release a registration: unmap it from every device and drop the pin. A
 * revoked registration is unregistered the same way. Exported dma-bufs that
 * nobody is attached to stay valid files but refuse new attachments.
 *
 * Return: 0; -ENOENT no such handle in this file (never made, already
 * unregistered, or another file's); -EBUSY an importer is attached to an
 * export of it, or in-kernel I/O holds it; -EINVAL; -EFAULT.
 */
struct p2phub_unregister {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__aligned_u64 handle;
	__aligned_u64 reserved[1];	/* must be 0 */
};

/**
 * P2PHUB_REG_INFO - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 3)
 *
 * Report a registration's state. In: handle. Out: the rest.
 *
 * Return: 0; -ENOENT no such handle; -EINVAL; -EFAULT.
 */
struct p2phub_reg_info {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__aligned_u64 handle;
	__u32	out_state;		/* P2PHUB_REG_STATE_* */
	__u32	out_provider;		/* P2PHUB_PROVIDER_* */
	__aligned_u64 out_generation;	/* bumped on every revocation */
	__aligned_u64 out_length;	/* bytes */
	__u32	out_page_size;		/* bytes per registration page */
	__u32	out_nr_devices;		/* devices it is mapped for */
	__u32	out_nr_exports;		/* exported dma-bufs still open */
	__u32	out_nr_attached;	/* importers attached to them */
	__u32	out_io_holds;		/* in-kernel I/O holding it */
	__u32	out_flags;		/* P2PHUB_REG_INFO_F_* */
	__aligned_u64 reserved[2];	/* must be 0 */
};

/* REG_INFO out_flags */
#define P2PHUB_REG_INFO_F_READ_ONLY	(1 << 0)	/* devices may only read it */
#define P2PHUB_REG_INFO_F_REVOCABLE	(1 << 1)	/* its owner may revoke it */

/**
 * P2PHUB_DMA_PAGES - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 4)
 *
 * Copy out the DMA addresses of a registration's pages for one PCI device,
 * mapping it for that device on first use. Pages are counted in units of
 * page_size (0: the registration's page size; else a power of two from 4096
 * up to the registration's page size); entry i is the address of byte
 * (first + i) * page_size of the registration. count entries of __u64 are
 * room at addrs; at most count are written, and count returns how many.
 * count = 0 only reports out_total.
 *
 * Return: 0; -ENOENT no such handle; -ENODEV no such PCI device, or one no
 * driver is bound to; -EINVAL bad argsz, flags, reserved field or page_size,
 * or addrs = 0 with count > 0;
 * -E2BIG count > P2PHUB_DMA_PAGES_MAX; -ERANGE first >= out_total;
 * -ESTALE revoked (also when it was revoked while the addresses were being
 * copied: they must not be used); -ENOMEM; -EFAULT; or the exporter's error.
 */
struct p2phub_dma_pages {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__aligned_u64 handle;
	__u32	domain;			/* PCI segment of the device */
	__u8	bus;
	__u8	devfn;
	__u16	__reserved0;		/* must be 0 */
	__u32	page_size;		/* in: bytes per entry, 0 = registration's */
	__u32	count;			/* in: room at addrs; out: entries written */
	__aligned_u64 first;		/* in: first page, in page_size units */
	__aligned_u64 addrs;		/* in: user pointer to __u64[count] */
	__aligned_u64 out_total;	/* out: pages of page_size in the registration */
	__aligned_u64 out_generation;	/* out: generation the addresses belong to */
	__aligned_u64 reserved[2];	/* must be 0 */
};

/**
 * P2PHUB_EXPORT - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 5)
 *
 * Export a registration as a new dma-buf (p2phub is its exporter), e.g. for
 * ibv_reg_dmabuf_mr(). Importers must be dynamic (have move_notify) and
 * allow peer-to-peer; they are attached to a PCI device, for which the
 * registration is mapped. When the registration is revoked or unregistered
 * the importers get move_notify and mapping fails with -ENODEV. The dma-buf
 * holds the registration's memory until its last importer detaches.
 *
 * Return: the new dma-buf fd; -ENOENT no such handle; -ESTALE revoked;
 * -EINVAL; -ENOMEM; -EMFILE; -EFAULT.
 */
struct p2phub_export {
	__u32	argsz;
	__u32	flags;
#define P2PHUB_EXPORT_F_CLOEXEC		(1 << 0)	/* the fd gets O_CLOEXEC */
	__aligned_u64 handle;
	__aligned_u64 reserved[2];	/* must be 0 */
};

#define P2PHUB_REGISTER		_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 1)
#define P2PHUB_UNREGISTER	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 2)
#define P2PHUB_REG_INFO		_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 3)
#define P2PHUB_DMA_PAGES	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 4)
#define P2PHUB_EXPORT		_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 5)

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
 * p2phub-nvme. Needs CAP_SYS_RAWIO, a kernel not locked down for PCI
 * access, and an IOMMU that confines the controller (a translated DMA
 * domain, a viable group, isolated MSI) unless the module parameter
 * allow_unsafe_noiommu is set (which taints the kernel). While it is owned,
 * binding a kernel driver to another device of its IOMMU group takes the
 * controller back from the owner (P2PHUB_NVME_ST_REVOKED, -EXDEV).
 * In: argsz, flags (0), domain, bus, devfn.
 * Out: out_nr_irqs, out_bar0_size, out_bar0_mmap_size (BAR0 up to the first
 * page holding the MSI-X table or PBA: the doorbells and registers).
 *
 * The controller fd keeps the /dev/p2phub file it was opened from alive:
 * registrations of that file are torn down only after every controller fd
 * made from it has been closed, and so quiesced.
 *
 * Return: the new controller fd (O_CLOEXEC) on success; -ENODEV no such PCI
 * device; -ENXIO not bound to p2phub-nvme; -EBUSY another fd owns it or
 * another controller of its IOMMU group, or it is being unbound; -EPERM without CAP_SYS_RAWIO, or locked down;
 * -EXDEV no IOMMU confinement (see above); -EINVAL bad argsz, flags or
 * nonzero reserved/out fields; -ENOMEM; -EFAULT.
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
	__aligned_u64 out_bar0_mmap_size; /* out: bytes of BAR0 that may be mmapped */
	__aligned_u64 reserved[1];	/* must be 0 */
};

/**
 * P2PHUB_NVME_DMA_ALLOC - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 17)
 *
 * On a controller fd: allocate DMA-coherent memory for the controller
 * (queues, PRP lists, host data buffers). mmap out_mmap_offset to use it.
 * In: argsz, flags (0), size (page multiple, <= P2PHUB_NVME_DMA_MAX_BUF).
 * Out: out_dma_addr (the controller's address), out_mmap_offset, out_id.
 *
 * Return: 0; -EINVAL bad size, flags, reserved or out field; -ENOSPC over
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

/*
 * Registrations the controller may DMA to. P2PHUB_NVME_MAP_REG takes a hold
 * on a registration of the /dev/p2phub file the controller was opened from
 * and maps it for this controller; while held, UNREGISTER of it fails with
 * -EBUSY and closing that file keeps the pin until the controller fd is
 * closed (after the controller is quiesced). If the memory's owner revokes
 * it, the kernel first turns the controller's bus mastering off and sets
 * P2PHUB_NVME_ST_FENCED and the slot's word to 0 in the status page, and
 * only then lets the memory go.
 *
 * The status page (mmap P2PHUB_NVME_MMAP_STATUS, one page, read-only) lets
 * the engine check, with plain loads and no system call, before every
 * doorbell write: state == 0 and reg_gen[slot] == the generation MAP_REG
 * returned.
 */
#define P2PHUB_NVME_MAX_MAPS		256
#define P2PHUB_NVME_MMAP_STATUS		(1ULL << 31)
#define P2PHUB_NVME_STATUS_ABI		1

#define P2PHUB_NVME_ST_FENCED		(1U << 0)	/* bus mastering off: a mapped registration was revoked */
#define P2PHUB_NVME_ST_REMOVING		(1U << 1)	/* the device is going away: close the fd */
#define P2PHUB_NVME_ST_ERROR		(1U << 2)	/* a PCI error was reported: bus mastering off */
/*
 * The kernel took the controller back (removal after its grace period, or a
 * kernel driver bound to a device of its IOMMU group): DMA stopped, every
 * registration unmapped, BAR0 and DMA buffer mappings gone (an access is
 * SIGBUS), ioctls fail with -ENODEV (removal) or -EXDEV (IOMMU group); only
 * this page and closing the fd are left.
 */
#define P2PHUB_NVME_ST_REVOKED		(1U << 3)

struct p2phub_nvme_status {
	__u32	abi;			/* P2PHUB_NVME_STATUS_ABI */
	__u32	state;			/* P2PHUB_NVME_ST_* */
	__aligned_u64 events;		/* counts changes of state and of reg_gen */
	__aligned_u64 reg_gen[P2PHUB_NVME_MAX_MAPS]; /* 0: slot unused or revoked */
};

/**
 * P2PHUB_NVME_MAP_REG - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 20)
 *
 * On a controller fd: hold registration `handle` and copy `count` DMA
 * addresses of it (in units of page_size, 0 = the registration's page size,
 * starting at entry `first`) into the u64 array at `addrs`. Calling it again
 * for a held registration only copies addresses.
 * Out: out_total (entries in the whole list), out_generation, out_slot.
 *
 * Return: 0; -ENOENT unknown handle; -ESTALE the registration was revoked;
 * -ENOSPC P2PHUB_NVME_MAX_MAPS held already; -ERANGE first past the end;
 * -E2BIG count > P2PHUB_DMA_PAGES_MAX; -EIO the controller is fenced or
 * being removed; -EINVAL bad argsz, flags, page_size or reserved fields;
 * -EFAULT.
 */
struct p2phub_nvme_map_reg {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__aligned_u64 handle;		/* on the /dev/p2phub file of NVME_OPEN */
	__aligned_u64 addrs;		/* user pointer to u64[count] */
	__aligned_u64 first;
	__u32	count;
	__u32	page_size;		/* 0, or a power of two >= 4096 */
	__aligned_u64 out_total;
	__aligned_u64 out_generation;
	__u32	out_slot;		/* index into p2phub_nvme_status.reg_gen */
	__u32	__reserved;		/* must be 0 */
	__aligned_u64 reserved[2];	/* must be 0 */
};

/**
 * P2PHUB_NVME_UNMAP_REG - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 21)
 *
 * On a controller fd: drop the hold MAP_REG took. The caller states that no
 * command it submitted still references the registration; p2phub's engine
 * calls it only once every such command has completed.
 *
 * Return: 0; -ENOENT not held; -EINVAL; -EFAULT.
 */
struct p2phub_nvme_unmap_reg {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__aligned_u64 handle;
	__aligned_u64 reserved[1];	/* must be 0 */
};

/**
 * P2PHUB_NVME_RESUME - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 22)
 *
 * On a controller fd: after P2PHUB_NVME_ST_FENCED or _ERROR, turn bus
 * mastering back on and clear those bits. The controller must be disabled
 * (CC.EN = 0 and CSTS.RDY = 0, which the kernel reads), so nothing queued
 * before the fence can run again.
 *
 * Return: 0; -EBUSY the controller is enabled, a revoked registration is
 * still held (NVME_MAP_REG without NVME_UNMAP_REG), or one is still mapped
 * for this controller because importers of its exports are not done yet,
 * or recovery from a PCI error is not over yet; -ENODEV it is being removed or
 * reads all ones; -ENODEV/-EXDEV the kernel took it back
 * (P2PHUB_NVME_ST_REVOKED); -EINTR; -EINVAL; -EFAULT.
 */
struct p2phub_nvme_resume {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__aligned_u64 reserved[1];	/* must be 0 */
};

/**
 * P2PHUB_NVME_REQ_SET - _IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 23)
 *
 * On a controller fd: signal `eventfd` when the kernel needs the controller
 * back (unbind, removal, a PCI error); P2PHUB_NVME_ST_* in the status page
 * says which. The owner should close the fd: an unbind waits for that,
 * asking again every 10 s, for the p2phub module parameter remove_grace_ms
 * (default 10 s); then the kernel takes the controller back itself
 * (P2PHUB_NVME_ST_REVOKED) and the unbind completes.
 * -1 detaches.
 *
 * Return: 0; -EBADF not an eventfd; -EINVAL; -EFAULT.
 */
struct p2phub_nvme_req_set {
	__u32	argsz;
	__u32	flags;			/* none defined, must be 0 */
	__s32	eventfd;		/* -1 detaches */
	__u32	__reserved;		/* must be 0 */
	__aligned_u64 reserved[1];	/* must be 0 */
};

#define P2PHUB_NVME_OPEN	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 16)
#define P2PHUB_NVME_DMA_ALLOC	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 17)
#define P2PHUB_NVME_DMA_FREE	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 18)
#define P2PHUB_NVME_IRQ_SET	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 19)
#define P2PHUB_NVME_MAP_REG	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 20)
#define P2PHUB_NVME_UNMAP_REG	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 21)
#define P2PHUB_NVME_RESUME	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 22)
#define P2PHUB_NVME_REQ_SET	_IO(P2PHUB_IOCTL_TYPE, P2PHUB_IOCTL_BASE + 23)

#endif /* _UAPI_P2PHUB_H */
