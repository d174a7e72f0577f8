// SPDX-License-Identifier: GPL-2.0-only
/*
 * NVMe controller ownership: the controller fd and its ioctls.
 *
 * The fd is the ledger of everything one owner holds: DMA buffers, MSI-X
 * relays, the registrations the controller may DMA to. Its release stops
 * the controller before a byte of that memory goes back.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/build_bug.h>
#include <linux/dma-mapping.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/io.h>
#include <linux/mm.h>
#include <linux/overflow.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/xarray.h>

#include "compat.h"
#include "p2phub_iommu.h"
#include "p2phub_priv.h"
#include "p2phub_nvme.h"

static_assert(sizeof(struct p2phub_nvme_open) == 48);
static_assert(offsetof(struct p2phub_nvme_open, out_nr_irqs) == 16);
static_assert(offsetof(struct p2phub_nvme_open, out_bar0_size) == 24);
static_assert(sizeof(struct p2phub_nvme_dma_alloc) == 56);
static_assert(offsetof(struct p2phub_nvme_dma_alloc, out_id) == 32);
static_assert(sizeof(struct p2phub_nvme_dma_free) == 24);
static_assert(sizeof(struct p2phub_nvme_irq_set) == 24);
static_assert(offsetof(struct p2phub_nvme_open, out_bar0_mmap_size) == 32);
static_assert(sizeof(struct p2phub_nvme_map_reg) == 80);
static_assert(offsetof(struct p2phub_nvme_map_reg, out_total) == 40);
static_assert(offsetof(struct p2phub_nvme_map_reg, out_slot) == 56);
static_assert(sizeof(struct p2phub_nvme_unmap_reg) == 24);
static_assert(sizeof(struct p2phub_nvme_resume) == 16);
static_assert(sizeof(struct p2phub_nvme_req_set) == 24);
static_assert(sizeof(struct p2phub_nvme_status) <= PAGE_SIZE);

/* p2phub_reg_user.stop_dma: the registration is being revoked. */
static void p2phub_nvme_stop_dma(struct p2phub_reg_user *u)
{
	struct p2phub_nvme_regmap *rm =
		container_of(u, struct p2phub_nvme_regmap, user);
	struct p2phub_nvme_handle *h = rm->h;
	unsigned long flags;

	spin_lock_irqsave(&h->status_lock, flags);
	rm->revoked = true;
	WRITE_ONCE(h->status->reg_gen[rm->slot], 0);
	spin_unlock_irqrestore(&h->status_lock, flags);
	p2phub_nvme_signal(h, P2PHUB_NVME_ST_FENCED, true);
}

/*
 * Give a buffer's DMA memory back. Caller holds h->lock, and no user
 * mapping of it is left or can fault it in again (b->maps is 0, or
 * p2phub_nvme_zap() made it gone).
 */
static void p2phub_nvme_buf_free_mem(struct p2phub_nvme_handle *h,
				     struct p2phub_nvme_buf *b)
{
	lockdep_assert_held(&h->lock);
	if (!b->cpu)
		return;
	dma_free_coherent(&h->pdev->dev, b->size, b->cpu, b->dma);
	b->cpu = NULL;
	kvfree(b->pages);
	b->pages = NULL;
	h->dma_bytes -= b->size;
	atomic_dec(&p2phub_nvme_live_bufs);
}

static void p2phub_nvme_buf_free(struct p2phub_nvme_handle *h,
				 struct p2phub_nvme_buf *b)
{
	p2phub_nvme_buf_free_mem(h, b);
	kfree(b);
}

/* Caller holds h->lock; the controller no longer uses rm's memory. */
static void p2phub_nvme_regmap_drop(struct p2phub_nvme_handle *h,
				    struct p2phub_nvme_regmap *rm)
{
	lockdep_assert_held(&h->lock);
	p2phub_reg_user_del(rm->reg, &rm->user);
	/* No address of it stays reachable by the controller. */
	p2phub_reg_dma_pages_put(rm->reg, &rm->list, true);
	WRITE_ONCE(h->status->reg_gen[rm->slot], 0);
	clear_bit(rm->slot, h->slots);
	p2phub_reg_put(rm->reg);
	kfree(rm);
}

