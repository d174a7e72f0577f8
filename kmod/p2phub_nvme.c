// SPDX-License-Identifier: GPL-2.0-only
/*
 * NVMe controller ownership for the user-space queue engine.
 *
 * p2phub.ko speaks no NVMe. It registers a PCI driver, "p2phub-nvme", with
 * no id table: a controller reaches it only when user space sets the
 * device's driver_override to that name and binds it (after checking that no
 * namespace is mounted or held; see p2phub/nvme/bind.py). The driver then
 * owns the privileged parts and nothing else:
 *
 *   - BAR0, mapped uncached into the owner for the doorbells and registers;
 *   - DMA-coherent memory for submission/completion queues, PRP lists and
 *     bounce buffers, mapped into the owner, with its bus address reported;
 *   - MSI-X vectors, each relayed to an eventfd of the owner's choosing.
 *
 * P2PHUB_NVME_OPEN on /dev/p2phub hands the caller a controller fd; at most
 * one fd owns a controller at a time. Everything hangs off that fd and is
 * released when it goes (close or process death): the controller is
 * disabled (CC.EN = 0, then bus mastering off) before a byte of its DMA
 * memory is freed, so a controller left running by a crashed process cannot
 * write into pages the kernel has reused.
 *
 * The kernel can also take a controller back from a live owner: when unbind
 * or hot removal has waited remove_grace_ms for the owner to close its fd,
 * and when a device of the controller's IOMMU group gets a kernel driver
 * (that driver's DMA mappings would share the controller's IOMMU domain).
 * Then the controller's DMA is stopped, its registrations unmapped, its
 * interrupts and DMA memory freed and every user mapping of BAR0 and of the
 * DMA buffers zapped; the fd stays open, and its ioctls fail (-ENODEV after
 * removal, -EXDEV when the group lost its confinement).
 *
 * User mappings of BAR0 and of DMA buffers are filled at fault time, under
 * p2phub_nvme_handle.mmio_lock, so that zapping them (a reset, a PCI error,
 * the kernel taking the controller back) cannot miss a mapping still being
 * set up; each controller fd has an inode of its own for that.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/anon_inodes.h>
#include <linux/build_bug.h>
#include <linux/capability.h>
#include <linux/completion.h>
#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/dma-mapping.h>
#include <linux/eventfd.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/interrupt.h>
#include <linux/io.h>
#include <linux/iommu.h>
#include <linux/io-64-nonatomic-lo-hi.h>
#include <linux/jiffies.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/overflow.h>
#include <linux/pci.h>
#include <linux/security.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/version.h>
#include <linux/wait.h>
#include <linux/xarray.h>

#include "compat.h"
#include "p2phub_priv.h"

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

static bool allow_unsafe_noiommu;
module_param(allow_unsafe_noiommu, bool, 0644);
MODULE_PARM_DESC(allow_unsafe_noiommu,
		 "Let user space own NVMe controllers that no IOMMU confines (their owner can then DMA to any memory); taints the kernel when used");

static unsigned int remove_grace_ms = 10000;
module_param(remove_grace_ms, uint, 0644);
MODULE_PARM_DESC(remove_grace_ms,
		 "How long unbind or removal of an owned NVMe controller waits for its owner to close the controller fd before the kernel takes the controller back (ms, default 10000)");

/*
 * eventfd_signal() lost its count argument in v6.8 (commit 3652117f8548,
 * "eventfd: simplify eventfd_signal()").
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 8, 0)
#define p2phub_eventfd_signal(ctx)	eventfd_signal(ctx)
#else
#define p2phub_eventfd_signal(ctx)	eventfd_signal(ctx, 1)
#endif

/* NVMe controller registers the kernel itself touches (disable on release). */
#define NVME_REG_CAP	0x00
#define NVME_REG_CC	0x14
#define NVME_REG_CSTS	0x1c
#define NVME_CC_EN	(1U << 0)
#define NVME_CSTS_RDY	(1U << 0)

#define P2PHUB_NVME_DRV_NAME	"p2phub-nvme"
/* Upper bound on waiting for CSTS.RDY to drop, whatever CAP.TO claims. */
#define P2PHUB_NVME_DISABLE_MAX_MS	30000

struct p2phub_nvme_handle;

/* One MSI-X vector relayed to an eventfd. */
struct p2phub_nvme_irq {
	struct eventfd_ctx *trigger;	/* NULL when detached */
	struct p2phub_nvme_ctrl *ctrl;
	unsigned int vector;
	char name[32];
};

/*
 * A controller bound to p2phub-nvme; drvdata of its pci_dev. Counted: the
 * binding holds one reference and each controller fd one, so a fd the
 * kernel took the controller back from can still look at it; what remove()
 * tears down (regs, vectors, regions) is used only by the owner.
 */
struct p2phub_nvme_ctrl {
	struct kref ref;
	struct pci_dev *pdev;
	struct iommu_group *group;	/* NULL without an IOMMU; held */
	struct list_head node;		/* p2phub_nvme_ctrls */
	void __iomem *regs;		/* kernel view of BAR0, for disable */
	resource_size_t bar0_len;
	resource_size_t bar0_mmap_len;	/* up to the MSI-X table / PBA page */
	int nr_irqs;
	struct p2phub_nvme_irq *irqs;	/* nr_irqs entries */
	struct mutex lock;		/* owner, dying */
	struct p2phub_nvme_handle *owner;
	bool dying;
	/* AER recovery under way: RESUME waits for its resume() (device lock). */
	bool in_recovery;
	/* Done while nobody owns the controller (remove() waits for it). */
	struct completion released;
};

/* One DMA-coherent allocation, owned by a handle. */
struct p2phub_nvme_buf {
	u32 id;
	size_t size;
	void *cpu;			/* NULL once freed under the owner */
	dma_addr_t dma;
	struct page **pages;		/* size / PAGE_SIZE, for user faults */
	atomic_t maps;			/* live user VMAs */
};

