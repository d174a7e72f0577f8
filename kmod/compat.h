/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * compat.h: the only place in p2phub.ko where kernel versions are tested,
 * and where the answers of the compile probes (conftest.sh, written to
 * conftest.h at each build) are used. An interface that moved is told by
 * probing the target kernel's headers for it, never by its version number
 * (distribution kernels carry backports); the older blocks below still test
 * versions.
 *
 * Lab kernels: Debian 6.1.0-57, 6.12.118 and 7.x. Each block names the change
 * it papers over.
 */
#ifndef _P2PHUB_COMPAT_H
#define _P2PHUB_COMPAT_H

#include <linux/dma-buf.h>
#include <linux/fs.h>
#include <linux/iommu.h>
#include <linux/irqdomain.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/swiotlb.h>
#include <linux/version.h>
#include <linux/workqueue.h>

#include "conftest.h"

/*
 * MODULE_IMPORT_NS() takes a string literal since 6.13 ("module: Convert
 * symbol namespace to string literal"); before that, a bare identifier.
 * Probed (conftest.sh): the bare form fails to compile where the string
 * form is wanted.
 */
#ifdef P2PHUB_HAVE_MODULE_IMPORT_NS_IDENTIFIER
#define P2PHUB_IMPORT_NS_DMA_BUF()	MODULE_IMPORT_NS(DMA_BUF)
#else
#define P2PHUB_IMPORT_NS_DMA_BUF()	MODULE_IMPORT_NS("DMA_BUF")
#endif

/*
 * dma-buf locking. 6.2 ("dma-buf: Move dma_buf_map_attachment() to dynamic
 * locking specification") made dma_buf_map_attachment(), _unmap_, _pin()
 * and _unpin() require the reservation lock for every importer; 6.1 asks it
 * of dynamic importers only, and p2phub is always a dynamic importer. So one
 * rule serves both: hold dmabuf->resv around pin/map/unmap/unpin, never
 * around dma_buf_dynamic_attach()/dma_buf_detach(), which lock it
 * themselves. No #ifdef is needed for that; this note keeps the reason.
 */

/*
 * vma->vm_flags became read-only in 6.3 ("mm: introduce vma->vm_flags
 * wrapper functions"): set flags with vm_flags_set() (mmap_lock held for
 * write, as in an mmap handler). 6.1 writes the field.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 3, 0)
#define p2phub_vm_flags_set(vma, flags)	vm_flags_set(vma, flags)
#define p2phub_vm_flags_clear(vma, flags)	vm_flags_clear(vma, flags)
#else
static inline void p2phub_vm_flags_set(struct vm_area_struct *vma,
				       unsigned long flags)
{
	vma->vm_flags |= flags;
}

static inline void p2phub_vm_flags_clear(struct vm_area_struct *vma,
					 unsigned long flags)
{
	vma->vm_flags &= ~flags;
}
#endif

/*
 * Whether an IOMMU group's MSIs are isolated (interrupt remapping): 6.3
 * ("iommu: Add iommu_group_has_isolated_msi()") asks the group; before
 * that, VFIO asked the device's IOMMU for IOMMU_CAP_INTR_REMAP or the MSI
 * irq domain for remapping.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 3, 0)
static inline bool p2phub_isolated_msi(struct iommu_group *group,
				       struct device *dev)
{
	return iommu_group_has_isolated_msi(group);
}
#else
static inline bool p2phub_isolated_msi(struct iommu_group *group,
				       struct device *dev)
{
	return device_iommu_capable(dev, IOMMU_CAP_INTR_REMAP) ||
	       irq_domain_check_msi_remap();
}
#endif

/*
 * dma_buf_ops.mmap is called without the dma-buf's reservation lock on
 * 6.1 and again since 6.5 ("dma-buf: Change locking policy for mmap()");
 * 6.2-6.4 held it. p2phub's export mmap takes p2phub_reg.lock, and no path
 * holds p2phub_reg.lock while it takes an export's dma_resv (importers are
 * notified without it), so both orders are fine; no #ifdef.
 */