void p2phub_nvme_handle_free(struct p2phub_nvme_handle *h)
{
	struct p2phub_nvme_buf *b;
	unsigned long id;

	/* Only structs are left: the memory went when the controller did. */
	xa_for_each(&h->bufs, id, b)
		kfree(b);
	mutex_destroy(&h->mmio_lock);
	if (h->req_trigger)
		eventfd_ctx_put(h->req_trigger);
	free_page((unsigned long)h->status);
	xa_destroy(&h->regmaps);
	xa_destroy(&h->bufs);
	mutex_destroy(&h->lock);
	kfree(h);
}

/*
 * Everything the owner holds goes, the controller first: stop it (no VMA
 * may reach BAR0 or the DMA buffers any more, so the owner cannot start it
 * again), then free its interrupts, unmap its registrations, free its DMA
 * memory and flush the IOTLB. Caller holds h->lock; !h->detached, so ctrl's
 * registers and vectors are still there.
 */
void p2phub_nvme_drop_all(struct p2phub_nvme_handle *h)
{
	struct p2phub_nvme_ctrl *ctrl = h->ctrl;
	struct p2phub_nvme_regmap *rm;
	struct p2phub_nvme_buf *b;
	unsigned long id;
	int i;

	lockdep_assert_held(&h->lock);
	p2phub_nvme_zap(h, false, true);
	p2phub_nvme_quiesce(ctrl);
	for (i = 0; i < ctrl->nr_irqs; i++)
		p2phub_nvme_irq_detach(h, &ctrl->irqs[i]);
	xa_for_each(&h->regmaps, id, rm) {
		xa_erase(&h->regmaps, id);
		p2phub_nvme_regmap_drop(h, rm);
	}
	xa_for_each(&h->bufs, id, b)
		p2phub_nvme_buf_free_mem(h, b);
	/* A lazily flushing domain must forget those addresses now. */
	p2phub_flush_iotlb(&h->pdev->dev);
	h->detached = true;
}

static int p2phub_nvme_release(struct inode *inode, struct file *file)
{
	struct p2phub_nvme_handle *h = file->private_data;
	struct p2phub_nvme_ctrl *ctrl = h->ctrl;
	struct pci_dev *pdev = h->pdev;
	struct file *pfile = h->pfile;
	bool was_owner, reset;

	/*
	 * No VMA is left (each holds the file), so only the device can still
	 * touch the buffers and the registrations it holds: stop it first,
	 * unless the kernel already took it back.
	 */
	mutex_lock(&h->lock);
	was_owner = !h->detached;
	if (was_owner)
		p2phub_nvme_drop_all(h);
	mutex_unlock(&h->lock);

	if (was_owner) {
		/* Stopped and holding no memory: clear what this owner left. */
		reset = p2phub_nvme_reset_function(ctrl, h);
		/* Hand the controller back; remove() may be waiting for this. */
		mutex_lock(&ctrl->lock);
		if (ctrl->owner == h) {
			p2phub_nvme_group_unclaim(ctrl);
			ctrl->reset_due = !reset;
			ctrl->owner = NULL;
			complete_all(&ctrl->released);
		}
		mutex_unlock(&ctrl->lock);
	}

	p2phub_nvme_handle_free(h);
	p2phub_nvme_ctrl_put(ctrl);
	pci_dev_put(pdev);
	atomic_dec(&p2phub_nvme_live_handles);
	/* Last: the registrations of that file may go now. */
	fput(pfile);
	return 0;
}

/*
 * The pages behind a DMA buffer, for the owner's faults: user mappings are
 * filled page by page under mmio_lock, so that they can be zapped for good
 * before the memory goes.
 */
static int p2phub_nvme_buf_pages(struct p2phub_nvme_handle *h,
				 struct p2phub_nvme_buf *b)
{
	size_t n = b->size >> PAGE_SHIFT, i = 0;
	struct sg_page_iter piter;
	struct sg_table sgt;
	int ret;