/* A registration the controller may DMA to (P2PHUB_NVME_MAP_REG). */
struct p2phub_nvme_regmap {
	struct p2phub_reg_user user;
	struct p2phub_nvme_handle *h;
	struct p2phub_reg *reg;		/* reference held */
	struct p2phub_dma_list list;	/* for the controller's pci_dev */
	u32 slot;			/* index in status->reg_gen */
	bool revoked;			/* under h->status_lock */
};

/* The controller fd: the ledger of everything one owner holds. */
struct p2phub_nvme_handle {
	struct p2phub_nvme_ctrl *ctrl;	/* reference held */
	struct pci_dev *pdev;		/* reference held */
	struct file *pfile;		/* /dev/p2phub of NVME_OPEN, held */
	unsigned long bar0_pfn;
	resource_size_t bar0_mmap_len;
	/*
	 * bufs, dma_bytes, irqs, regmaps, slots, detached, gone. Once
	 * detached, nothing of ctrl but its lock and owner is touched: the
	 * controller was handed back, or taken back by the kernel (gone is
	 * then the errno the fd's ioctls return).
	 */
	struct mutex lock;
	bool detached;
	int gone;
	/*
	 * User mappings: fault handlers fill them under mmio_lock; zapping
	 * sets mmio_blocked (a reset: faults wait) or mmio_gone (SIGBUS) first.
	 */
	struct mutex mmio_lock;
	struct address_space *mapping;	/* this fd's own inode's, once mmapped */
	bool mmio_blocked;
	bool mmio_gone;
	wait_queue_head_t mmio_wq;
	struct xarray bufs;		/* id -> struct p2phub_nvme_buf */
	u64 dma_bytes;
	struct xarray regmaps;		/* reg handle -> struct p2phub_nvme_regmap */
	DECLARE_BITMAP(slots, P2PHUB_NVME_MAX_MAPS);
	/*
	 * status_lock protects status->state and ->events, the regmaps'
	 * revoked flags, bus mastering and req_trigger. It is taken inside
	 * p2phub_reg.state_lock (stop_dma) and p2phub_nvme_ctrl.lock.
	 */
	spinlock_t status_lock;
	struct p2phub_nvme_status *status;	/* a page, mmapped read-only */
	struct eventfd_ctx *req_trigger;
};

static struct pci_driver p2phub_nvme_driver;
/* Every bound controller: IOMMU group siblings of owned ones are watched. */
static DEFINE_MUTEX(p2phub_nvme_ctrls_lock);
static LIST_HEAD(p2phub_nvme_ctrls);
static struct dentry *p2phub_nvme_debugfs;
static atomic_t p2phub_nvme_live_bufs = ATOMIC_INIT(0);
static atomic_t p2phub_nvme_live_handles = ATOMIC_INIT(0);
static atomic_t p2phub_nvme_function_resets = ATOMIC_INIT(0);
static atomic_t p2phub_nvme_taken_back = ATOMIC_INIT(0);

static void p2phub_nvme_ctrl_free(struct kref *ref)
{
	struct p2phub_nvme_ctrl *ctrl =
		container_of(ref, struct p2phub_nvme_ctrl, ref);

	if (ctrl->group)
		iommu_group_put(ctrl->group);
	kfree(ctrl->irqs);
	mutex_destroy(&ctrl->lock);
	kfree(ctrl);
}

static void p2phub_nvme_ctrl_put(struct p2phub_nvme_ctrl *ctrl)
{
	kref_put(&ctrl->ref, p2phub_nvme_ctrl_free);
}

/* ------------------------------------------------------------ controller */

/*
 * Stop the controller from touching memory: clear CC.EN, wait for CSTS.RDY
 * to fall (bounded by CAP.TO), then turn bus mastering off, which stops DMA
 * even from a controller that ignored the disable.
 */
static void p2phub_nvme_quiesce(struct p2phub_nvme_ctrl *ctrl)
{
	struct pci_dev *pdev = ctrl->pdev;
	unsigned long deadline;
	u32 cc, csts, timeout_ms;
	u64 cap;

	cap = lo_hi_readq(ctrl->regs + NVME_REG_CAP);
	timeout_ms = min_t(u32, ((cap >> 24) & 0xff) * 500,
			   P2PHUB_NVME_DISABLE_MAX_MS);
	cc = readl(ctrl->regs + NVME_REG_CC);
	if (cc != U32_MAX && (cc & NVME_CC_EN)) {
		writel(cc & ~NVME_CC_EN, ctrl->regs + NVME_REG_CC);
		deadline = jiffies + msecs_to_jiffies(timeout_ms);
		for (;;) {
			csts = readl(ctrl->regs + NVME_REG_CSTS);
			if (csts == U32_MAX || !(csts & NVME_CSTS_RDY))
				break;
			if (time_after(jiffies, deadline)) {
				dev_warn_ratelimited(&pdev->dev,
						     "controller still ready %u ms after CC.EN=0; stopping its DMA by clearing bus master\n",
						     timeout_ms);
				break;
			}
			msleep(1);
		}
	}
	pci_clear_master(pdev);
}

/*
 * Tell the owner something through the status page and its request
 * eventfd; with @stop, turn bus mastering off first, which leaves the
 * controller unable to DMA once the (non-posted) config write completes.
 * Atomic context is fine.
 */
static void p2phub_nvme_signal(struct p2phub_nvme_handle *h, u32 bits,
			       bool stop)
{
	unsigned long flags;

	spin_lock_irqsave(&h->status_lock, flags);
	if (stop)
		pci_clear_master(h->pdev);
	WRITE_ONCE(h->status->state, h->status->state | bits);
	WRITE_ONCE(h->status->events, h->status->events + 1);
	if (h->req_trigger)
		p2phub_eventfd_signal(h->req_trigger);
	spin_unlock_irqrestore(&h->status_lock, flags);
}

/* Tell the controller's owner, if any; stop its DMA either way if asked. */
static void p2phub_nvme_request(struct p2phub_nvme_ctrl *ctrl, u32 bits,
				bool stop)
{
	mutex_lock(&ctrl->lock);
	if (ctrl->owner)
		p2phub_nvme_signal(ctrl->owner, bits, stop);
	else if (stop)
		pci_clear_master(ctrl->pdev);
	mutex_unlock(&ctrl->lock);
}

