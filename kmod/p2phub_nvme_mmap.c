// SPDX-License-Identifier: GPL-2.0-only
/*
 * NVMe controller ownership: the owner's mappings of BAR0 and of its DMA
 * buffers.
 *
 * Both are filled at fault time, under p2phub_nvme_handle.mmio_lock, so that
 * zapping them (a reset, a PCI error, the kernel taking the controller back)
 * cannot miss a mapping still being set up; each controller fd has an inode
 * of its own for that.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/fs.h>
#include <linux/io.h>
#include <linux/mm.h>
#include <linux/mutex.h>
#include <linux/overflow.h>
#include <linux/pci.h>
#include <linux/wait.h>
#include <linux/xarray.h>

#include "compat.h"
#include "p2phub_priv.h"
#include "p2phub_nvme.h"

/*
 * Zap the owner's user mappings of BAR0 (and, once @gone, of its DMA
 * buffers). @block: until p2phub_nvme_mmio_unblock(), BAR0 faults wait (a
 * reset or PCI error recovery is under way); @gone: every later fault is
 * SIGBUS. Faults fill mappings under mmio_lock, so none set up before this
 * survives it and none after it sees the old state.
 */
void p2phub_nvme_zap(struct p2phub_nvme_handle *h, bool block,
		     bool gone)
{
	mutex_lock(&h->mmio_lock);
	if (block)
		h->mmio_blocked = true;
	if (gone)
		h->mmio_gone = true;
	if (h->mapping) {
		unmap_mapping_range(h->mapping, P2PHUB_NVME_MMAP_BAR0,
				    h->bar0_mmap_len, 1);
		if (gone)
			unmap_mapping_range(h->mapping,
					    (loff_t)P2PHUB_NVME_MMAP_DMA(0), 0, 1);
	}
	mutex_unlock(&h->mmio_lock);
	if (gone)
		wake_up_all(&h->mmio_wq);
}

static void p2phub_nvme_mmio_unblock(struct p2phub_nvme_handle *h)
{
	mutex_lock(&h->mmio_lock);
	h->mmio_blocked = false;
	mutex_unlock(&h->mmio_lock);
	wake_up_all(&h->mmio_wq);
}

/* The owner's BAR0 across a reset or error recovery: zap and hold, or let go. */
void p2phub_nvme_owner_mmio(struct p2phub_nvme_ctrl *ctrl, bool block)
{
	mutex_lock(&ctrl->lock);
	if (ctrl->owner) {
		if (block)
			p2phub_nvme_zap(ctrl->owner, true, false);
		else
			p2phub_nvme_mmio_unblock(ctrl->owner);
	}
	mutex_unlock(&ctrl->lock);
}

/*
 * Wait while a reset or error recovery holds the owner's BAR0 (a fault
 * there may sleep). Returns with mmio_lock held, or false (SIGBUS) when the
 * mappings are gone for good or a fatal signal came.
 */
static bool p2phub_nvme_mmio_lock(struct p2phub_nvme_handle *h, bool bar)
{
	mutex_lock(&h->mmio_lock);
	while (bar && h->mmio_blocked && !h->mmio_gone) {
		mutex_unlock(&h->mmio_lock);
		if (wait_event_killable(h->mmio_wq,
					!READ_ONCE(h->mmio_blocked) ||
					READ_ONCE(h->mmio_gone)))
			return false;
		mutex_lock(&h->mmio_lock);
	}
	if (h->mmio_gone) {
		mutex_unlock(&h->mmio_lock);
		return false;
	}
	return true;
}

static vm_fault_t p2phub_nvme_bar0_fault(struct vm_fault *vmf)
{
	struct vm_area_struct *vma = vmf->vma;
	struct p2phub_nvme_handle *h = vma->vm_file->private_data;
	/* From vm_pgoff, which a partial munmap of the front moves on. */
	unsigned long pgoff = vmf->pgoff - (P2PHUB_NVME_MMAP_BAR0 >> PAGE_SHIFT);
	vm_fault_t ret;

	if (pgoff >= h->bar0_mmap_len >> PAGE_SHIFT)
		return VM_FAULT_SIGBUS;
	if (!p2phub_nvme_mmio_lock(h, true))
		return VM_FAULT_SIGBUS;
	ret = vmf_insert_pfn(vma, vmf->address, h->bar0_pfn + pgoff);
	mutex_unlock(&h->mmio_lock);
	return ret;
}

static const struct vm_operations_struct p2phub_nvme_bar0_vm_ops = {
	.fault	= p2phub_nvme_bar0_fault,
};

static void p2phub_nvme_vma_open(struct vm_area_struct *vma)
{
	struct p2phub_nvme_buf *b = vma->vm_private_data;

	atomic_inc(&b->maps);
}