	b->pages = kvcalloc(n, sizeof(*b->pages), GFP_KERNEL_ACCOUNT);
	if (!b->pages)
		return -ENOMEM;
	ret = dma_get_sgtable(&h->pdev->dev, &sgt, b->cpu, b->dma, b->size);
	if (ret)
		goto err_free;
	for_each_sgtable_page(&sgt, &piter, 0) {
		if (i == n)
			break;
		b->pages[i++] = sg_page_iter_page(&piter);
	}
	sg_free_table(&sgt);
	if (i != n) {
		ret = -EIO;
		goto err_free;
	}
	return 0;

err_free:
	kvfree(b->pages);
	b->pages = NULL;
	return ret;
}

static long p2phub_nvme_ioctl_dma_alloc(struct p2phub_nvme_handle *h,
					void __user *uarg)
{
	struct p2phub_nvme_dma_alloc arg;
	struct p2phub_nvme_buf *b;
	u64 total;
	u32 id;
	int ret;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (arg.__reserved || !p2phub_all_zero(arg.reserved, sizeof(arg.reserved)) ||
	    !p2phub_outputs_zero(&arg, out_dma_addr, out_id))
		return -EINVAL;
	if (!arg.size || !PAGE_ALIGNED(arg.size) ||
	    arg.size > P2PHUB_NVME_DMA_MAX_BUF)
		return -EINVAL;

	b = kzalloc(sizeof(*b), GFP_KERNEL_ACCOUNT);
	if (!b)
		return -ENOMEM;
	b->size = arg.size;

	ret = p2phub_nvme_lock_live(h);
	if (ret)
		goto err_free;
	if (check_add_overflow(h->dma_bytes, (u64)arg.size, &total) ||
	    total > P2PHUB_NVME_DMA_MAX_TOTAL) {
		ret = -ENOSPC;
		goto err_unlock;
	}
	b->cpu = dma_alloc_coherent(&h->pdev->dev, b->size, &b->dma,
				    GFP_KERNEL);
	if (!b->cpu) {
		ret = -ENOMEM;
		goto err_unlock;
	}
	ret = p2phub_nvme_buf_pages(h, b);
	if (ret)
		goto err_free_dma;
	ret = xa_alloc(&h->bufs, &id, b,
		       XA_LIMIT(0, P2PHUB_NVME_DMA_MAX_BUFS - 1), GFP_KERNEL_ACCOUNT);
	if (ret)
		goto err_free_dma;
	b->id = id;
	h->dma_bytes = total;
	atomic_inc(&p2phub_nvme_live_bufs);
	mutex_unlock(&h->lock);

	arg.argsz = sizeof(arg);
	arg.out_dma_addr = b->dma;
	arg.out_mmap_offset = P2PHUB_NVME_MMAP_DMA(id);
	arg.out_id = id;
	if (copy_to_user(uarg, &arg, sizeof(arg)))
		return -EFAULT;	/* the buffer stays in the ledger until close */
	return 0;

err_free_dma:
	kvfree(b->pages);
	dma_free_coherent(&h->pdev->dev, b->size, b->cpu, b->dma);
err_unlock:
	mutex_unlock(&h->lock);
err_free:
	kfree(b);
	if (ret == -ENOMEM || ret == -ENOSPC)
		dev_info_ratelimited(&h->pdev->dev,
				     "DMA buffer of %llu bytes refused (%d); %llu bytes held\n",
				     arg.size, ret, h->dma_bytes);
	return ret;
}

/*
 * Bus mastering off for a while, under status_lock like every other change
 * of it; returns whether it was on. Caller holds h->lock, so RESUME cannot
 * turn it on meanwhile.
 */
static bool p2phub_nvme_master_pause(struct p2phub_nvme_handle *h)
{
	unsigned long flags;
	bool was;

	lockdep_assert_held(&h->lock);
	spin_lock_irqsave(&h->status_lock, flags);
	was = h->pdev->is_busmaster;
	if (was)
		pci_clear_master(h->pdev);
	spin_unlock_irqrestore(&h->status_lock, flags);
	return was;
}

/*
 * Bus mastering back on if it was, unless the controller was fenced or
 * taken back meanwhile (those turn it off for good, until RESUME).
 */