/*
 * dma_buf_vmap() needs the reservation lock held since 6.2 ("dma-buf: Move
 * dma_buf_vmap() to dynamic locking specification"), which added the
 * _unlocked variants that take it; 6.1's dma_buf_vmap() locks internally.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 2, 0)
#define p2phub_dma_buf_vmap(dmabuf, map)	dma_buf_vmap_unlocked(dmabuf, map)
#define p2phub_dma_buf_vunmap(dmabuf, map)	dma_buf_vunmap_unlocked(dmabuf, map)
#else
#define p2phub_dma_buf_vmap(dmabuf, map)	dma_buf_vmap(dmabuf, map)
#define p2phub_dma_buf_vunmap(dmabuf, map)	dma_buf_vunmap(dmabuf, map)
#endif

/*
 * A reference on a struct file that may be on its way out (count zero,
 * __fput() running): struct file's count became a file_ref_t in 6.13
 * ("fs: add file_ref"); before, an atomic_long_t f_count. The caller
 * guarantees the struct itself is not freed meanwhile.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 13, 0)
#define p2phub_file_get_unless_zero(f)	file_ref_get(&(f)->f_ref)
#else
#define p2phub_file_get_unless_zero(f)	atomic_long_inc_not_zero(&(f)->f_count)
#endif

/*
 * Whether @paddr lies in @dev's swiotlb bounce pool. 6.12 ("swiotlb: reduce
 * swiotlb pool lookups") replaced is_swiotlb_buffer() with
 * swiotlb_find_pool().
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 12, 0)
static inline bool p2phub_swiotlb_addr(struct device *dev, phys_addr_t paddr)
{
	return swiotlb_find_pool(dev, paddr) != NULL;
}
#else
static inline bool p2phub_swiotlb_addr(struct device *dev, phys_addr_t paddr)
{
	return is_swiotlb_buffer(dev, paddr);
}
#endif

/*
 * The importer's callback for an exporter taking its memory back, and the
 * exporter's call that reaches every importer: Linux 7.0 renamed
 * dma_buf_attach_ops.move_notify to invalidate_mappings and
 * dma_buf_move_notify() to dma_buf_invalidate_mappings(), same arguments,
 * same rule (the dma-buf's reservation lock held). Probed separately.
 */
#ifdef P2PHUB_HAVE_DMA_BUF_ATTACH_OPS_INVALIDATE_MAPPINGS
#define P2PHUB_DMA_BUF_ATTACH_OPS_INVALIDATE(fn)	.invalidate_mappings = (fn)
#else
#define P2PHUB_DMA_BUF_ATTACH_OPS_INVALIDATE(fn)	.move_notify = (fn)
#endif

#ifdef P2PHUB_HAVE_DMA_BUF_INVALIDATE_MAPPINGS
#define p2phub_dma_buf_invalidate(dmabuf)	dma_buf_invalidate_mappings(dmabuf)
#else
#define p2phub_dma_buf_invalidate(dmabuf)	dma_buf_move_notify(dmabuf)
#endif

/*
 * Whether the dma-buf core leaves a dynamic importer's attachment unpinned
 * and tells it of moves instead (so a pin an exporter sees is the
 * importer's own): before 7.0 only with CONFIG_DMABUF_MOVE_NOTIFY, which
 * Debian and most distributions leave off (the core then pins before each
 * map); since 7.0 always ("dma-buf: Always build with
 * DMABUF_MOVE_NOTIFY", which dropped the option). The dropped option
 * leaves nothing in the headers to probe; it came in the series that
 * renamed move_notify to invalidate_mappings, so that probe's answer
 * stands for it.
 */
#if IS_ENABLED(CONFIG_DMABUF_MOVE_NOTIFY) || \
	defined(P2PHUB_HAVE_DMA_BUF_ATTACH_OPS_INVALIDATE_MAPPINGS)
#define P2PHUB_DMA_BUF_MOVE_NOTIFY	1
#else
#define P2PHUB_DMA_BUF_MOVE_NOTIFY	0
#endif

/*
 * A workqueue bound to the CPU that queues its work: what flags 0 meant
 * before the workqueue rework (6.17, "workqueue: Add new WQ_PERCPU flag").
 * Where WQ_PERCPU exists it is said, since 7.0's alloc_workqueue() warns
 * without it or WQ_UNBOUND.
 */
#ifdef P2PHUB_HAVE_WQ_PERCPU
#define P2PHUB_WQ_PERCPU	WQ_PERCPU
#else
#define P2PHUB_WQ_PERCPU	0
#endif

#endif /* _P2PHUB_COMPAT_H */