/*
 * Zap the owner's user mappings of BAR0 (and, once @gone, of its DMA
 * buffers). @block: until p2phub_nvme_mmio_unblock(), BAR0 faults wait (a
 * reset or PCI error recovery is under way); @gone: every later fault is
 * SIGBUS. Faults fill mappings under mmio_lock, so none set up before this
 * survives it and none after it sees the old state.
 */
static void p2phub_nvme_zap(struct p2phub_nvme_handle *h, bool block,
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
static void p2phub_nvme_owner_mmio(struct p2phub_nvme_ctrl *ctrl, bool block)
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

static irqreturn_t p2phub_nvme_irq_handler(int irq, void *data)
{
	struct p2phub_nvme_irq *v = data;

	p2phub_eventfd_signal(v->trigger);
	return IRQ_HANDLED;
}

/* Caller holds h->lock. */
static void p2phub_nvme_irq_detach(struct p2phub_nvme_handle *h,
				   struct p2phub_nvme_irq *v)
{
	lockdep_assert_held(&h->lock);
	if (!v->trigger)
		return;
	free_irq(pci_irq_vector(h->pdev, v->vector), v);
	eventfd_ctx_put(v->trigger);
	v->trigger = NULL;
}

/* ------------------------------------------------------------ handle fd */

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

/*
 * A lazily flushing domain (DMA-FQ) clears the page tables at unmap but
 * flushes the IOTLB later: make what was just unmapped for the controller
 * unreachable now, before the memory or the controller changes hands.
 */
static void p2phub_nvme_flush_iotlb(struct pci_dev *pdev)
{
	struct iommu_domain *domain = iommu_get_domain_for_dev(&pdev->dev);

	if (domain && (domain->type & __IOMMU_DOMAIN_PAGING))
		iommu_flush_iotlb_all(domain);
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

static void p2phub_nvme_handle_free(struct p2phub_nvme_handle *h)
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
static void p2phub_nvme_drop_all(struct p2phub_nvme_handle *h)
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
	p2phub_nvme_flush_iotlb(h->pdev);
	h->detached = true;
}

/*
 * The kernel takes the controller back from its live owner (@err: -ENODEV
 * the device is going away, -EXDEV its IOMMU group lost its confinement).
 * The fd stays open: its status page says REVOKED, its other mappings are
 * gone, its ioctls return @err. Caller holds ctrl->lock and ctrl->owner.
 */
static void p2phub_nvme_take_back(struct p2phub_nvme_ctrl *ctrl, int err)
{
	struct p2phub_nvme_handle *h = ctrl->owner;

	lockdep_assert_held(&ctrl->lock);
	/* DMA stops here (a non-posted config write), then the owner hears it. */
	p2phub_nvme_signal(h, P2PHUB_NVME_ST_REVOKED | P2PHUB_NVME_ST_REMOVING,
			   true);
	mutex_lock(&h->lock);
	if (!h->detached) {
		h->gone = err;
		p2phub_nvme_drop_all(h);
	}
	mutex_unlock(&h->lock);
	ctrl->owner = NULL;
	complete_all(&ctrl->released);
	atomic_inc(&p2phub_nvme_taken_back);
}

/*
 * Reset the function before the controller changes hands, as VFIO does: what
 * an owner left in it (features, host memory buffer settings, a security
 * state such as an unlocked Opal range) must not reach the next owner or the
 * kernel's nvme driver. Only a trylock of the device: remove() holds the
 * device lock while it waits for this release, and must not wait for us.
 * Under that lock the controller is still p2phub's and still @h's, or the
 * reset is not ours to do.
 */
static void p2phub_nvme_reset_function(struct p2phub_nvme_ctrl *ctrl,
				       struct p2phub_nvme_handle *h)
{
	struct pci_dev *pdev = ctrl->pdev;
	bool ours;
	int ret;

	if (!device_trylock(&pdev->dev)) {
		pci_info_ratelimited(pdev, "no function reset before the next owner (device busy): controller state carries over\n");
		return;
	}
	mutex_lock(&ctrl->lock);
	ours = pdev->dev.driver == &p2phub_nvme_driver.driver &&
	       pci_get_drvdata(pdev) == ctrl && ctrl->owner == h;
	mutex_unlock(&ctrl->lock);
	ret = ours ? pci_reset_function_locked(pdev) : 0;
	device_unlock(&pdev->dev);
	if (!ours)
		return;
	if (ret) {
		pci_info_ratelimited(pdev, "no function reset before the next owner (%d): controller state carries over\n",
				     ret);
		return;
	}
	atomic_inc(&p2phub_nvme_function_resets);
}

/*
 * The same with the device lock already held (OPEN). No reset_prepare or
 * reset_done runs: the controller has no owner-visible state yet.
 */
static void p2phub_nvme_reset_locked(struct p2phub_nvme_ctrl *ctrl)
{
	struct pci_dev *pdev = ctrl->pdev;
	int ret;

	device_lock_assert(&pdev->dev);
	pci_save_state(pdev);
	ret = __pci_reset_function_locked(pdev);
	pci_restore_state(pdev);
	if (ret) {
		pci_info_ratelimited(pdev, "no function reset for the new owner (%d): controller state carries over\n",
				     ret);
		return;
	}
	atomic_inc(&p2phub_nvme_function_resets);
}

static int p2phub_nvme_release(struct inode *inode, struct file *file)
{
	struct p2phub_nvme_handle *h = file->private_data;
	struct p2phub_nvme_ctrl *ctrl = h->ctrl;
	struct pci_dev *pdev = h->pdev;
	struct file *pfile = h->pfile;
	bool was_owner;

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
		p2phub_nvme_reset_function(ctrl, h);
		/* Hand the controller back; remove() may be waiting for this. */
		mutex_lock(&ctrl->lock);
		if (ctrl->owner == h) {
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

	mutex_lock(&h->lock);
	if (h->detached) {
		ret = h->gone;
		goto err_unlock;
	}
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
	kfree(b);
	if (ret == -ENOMEM || ret == -ENOSPC)
		dev_info_ratelimited(&h->pdev->dev,
				     "DMA buffer of %llu bytes refused (%d); %llu bytes held\n",
				     arg.size, ret, h->dma_bytes);
	return ret;
}

static long p2phub_nvme_ioctl_dma_free(struct p2phub_nvme_handle *h,
				       void __user *uarg)
{
	struct p2phub_nvme_dma_free arg;
	struct p2phub_nvme_buf *b;
	u32 cc, csts;
	int ret;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (arg.__reserved || !p2phub_all_zero(arg.reserved, sizeof(arg.reserved)))
		return -EINVAL;

	mutex_lock(&h->lock);
	if (h->detached) {
		ret = h->gone;
		goto out_unlock;
	}
	b = xa_load(&h->bufs, arg.id);
	if (!b) {
		ret = -ENOENT;
		goto out_unlock;
	}
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
		goto out_unlock;
	}
	xa_erase(&h->bufs, arg.id);
	p2phub_nvme_buf_free(h, b);
	ret = 0;
out_unlock:
	mutex_unlock(&h->lock);
	return ret;
}

static long p2phub_nvme_ioctl_irq_set(struct p2phub_nvme_handle *h,
				      void __user *uarg)
{
	struct p2phub_nvme_ctrl *ctrl = h->ctrl;
	struct p2phub_nvme_irq_set arg;
	struct eventfd_ctx *trigger;
	struct p2phub_nvme_irq *v;
	int ret;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (!p2phub_all_zero(arg.reserved, sizeof(arg.reserved)))
		return -EINVAL;
	if (arg.vector >= ctrl->nr_irqs)
		return -EINVAL;
	if (arg.eventfd < -1)
		return -EBADF;

	v = &ctrl->irqs[arg.vector];
	mutex_lock(&h->lock);
	if (h->detached) {
		ret = h->gone;
		goto out_unlock;
	}
	p2phub_nvme_irq_detach(h, v);
	if (arg.eventfd == -1) {
		ret = 0;
		goto out_unlock;
	}
	trigger = eventfd_ctx_fdget(arg.eventfd);
	if (IS_ERR(trigger)) {
		ret = PTR_ERR(trigger);
		goto out_unlock;
	}
	v->trigger = trigger;	/* the handler reads it; published before request_irq */
	ret = request_irq(pci_irq_vector(h->pdev, v->vector),
			  p2phub_nvme_irq_handler, 0, v->name, v);
	if (ret)
		goto err_put_trigger;
	mutex_unlock(&h->lock);
	return 0;

err_put_trigger:
	v->trigger = NULL;
	eventfd_ctx_put(trigger);
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

	mutex_lock(&h->lock);
	if (h->detached) {
		ret = h->gone;
		goto out_unlock;
	}
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

	mutex_lock(&h->lock);
	if (h->detached) {
		ret = h->gone;
		goto out_unlock;
	}
	rm = xa_erase(&h->regmaps, arg.handle);
	if (rm) {
		p2phub_nvme_regmap_drop(h, rm);
		p2phub_nvme_flush_iotlb(h->pdev);
	}
	ret = rm ? 0 : -ENOENT;
out_unlock:
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
	mutex_lock(&h->lock);
	if (h->detached) {
		ret = h->gone;
		goto out_unlock_dev;
	}
	/* The error state stays until the PCI core's recovery is over. */
	if (ctrl->in_recovery) {
		ret = -EBUSY;
		goto out_unlock_dev;
	}
	/*
	 * A revoked registration whose export importers are not done yet is
	 * still mapped for this device: its addresses would reach memory the
	 * exporter may reuse.
	 */
	if (p2phub_reg_dev_revoked_mapped(h->pdev)) {
		ret = -EBUSY;
		goto out_unlock_dev;
	}
	/* Nothing unmapped while fenced stays in a lazily flushed IOTLB. */
	p2phub_nvme_flush_iotlb(h->pdev);
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
out_unlock_dev:
	mutex_unlock(&h->lock);
	device_unlock(&h->pdev->dev);
	return ret;
}

static long p2phub_nvme_ioctl_req_set(struct p2phub_nvme_handle *h,
				      void __user *uarg)
{
	struct eventfd_ctx *trigger = NULL, *old;
	struct p2phub_nvme_req_set arg;
	unsigned long flags;
	int ret;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (arg.__reserved || !p2phub_all_zero(arg.reserved, sizeof(arg.reserved)))
		return -EINVAL;
	if (arg.eventfd != -1) {
		if (arg.eventfd < 0)
			return -EBADF;
		trigger = eventfd_ctx_fdget(arg.eventfd);
		if (IS_ERR(trigger))
			return PTR_ERR(trigger) == -EINVAL ? -EBADF :
			       PTR_ERR(trigger);
	}
	spin_lock_irqsave(&h->status_lock, flags);
	old = h->req_trigger;
	h->req_trigger = trigger;
	/* Something may already be asked: say so at once. */
	if (trigger && h->status->state)
		p2phub_eventfd_signal(trigger);
	spin_unlock_irqrestore(&h->status_lock, flags);
	if (old)
		eventfd_ctx_put(old);
	return 0;
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
	unsigned long pgoff = (vmf->address - vma->vm_start) >> PAGE_SHIFT;
	vm_fault_t ret;

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
	unsigned long pgoff = (vmf->address - vma->vm_start) >> PAGE_SHIFT;
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

static int p2phub_nvme_mmap(struct file *file, struct vm_area_struct *vma)
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

	mutex_lock(&h->lock);
	if (h->detached) {
		ret = h->gone ?: -ENODEV;
		goto out_unlock;
	}
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

static const struct file_operations p2phub_nvme_handle_fops = {
	.owner		= THIS_MODULE,
	.release	= p2phub_nvme_release,
	.unlocked_ioctl	= p2phub_nvme_handle_ioctl,
	.compat_ioctl	= compat_ptr_ioctl,
	.mmap		= p2phub_nvme_mmap,
	.llseek		= noop_llseek,
};

/*
 * Drivers that may hold a device of an owned controller's IOMMU group: they
 * make no DMA mappings of their own in the group's domain (vfio-pci cannot
 * claim the group while p2phub-nvme uses its default domain; a p2phub-nvme
 * sibling cannot be owned meanwhile, see p2phub_nvme_group_owned()).
 */
static bool p2phub_nvme_driver_allowed(const struct device_driver *drv)
{
	static const char * const allowed[] = {
		P2PHUB_NVME_DRV_NAME, "vfio-pci", "pci-stub", "pcieport",
	};
	int i;

	if (!drv)
		return true;
	for (i = 0; i < ARRAY_SIZE(allowed); i++)
		if (!strcmp(drv->name, allowed[i]))
			return true;
	return false;
}

static int p2phub_nvme_group_dev_ok(struct device *dev, void *owned)
{
	if (dev == owned)
		return 0;
	return p2phub_nvme_driver_allowed(READ_ONCE(dev->driver)) ? 0 : -EBUSY;
}

/*
 * Whether another controller of @ctrl's IOMMU group is owned: two owners in
 * one domain could reach each other's mappings. Caller holds
 * p2phub_nvme_ctrls_lock.
 */
static bool p2phub_nvme_group_owned(struct p2phub_nvme_ctrl *ctrl)
{
	struct p2phub_nvme_ctrl *other;

	lockdep_assert_held(&p2phub_nvme_ctrls_lock);
	if (!ctrl->group)
		return false;
	list_for_each_entry(other, &p2phub_nvme_ctrls, node)
		if (other != ctrl && other->group == ctrl->group &&
		    READ_ONCE(other->owner))
			return true;
	return false;
}

bool p2phub_dev_translated(struct device *dev)
{
	struct iommu_domain *domain;

	if (!device_iommu_mapped(dev))
		return false;
	domain = iommu_get_domain_for_dev(dev);
	return domain && (domain->type & __IOMMU_DOMAIN_PAGING);
}

/*
 * Why the IOMMU does not confine @pdev's DMA to what p2phub mapped for it,
 * as VFIO requires: NULL when it does. Caller holds p2phub_nvme_ctrls_lock,
 * which the bus notifier takes after a driver is set on a device and before
 * it probes: a sibling bound after this check sees the owner and takes the
 * controller back.
 */
static const char *p2phub_nvme_unconfined(struct pci_dev *pdev)
{
	struct iommu_group *group;
	const char *why = NULL;

	lockdep_assert_held(&p2phub_nvme_ctrls_lock);
	if (!p2phub_dev_translated(&pdev->dev))
		return device_iommu_mapped(&pdev->dev) ?
		       "its IOMMU domain is identity (passthrough)" :
		       "no IOMMU translates its DMA";
	group = iommu_group_get(&pdev->dev);
	if (!group)
		return "it has no IOMMU group";
	if (iommu_group_for_each_dev(group, &pdev->dev, p2phub_nvme_group_dev_ok))
		why = "its IOMMU group holds a device bound to another driver";
	else if (!p2phub_isolated_msi(group, &pdev->dev))
		why = "its MSIs are not isolated (no interrupt remapping)";
	iommu_group_put(group);
	return why;
}

/*
 * A controller fd whose inode is its own, so that unmap_mapping_range() on
 * its mapping reaches only this owner's VMAs (anon_inode_getfd() shares one
 * inode among all anonymous files).
 */
static int p2phub_nvme_getfd(struct p2phub_nvme_handle *h)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 8, 0)
	struct file *file;
	int fd;

	fd = get_unused_fd_flags(O_CLOEXEC);
	if (fd < 0)
		return fd;
	file = anon_inode_create_getfile("[p2phub-nvme]", &p2phub_nvme_handle_fops,
					 h, O_RDWR | O_CLOEXEC, NULL);
	if (IS_ERR(file)) {
		put_unused_fd(fd);
		return PTR_ERR(file);
	}
	fd_install(fd, file);
	return fd;
#else
	/* Renamed anon_inode_create_getfd() in v6.8, and no longer exported. */
	return anon_inode_getfd_secure("[p2phub-nvme]", &p2phub_nvme_handle_fops,
				       h, O_RDWR | O_CLOEXEC, NULL);
#endif
}