static void p2phub_nvme_master_unpause(struct p2phub_nvme_handle *h, bool was)
{
	const u32 stopped = P2PHUB_NVME_ST_FENCED | P2PHUB_NVME_ST_ERROR |
			    P2PHUB_NVME_ST_REMOVING | P2PHUB_NVME_ST_REVOKED;
	unsigned long flags;

	lockdep_assert_held(&h->lock);
	if (!was)
		return;
	spin_lock_irqsave(&h->status_lock, flags);
	if (!(h->status->state & stopped))
		pci_set_master(h->pdev);
	spin_unlock_irqrestore(&h->status_lock, flags);
}

static long p2phub_nvme_ioctl_dma_free(struct p2phub_nvme_handle *h,
				       void __user *uarg)
{
	struct p2phub_nvme_dma_free arg;
	struct p2phub_nvme_buf *b;
	u32 cc, csts;
	bool master;
	int ret;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (arg.__reserved || !p2phub_all_zero(arg.reserved, sizeof(arg.reserved)))
		return -EINVAL;

	ret = p2phub_nvme_lock_live(h);
	if (ret)
		return ret;
	b = xa_load(&h->bufs, arg.id);
	if (!b) {
		ret = -ENOENT;
		goto out_unlock;
	}
	/*
	 * The controller cannot DMA from here until the IOTLB forgets the
	 * buffer: a lazily flushing domain frees the pages at unmap and
	 * flushes later, and the owner may enable the controller again at
	 * any time. The registers are read only now, so an enable that came
	 * before is seen below, and one that comes after finds no bus
	 * mastering until the flush is done.
	 */
	master = p2phub_nvme_master_pause(h);
	/*
	 * An enabled controller, or one still ready after CC.EN went 0 (its
	 * shutdown not done), may still hold this buffer's address in a
	 * queue or PRP list; a mapped buffer is still in the owner's hands.
	 */
	cc = readl(h->ctrl->regs + NVME_REG_CC);
	csts = readl(h->ctrl->regs + NVME_REG_CSTS);
	if (atomic_read(&b->maps) ||
	    (cc != U32_MAX && (cc & NVME_CC_EN)) ||
	    (csts != U32_MAX && (csts & NVME_CSTS_RDY))) {
		ret = -EBUSY;
		goto out_unpause;
	}
	xa_erase(&h->bufs, arg.id);
	p2phub_nvme_buf_free(h, b);
	p2phub_flush_iotlb(&h->pdev->dev);
	ret = 0;
out_unpause:
	p2phub_nvme_master_unpause(h, master);
out_unlock:
	mutex_unlock(&h->lock);
	return ret;
}

/* Caller holds h->lock. Hold registration @handle for the controller. */
static struct p2phub_nvme_regmap *
p2phub_nvme_regmap_add(struct p2phub_nvme_handle *h, u64 handle)
{
	struct p2phub_nvme_regmap *rm;
	struct p2phub_reg *reg;
	unsigned long slot;
	int ret;

	lockdep_assert_held(&h->lock);
	slot = find_first_zero_bit(h->slots, P2PHUB_NVME_MAX_MAPS);
	if (slot >= P2PHUB_NVME_MAX_MAPS)
		return ERR_PTR(-ENOSPC);
	reg = p2phub_reg_get(h->pfile->private_data, handle);
	if (IS_ERR(reg))
		return ERR_CAST(reg);
	rm = kzalloc(sizeof(*rm), GFP_KERNEL_ACCOUNT);
	if (!rm) {
		ret = -ENOMEM;
		goto err_put_reg;
	}
	rm->h = h;
	rm->reg = reg;
	rm->slot = slot;
	INIT_LIST_HEAD(&rm->user.node);
	rm->user.stop_dma = p2phub_nvme_stop_dma;
	ret = p2phub_reg_dma_pages(reg, h->pdev, &rm->list);
	if (ret)
		goto err_free_rm;
	/*
	 * Publish the generation before the hold: a revocation after the
	 * hold clears the word again, one before it fails the hold.
	 */
	WRITE_ONCE(h->status->reg_gen[slot], rm->list.generation);
	ret = p2phub_reg_user_add(reg, &rm->user, rm->list.generation);
	if (ret)
		goto err_clear_slot;
	ret = xa_insert(&h->regmaps, handle, rm, GFP_KERNEL_ACCOUNT);
	if (ret)
		goto err_user_del;
	set_bit(slot, h->slots);
	return rm;

err_user_del:
	p2phub_reg_user_del(reg, &rm->user);
err_clear_slot:
	WRITE_ONCE(h->status->reg_gen[slot], 0);
	p2phub_reg_dma_pages_put(reg, &rm->list, true);
err_free_rm:
	kfree(rm);
err_put_reg:
	p2phub_reg_put(reg);
	return ERR_PTR(ret);
}