static void p2phub_nvme_vma_close(struct vm_area_struct *vma)
{
	struct p2phub_nvme_buf *b = vma->vm_private_data;

	atomic_dec(&b->maps);
}

static vm_fault_t p2phub_nvme_buf_fault(struct vm_fault *vmf)
{
	struct vm_area_struct *vma = vmf->vma;
	struct p2phub_nvme_handle *h = vma->vm_file->private_data;
	struct p2phub_nvme_buf *b = vma->vm_private_data;
	/* From vm_pgoff, which a partial munmap of the front moves on. */
	unsigned long pgoff = vmf->pgoff -
			      (P2PHUB_NVME_MMAP_DMA(b->id) >> PAGE_SHIFT);
	vm_fault_t ret = VM_FAULT_SIGBUS;

	if (!p2phub_nvme_mmio_lock(h, false))
		return VM_FAULT_SIGBUS;
	if (b->pages && pgoff < b->size >> PAGE_SHIFT)
		ret = vmf_insert_pfn(vma, vmf->address,
				     page_to_pfn(b->pages[pgoff]));
	mutex_unlock(&h->mmio_lock);
	return ret;
}

static const struct vm_operations_struct p2phub_nvme_buf_vm_ops = {
	.open	= p2phub_nvme_vma_open,
	.close	= p2phub_nvme_vma_close,
	.fault	= p2phub_nvme_buf_fault,
};

/*
 * Filled at fault time (see p2phub_nvme_zap()); this fd's inode is its own,
 * so its mapping holds only this owner's VMAs.
 */
static int p2phub_nvme_mmap_faulted(struct p2phub_nvme_handle *h,
				    struct vm_area_struct *vma,
				    const struct vm_operations_struct *ops)
{
	mutex_lock(&h->mmio_lock);
	if (h->mmio_gone) {
		mutex_unlock(&h->mmio_lock);
		return h->gone ?: -ENODEV;
	}
	h->mapping = vma->vm_file->f_mapping;
	mutex_unlock(&h->mmio_lock);
	p2phub_vm_flags_set(vma, VM_IO | VM_PFNMAP | VM_DONTEXPAND | VM_DONTDUMP);
	vma->vm_ops = ops;
	return 0;
}

/*
 * Registers and doorbells only: never the MSI-X table or PBA (the vectors
 * the kernel programmed), never past the BAR's end.
 */
static int p2phub_nvme_mmap_bar0(struct p2phub_nvme_handle *h,
				 struct vm_area_struct *vma, size_t len)
{
	if (len > h->bar0_mmap_len)
		return -EINVAL;
	if (READ_ONCE(h->status->state) & P2PHUB_NVME_ST_REMOVING)
		return -ENODEV;
	vma->vm_page_prot = pgprot_noncached(vma->vm_page_prot);
	return p2phub_nvme_mmap_faulted(h, vma, &p2phub_nvme_bar0_vm_ops);
}

int p2phub_nvme_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct p2phub_nvme_handle *h = file->private_data;
	size_t len = vma->vm_end - vma->vm_start;
	struct p2phub_nvme_buf *b;
	u64 off;
	int ret;

	if (!(vma->vm_flags & VM_SHARED))
		return -EINVAL;
	if (check_shl_overflow((u64)vma->vm_pgoff, PAGE_SHIFT, &off))
		return -EINVAL;
	if (off == P2PHUB_NVME_MMAP_BAR0)
		return p2phub_nvme_mmap_bar0(h, vma, len);
	if (off == P2PHUB_NVME_MMAP_STATUS) {
		/* Read-only: the kernel's word on revocations and requests. */
		if (len != PAGE_SIZE || (vma->vm_flags & VM_WRITE))
			return -EINVAL;
		p2phub_vm_flags_clear(vma, VM_MAYWRITE);
		return remap_pfn_range(vma, vma->vm_start,
				       virt_to_phys(h->status) >> PAGE_SHIFT,
				       PAGE_SIZE, vma->vm_page_prot);
	}
	if (off & ((1ULL << P2PHUB_NVME_MMAP_DMA_SHIFT) - 1) ||
	    off >> P2PHUB_NVME_MMAP_DMA_SHIFT > P2PHUB_NVME_DMA_MAX_BUFS)
		return -EINVAL;

	ret = p2phub_nvme_lock_live(h);
	if (ret)
		return ret;
	b = xa_load(&h->bufs, (off >> P2PHUB_NVME_MMAP_DMA_SHIFT) - 1);
	if (!b || !b->cpu || len > b->size) {
		ret = -EINVAL;
		goto out_unlock;
	}
	ret = p2phub_nvme_mmap_faulted(h, vma, &p2phub_nvme_buf_vm_ops);
	if (ret)
		goto out_unlock;
	vma->vm_private_data = b;
	p2phub_nvme_vma_open(vma);
out_unlock:
	mutex_unlock(&h->lock);
	return ret;
}