/* P2PHUB_NVME_OPEN on /dev/p2phub: become the owner of a bound controller. */
long p2phub_nvme_ioctl_open(struct file *pfile, void __user *uarg)
{
	struct p2phub_nvme_open arg;
	struct p2phub_nvme_handle *h;
	struct p2phub_nvme_ctrl *ctrl;
	struct pci_dev *pdev;
	const char *why;
	int ret, fd;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (arg.__reserved0 || arg.__reserved1 || arg.out_nr_irqs ||
	    arg.out_bar0_size || arg.out_bar0_mmap_size ||
	    !p2phub_all_zero(arg.reserved, sizeof(arg.reserved)))
		return -EINVAL;
	/* Raw DMA by a device the caller programs: the privilege of /dev/mem. */
	if (!capable(CAP_SYS_RAWIO))
		return -EPERM;
	/* Lockdown keeps root out of PCI BARs; so must p2phub. */
	ret = security_locked_down(LOCKDOWN_PCI_ACCESS);
	if (ret)
		return ret;

	pdev = pci_get_domain_bus_and_slot(arg.domain, arg.bus, arg.devfn);
	if (!pdev)
		return -ENODEV;

	h = kzalloc(sizeof(*h), GFP_KERNEL_ACCOUNT);
	if (!h) {
		ret = -ENOMEM;
		goto err_put_pdev;
	}
	h->pdev = pdev;
	mutex_init(&h->lock);
	mutex_init(&h->mmio_lock);
	init_waitqueue_head(&h->mmio_wq);
	spin_lock_init(&h->status_lock);
	xa_init_flags(&h->bufs, XA_FLAGS_ALLOC);
	xa_init(&h->regmaps);
	h->gone = -ENODEV;
	h->status = (void *)get_zeroed_page(GFP_KERNEL_ACCOUNT);
	if (!h->status) {
		ret = -ENOMEM;
		goto err_free_handle;
	}
	h->status->abi = P2PHUB_NVME_STATUS_ABI;

	/*
	 * The device lock keeps the driver binding stable while we look; an
	 * unbind in progress holds it, and then the answer is "busy", not a
	 * wait behind it.
	 */
	if (!device_trylock(&pdev->dev)) {
		ret = -EBUSY;
		goto err_free_handle;
	}
	if (pdev->dev.driver != &p2phub_nvme_driver.driver) {
		device_unlock(&pdev->dev);
		ret = -ENXIO;	/* not bound to p2phub-nvme */
		goto err_free_handle;
	}
	ctrl = pci_get_drvdata(pdev);
	mutex_lock(&p2phub_nvme_ctrls_lock);
	why = p2phub_nvme_unconfined(pdev);
	if (why && !allow_unsafe_noiommu) {
		mutex_unlock(&p2phub_nvme_ctrls_lock);
		device_unlock(&pdev->dev);
		pci_info_ratelimited(pdev, "not handed to user space: %s (allow_unsafe_noiommu=1 overrides, tainting the kernel)\n",
				     why);
		ret = -EXDEV;
		goto err_free_handle;
	}
	mutex_lock(&ctrl->lock);
	if (ctrl->owner || ctrl->dying || p2phub_nvme_group_owned(ctrl)) {
		mutex_unlock(&ctrl->lock);
		mutex_unlock(&p2phub_nvme_ctrls_lock);
		device_unlock(&pdev->dev);
		ret = -EBUSY;
		goto err_free_handle;
	}
	ctrl->owner = h;
	kref_get(&ctrl->ref);
	reinit_completion(&ctrl->released);
	h->ctrl = ctrl;
	h->bar0_pfn = pci_resource_start(pdev, 0) >> PAGE_SHIFT;
	h->bar0_mmap_len = ctrl->bar0_mmap_len;
	mutex_unlock(&ctrl->lock);
	mutex_unlock(&p2phub_nvme_ctrls_lock);
	/*
	 * A clean controller for the new owner, as VFIO resets at open too:
	 * whatever happened since the last release (a reset that could not
	 * be done then) does not carry over. Under the device lock, which
	 * the reset paths (and so reset_prepare) take: bus mastering goes
	 * on only after that, under the same lock, after an IOTLB flush (a
	 * lazily flushing domain may still translate what the previous
	 * driver or owner unmapped), and only if the controller was not
	 * taken back meanwhile (a sibling bound to a driver).
	 */
	p2phub_nvme_reset_locked(ctrl);
	p2phub_reg_unmap_group(pdev);
	p2phub_nvme_flush_iotlb(pdev);
	mutex_lock(&ctrl->lock);
	if (ctrl->owner == h)
		pci_set_master(pdev);
	mutex_unlock(&ctrl->lock);
	device_unlock(&pdev->dev);

	if (why) {
		pci_warn(pdev, "owned by user space without IOMMU confinement (%s): its owner can DMA to any memory\n",
			 why);
		add_taint(TAINT_USER, LOCKDEP_STILL_OK);
	}
	atomic_inc(&p2phub_nvme_live_handles);

	arg.argsz = sizeof(arg);
	arg.out_nr_irqs = ctrl->nr_irqs;
	arg.out_bar0_size = ctrl->bar0_len;
	arg.out_bar0_mmap_size = ctrl->bar0_mmap_len;
	if (copy_to_user(uarg, &arg, sizeof(arg))) {
		ret = -EFAULT;
		goto err_disown;
	}

	/* Last: an installed fd cannot be taken back. It owns pdev's reference. */
	h->pfile = get_file(pfile);
	fd = p2phub_nvme_getfd(h);
	if (fd < 0) {
		fput(h->pfile);
		ret = fd;
		goto err_disown;
	}
	/* The fd number reaches the caller as the return value. */
	return fd;

err_disown:
	atomic_dec(&p2phub_nvme_live_handles);
	mutex_lock(&ctrl->lock);
	if (ctrl->owner == h) {
		pci_clear_master(pdev);
		ctrl->owner = NULL;
		complete_all(&ctrl->released);
	}
	mutex_unlock(&ctrl->lock);
	p2phub_nvme_ctrl_put(ctrl);
err_free_handle:
	p2phub_nvme_handle_free(h);
err_put_pdev:
	pci_dev_put(pdev);
	return ret;
}