static long p2phub_nvme_ioctl_map_reg(struct p2phub_nvme_handle *h,
				      void __user *uarg)
{
	struct p2phub_nvme_map_reg arg;
	struct p2phub_nvme_regmap *rm;
	struct p2phub_dma_list list;
	struct p2phub_reg *reg;
	u64 total;
	u32 slot;
	int ret;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (arg.__reserved || arg.out_total || arg.out_generation ||
	    arg.out_slot || !p2phub_all_zero(arg.reserved, sizeof(arg.reserved)))
		return -EINVAL;
	if (!arg.handle || arg.handle > U32_MAX)
		return -ENOENT;

	ret = p2phub_nvme_lock_live(h);
	if (ret)
		return ret;
	if (READ_ONCE(h->status->state) &
	    (P2PHUB_NVME_ST_FENCED | P2PHUB_NVME_ST_REMOVING)) {
		ret = -EIO;
		goto out_unlock;
	}
	rm = xa_load(&h->regmaps, arg.handle);
	if (!rm) {
		rm = p2phub_nvme_regmap_add(h, arg.handle);
		if (IS_ERR(rm)) {
			ret = PTR_ERR(rm);
			goto out_unlock;
		}
	}
	/*
	 * The copy to user space may fault (mmap_lock), and the controller
	 * fd's mmap takes h->lock under mmap_lock: copy without h->lock,
	 * under a reference and an I/O hold of our own.
	 */
	reg = rm->reg;
	list = rm->list;
	slot = rm->slot;
	ret = p2phub_reg_io_begin(reg, list.generation);
	if (ret)
		goto out_unlock;
	p2phub_reg_get_ref(reg);
	/* A racing UNMAP_REG unmaps when this hold goes. */
	p2phub_reg_dma_pages_hold(reg, &list);
	mutex_unlock(&h->lock);
	ret = p2phub_reg_copy_dma_pages(reg, &list, arg.page_size, arg.first,
					arg.count, u64_to_user_ptr(arg.addrs),
					&total);
	if (!ret && !p2phub_reg_live(reg, list.generation))
		ret = -ESTALE;
	p2phub_reg_io_end(reg);
	p2phub_reg_dma_pages_put(reg, &list, true);
	p2phub_reg_put(reg);
	if (ret)
		return ret;
	arg.count = arg.count ? min_t(u64, arg.count, total - arg.first) : 0;
	arg.out_total = total;
	arg.out_generation = list.generation;
	arg.out_slot = slot;
	goto out_copy;
out_unlock:
	mutex_unlock(&h->lock);
out_copy:
	if (!ret && copy_to_user(uarg, &arg, sizeof(arg)))
		ret = -EFAULT;
	return ret;
}

static long p2phub_nvme_ioctl_unmap_reg(struct p2phub_nvme_handle *h,
					void __user *uarg)
{
	struct p2phub_nvme_unmap_reg arg;
	struct p2phub_nvme_regmap *rm;
	int ret;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (!p2phub_all_zero(arg.reserved, sizeof(arg.reserved)))
		return -EINVAL;
	if (!arg.handle || arg.handle > U32_MAX)
		return -ENOENT;

	ret = p2phub_nvme_lock_live(h);
	if (ret)
		return ret;
	rm = xa_erase(&h->regmaps, arg.handle);
	if (rm) {
		p2phub_nvme_regmap_drop(h, rm);
		p2phub_flush_iotlb(&h->pdev->dev);
	}
	ret = rm ? 0 : -ENOENT;
	mutex_unlock(&h->lock);
	return ret;
}