/*
 * A driver is about to probe @dev (BUS_NOTIFY_BIND_DRIVER: dev->driver is
 * set, probe has not run). If @dev shares the IOMMU group of an owned
 * controller, that driver's DMA mappings would go into the domain the
 * controller's owner programs DMA in: take the controller back first. The
 * notifier cannot refuse the bind; VFIO's group ownership claim (which
 * could) would detach the DMA API domain that p2phub's page lists come from.
 */
static int p2phub_nvme_bus_notify(struct notifier_block *nb,
				  unsigned long action, void *data)
{
	struct device *dev = data;
	struct p2phub_nvme_ctrl *ctrl;
	struct iommu_group *group;

	if (action != BUS_NOTIFY_BIND_DRIVER ||
	    p2phub_nvme_driver_allowed(dev->driver))
		return NOTIFY_DONE;
	group = iommu_group_get(dev);
	if (!group)
		return NOTIFY_DONE;
	mutex_lock(&p2phub_nvme_ctrls_lock);
	list_for_each_entry(ctrl, &p2phub_nvme_ctrls, node) {
		if (ctrl->group != group || &ctrl->pdev->dev == dev)
			continue;
		mutex_lock(&ctrl->lock);
		if (ctrl->owner) {
			pci_warn(ctrl->pdev, "%s in this controller's IOMMU group is being bound to %s: taking the controller back from its owner\n",
				 dev_name(dev), dev->driver->name);
			p2phub_nvme_take_back(ctrl, -EXDEV);
		}
		mutex_unlock(&ctrl->lock);
	}
	mutex_unlock(&p2phub_nvme_ctrls_lock);
	iommu_group_put(group);
	return NOTIFY_OK;
}

static struct notifier_block p2phub_nvme_bus_nb = {
	.notifier_call = p2phub_nvme_bus_notify,
};

/* ------------------------------------------------------------ pci driver */

/*
 * BAR0 up to the first page that holds the MSI-X table or PBA, rounded
 * down to whole pages: no page of it reaches past the BAR.
 */
static resource_size_t p2phub_nvme_bar0_mmap_len(struct pci_dev *pdev,
						 resource_size_t bar0_len)
{
	resource_size_t len = round_down(bar0_len, PAGE_SIZE);
	static const int regs[] = { PCI_MSIX_TABLE, PCI_MSIX_PBA };
	u32 val;
	int i;

	if (!pdev->msix_cap)
		return len;
	for (i = 0; i < ARRAY_SIZE(regs); i++) {
		pci_read_config_dword(pdev, pdev->msix_cap + regs[i], &val);
		if ((val & PCI_MSIX_TABLE_BIR) == 0)
			len = min_t(resource_size_t, len,
				    round_down(val & PCI_MSIX_TABLE_OFFSET,
					       PAGE_SIZE));
	}
	return len;
}

static int p2phub_nvme_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct p2phub_nvme_ctrl *ctrl;
	int ret, i, want;

	if (pdev->class != PCI_CLASS_STORAGE_EXPRESS) {
		dev_info(&pdev->dev, "not an NVMe controller (class 0x%06x)\n",
			 pdev->class);
		return -ENODEV;
	}
	ctrl = kzalloc(sizeof(*ctrl), GFP_KERNEL);
	if (!ctrl)
		return -ENOMEM;
	kref_init(&ctrl->ref);
	ctrl->pdev = pdev;
	INIT_LIST_HEAD(&ctrl->node);
	mutex_init(&ctrl->lock);
	init_completion(&ctrl->released);
	complete_all(&ctrl->released);		/* nobody owns it yet */

	ret = pci_enable_device_mem(pdev);
	if (ret)
		goto err_free_ctrl;
	ret = pci_request_mem_regions(pdev, P2PHUB_NVME_DRV_NAME);
	if (ret)
		goto err_disable_device;
	ret = dma_set_mask_and_coherent(&pdev->dev, DMA_BIT_MASK(64));
	if (ret)
		goto err_release_regions;
	/*
	 * The engine builds PRPs page by page from flattened address lists;
	 * it never hands the controller a segment, so any length will do
	 * (an exporter's table of long segments is then within the claim).
	 */
	dma_set_max_seg_size(&pdev->dev, UINT_MAX);
	ctrl->bar0_len = pci_resource_len(pdev, 0);
	if (ctrl->bar0_len < 0x2000) {
		ret = -ENODEV;
		goto err_release_regions;
	}
	ctrl->regs = pci_ioremap_bar(pdev, 0);
	if (!ctrl->regs) {
		ret = -ENOMEM;
		goto err_release_regions;
	}
	ctrl->bar0_mmap_len = p2phub_nvme_bar0_mmap_len(pdev, ctrl->bar0_len);

	want = pci_msix_vec_count(pdev);
	if (want > 0) {
		want = min(want, P2PHUB_NVME_MAX_IRQS);
		ret = pci_alloc_irq_vectors(pdev, 1, want, PCI_IRQ_MSIX);
		if (ret < 0)
			goto err_unmap_regs;
		ctrl->nr_irqs = ret;
	}
	ctrl->irqs = kcalloc(max(ctrl->nr_irqs, 1), sizeof(*ctrl->irqs),
			     GFP_KERNEL);
	if (!ctrl->irqs) {
		ret = -ENOMEM;
		goto err_free_vectors;
	}
	for (i = 0; i < ctrl->nr_irqs; i++) {
		ctrl->irqs[i].ctrl = ctrl;
		ctrl->irqs[i].vector = i;
		snprintf(ctrl->irqs[i].name, sizeof(ctrl->irqs[i].name),
			 "p2phub-nvme%d@%s", i, pci_name(pdev));
	}
	pci_save_state(pdev);
	pci_set_drvdata(pdev, ctrl);
	ctrl->group = iommu_group_get(&pdev->dev);
	mutex_lock(&p2phub_nvme_ctrls_lock);
	list_add(&ctrl->node, &p2phub_nvme_ctrls);
	mutex_unlock(&p2phub_nvme_ctrls_lock);
	dev_info(&pdev->dev, "owned by p2phub: BAR0 %pa bytes (%pa mappable), %d MSI-X vectors\n",
		 &ctrl->bar0_len, &ctrl->bar0_mmap_len, ctrl->nr_irqs);
	return 0;