static long p2phub_nvme_ioctl_resume(struct p2phub_nvme_handle *h,
				     void __user *uarg)
{
	struct p2phub_nvme_ctrl *ctrl = h->ctrl;
	struct p2phub_nvme_resume arg;
	struct p2phub_nvme_regmap *rm;
	unsigned long id, flags;
	u32 cc, csts;
	int ret;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (!p2phub_all_zero(arg.reserved, sizeof(arg.reserved)))
		return -EINVAL;

	/*
	 * Bus mastering goes on only under the device lock, which the reset
	 * paths (reset_prepare .. reset_done), the PCI error callbacks and
	 * remove() hold: none of them can be undone by this.
	 */
	ret = device_lock_interruptible(&h->pdev->dev);
	if (ret)
		return ret;
	ret = p2phub_nvme_lock_live(h);
	if (ret)
		goto out_unlock_dev;
	/* The error state stays until the PCI core's recovery is over. */
	if (ctrl->in_recovery) {
		ret = -EBUSY;
		goto out_unlock_h;
	}
	/*
	 * A revoked registration whose export importers are not done yet is
	 * still mapped for this device: its addresses would reach memory the
	 * exporter may reuse.
	 */
	if (p2phub_reg_dev_revoked_mapped(h->pdev)) {
		ret = -EBUSY;
		goto out_unlock_h;
	}
	/* Nothing unmapped while fenced stays in a lazily flushed IOTLB. */
	p2phub_flush_iotlb(&h->pdev->dev);
	spin_lock_irqsave(&h->status_lock, flags);
	cc = readl(ctrl->regs + NVME_REG_CC);
	csts = readl(ctrl->regs + NVME_REG_CSTS);
	if (h->status->state & P2PHUB_NVME_ST_REMOVING ||
	    cc == U32_MAX || csts == U32_MAX) {
		ret = -ENODEV;
		goto out_unlock;
	}
	if ((cc & NVME_CC_EN) || (csts & NVME_CSTS_RDY)) {
		ret = -EBUSY;
		goto out_unlock;
	}
	/* Revoked memory must be let go first: nothing may reach it again. */
	xa_for_each(&h->regmaps, id, rm) {
		if (rm->revoked) {
			ret = -EBUSY;
			goto out_unlock;
		}
	}
	pci_set_master(h->pdev);
	WRITE_ONCE(h->status->state, h->status->state &
		   ~(P2PHUB_NVME_ST_FENCED | P2PHUB_NVME_ST_ERROR));
	WRITE_ONCE(h->status->events, h->status->events + 1);
out_unlock:
	spin_unlock_irqrestore(&h->status_lock, flags);
out_unlock_h:
	mutex_unlock(&h->lock);
out_unlock_dev:
	device_unlock(&h->pdev->dev);
	return ret;
}

static long p2phub_nvme_handle_ioctl(struct file *file, unsigned int cmd,
				     unsigned long arg)
{
	struct p2phub_nvme_handle *h = file->private_data;
	void __user *uarg = (void __user *)arg;

	switch (cmd) {
	case P2PHUB_NVME_MAP_REG:
		return p2phub_nvme_ioctl_map_reg(h, uarg);
	case P2PHUB_NVME_UNMAP_REG:
		return p2phub_nvme_ioctl_unmap_reg(h, uarg);
	case P2PHUB_NVME_RESUME:
		return p2phub_nvme_ioctl_resume(h, uarg);
	case P2PHUB_NVME_REQ_SET:
		return p2phub_nvme_ioctl_req_set(h, uarg);
	case P2PHUB_NVME_DMA_ALLOC:
		return p2phub_nvme_ioctl_dma_alloc(h, uarg);
	case P2PHUB_NVME_DMA_FREE:
		return p2phub_nvme_ioctl_dma_free(h, uarg);
	case P2PHUB_NVME_IRQ_SET:
		return p2phub_nvme_ioctl_irq_set(h, uarg);
	default:
		return -ENOTTY;
	}
}

const struct file_operations p2phub_nvme_handle_fops = {
	.owner		= THIS_MODULE,
	.release	= p2phub_nvme_release,
	.unlocked_ioctl	= p2phub_nvme_handle_ioctl,
	.compat_ioctl	= compat_ptr_ioctl,
	.mmap		= p2phub_nvme_mmap,
	.llseek		= noop_llseek,
};