err_free_vectors:
	pci_free_irq_vectors(pdev);
err_unmap_regs:
	iounmap(ctrl->regs);
err_release_regions:
	pci_release_mem_regions(pdev);
err_disable_device:
	pci_disable_device(pdev);
err_free_ctrl:
	p2phub_nvme_ctrl_put(ctrl);
	return ret;
}

/*
 * Wait for the owner to close its controller fd, asking again every 10 s,
 * for at most remove_grace_ms (less if the unbinding task is signalled: it
 * may be the owner itself, which can never close the fd meanwhile).
 */
static void p2phub_nvme_wait_released(struct p2phub_nvme_ctrl *ctrl)
{
	unsigned long deadline = jiffies + msecs_to_jiffies(READ_ONCE(remove_grace_ms));
	struct pci_dev *pdev = ctrl->pdev;
	long left, ret;

	for (;;) {
		left = (long)(deadline - jiffies);
		if (left <= 0)
			return;
		ret = wait_for_completion_interruptible_timeout(&ctrl->released,
								min_t(long, left, 10 * HZ));
		if (ret > 0)
			return;
		if (ret < 0) {
			dev_info(&pdev->dev, "unbinding task %s (%d) interrupted: not waiting for the owner any longer\n",
				 current->comm, task_pid_nr(current));
			return;
		}
		if (time_before(jiffies, deadline)) {
			dev_info(&pdev->dev, "unbind waits for the process owning this controller to close its fd\n");
			p2phub_nvme_request(ctrl, P2PHUB_NVME_ST_REMOVING, false);
		}
	}
}

static void p2phub_nvme_remove(struct pci_dev *pdev)
{
	struct p2phub_nvme_ctrl *ctrl = pci_get_drvdata(pdev);

	mutex_lock(&ctrl->lock);
	ctrl->dying = true;
	if (ctrl->owner)
		p2phub_nvme_signal(ctrl->owner, P2PHUB_NVME_ST_REMOVING, false);
	mutex_unlock(&ctrl->lock);
	/*
	 * The owner maps BAR0 and programs the controller: it must let go
	 * before the device can change hands. Like VFIO, ask it (the request
	 * eventfd and the status page) and wait for it; unlike VFIO, not for
	 * ever: after the grace period the kernel takes the controller back
	 * (DMA stopped, registrations unmapped, mappings zapped, memory and
	 * vectors freed), and the fd's ioctls fail with -ENODEV.
	 */
	p2phub_nvme_wait_released(ctrl);
	mutex_lock(&ctrl->lock);
	if (ctrl->owner) {
		dev_warn(&pdev->dev, "the owner did not close its controller fd within %u ms: taking the controller back\n",
			 READ_ONCE(remove_grace_ms));
		p2phub_nvme_take_back(ctrl, -ENODEV);
	}
	mutex_unlock(&ctrl->lock);

	mutex_lock(&p2phub_nvme_ctrls_lock);
	list_del_init(&ctrl->node);
	mutex_unlock(&p2phub_nvme_ctrls_lock);
	/* Bus mastering off under the device lock, whoever left it on. */
	pci_clear_master(pdev);
	pci_free_irq_vectors(pdev);
	iounmap(ctrl->regs);
	ctrl->regs = NULL;
	pci_release_mem_regions(pdev);
	pci_disable_device(pdev);
	pci_set_drvdata(pdev, NULL);
	p2phub_nvme_ctrl_put(ctrl);
	dev_info(&pdev->dev, "released by p2phub\n");
}

/*
 * PCI errors and resets: the owner's controller state is gone or suspect.
 * Stop its DMA, tell the owner (P2PHUB_NVME_ST_ERROR), zap its BAR0 mapping
 * (its faults wait until the device is back), and keep bus mastering off
 * until it re-initialises the controller and RESUMEs, which it may only
 * once recovery is over.
 */
static pci_ers_result_t p2phub_nvme_error_detected(struct pci_dev *pdev,
						   pci_channel_state_t state)
{
	struct p2phub_nvme_ctrl *ctrl = pci_get_drvdata(pdev);
	bool gone = state == pci_channel_io_perm_failure;

	ctrl->in_recovery = true;
	p2phub_nvme_request(ctrl, P2PHUB_NVME_ST_ERROR |
			    (gone ? P2PHUB_NVME_ST_REMOVING : 0), true);
	p2phub_nvme_owner_mmio(ctrl, true);
	return gone ? PCI_ERS_RESULT_DISCONNECT : PCI_ERS_RESULT_NEED_RESET;
}

static pci_ers_result_t p2phub_nvme_slot_reset(struct pci_dev *pdev)
{
	pci_restore_state(pdev);
	pci_save_state(pdev);
	pci_clear_master(pdev);
	return PCI_ERS_RESULT_RECOVERED;
}

static void p2phub_nvme_error_resume(struct pci_dev *pdev)
{
	struct p2phub_nvme_ctrl *ctrl = pci_get_drvdata(pdev);

	ctrl->in_recovery = false;
	p2phub_nvme_owner_mmio(ctrl, false);
}

static void p2phub_nvme_reset_prepare(struct pci_dev *pdev)
{
	struct p2phub_nvme_ctrl *ctrl = pci_get_drvdata(pdev);

	p2phub_nvme_request(ctrl, P2PHUB_NVME_ST_ERROR, true);
	p2phub_nvme_owner_mmio(ctrl, true);
}

static void p2phub_nvme_reset_done(struct pci_dev *pdev)
{
	pci_clear_master(pdev);
	p2phub_nvme_owner_mmio(pci_get_drvdata(pdev), false);
}

static const struct pci_error_handlers p2phub_nvme_err_handler = {
	.error_detected	= p2phub_nvme_error_detected,
	.slot_reset	= p2phub_nvme_slot_reset,
	.resume		= p2phub_nvme_error_resume,
	.reset_prepare	= p2phub_nvme_reset_prepare,
	.reset_done	= p2phub_nvme_reset_done,
};

static struct pci_driver p2phub_nvme_driver = {
	.name		= P2PHUB_NVME_DRV_NAME,
	.id_table	= NULL,		/* reached only through driver_override */
	.probe		= p2phub_nvme_probe,
	.remove		= p2phub_nvme_remove,
	.err_handler	= &p2phub_nvme_err_handler,
};

int p2phub_nvme_init(void)
{
	int ret;

	ret = bus_register_notifier(&pci_bus_type, &p2phub_nvme_bus_nb);
	if (ret)
		return ret;
	ret = pci_register_driver(&p2phub_nvme_driver);
	if (ret) {
		bus_unregister_notifier(&pci_bus_type, &p2phub_nvme_bus_nb);
		return ret;
	}
	/* Under the module's one debugfs root: /sys/kernel/debug/p2phub/nvme. */
	p2phub_nvme_debugfs = debugfs_create_dir("nvme", p2phub_debugfs_dir);
	debugfs_create_atomic_t("live_dma_buffers", 0444, p2phub_nvme_debugfs,
				&p2phub_nvme_live_bufs);
	debugfs_create_atomic_t("live_handles", 0444, p2phub_nvme_debugfs,
				&p2phub_nvme_live_handles);
	debugfs_create_atomic_t("function_resets", 0444, p2phub_nvme_debugfs,
				&p2phub_nvme_function_resets);
	debugfs_create_atomic_t("taken_back", 0444, p2phub_nvme_debugfs,
				&p2phub_nvme_taken_back);
	return 0;
}

void p2phub_nvme_exit(void)
{
	debugfs_remove_recursive(p2phub_nvme_debugfs);
	pci_unregister_driver(&p2phub_nvme_driver);
	bus_unregister_notifier(&pci_bus_type, &p2phub_nvme_bus_nb);
}
