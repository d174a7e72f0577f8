/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * NVMe controller ownership for the user-space queue engine: what the
 * p2phub_nvme_*.c files share.
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
 *
 * The files, by concern:
 *   p2phub_nvme_pci.c      the PCI driver: probe, remove, PCI errors, resets
 *   p2phub_nvme_confine.c  who may own a controller: OPEN, IOMMU group checks,
 *                          the bus notifier and the kernel's take-back
 *   p2phub_nvme_fd.c       the controller fd: its ledger, ioctls and release
 *   p2phub_nvme_mmap.c     the owner's BAR0 and DMA-buffer mappings
 *   p2phub_nvme_intrs.c    MSI-X vectors and the request eventfd
 * Locking: see p2phub_priv.h.
 */
#ifndef _P2PHUB_NVME_H
#define _P2PHUB_NVME_H

#include <linux/atomic.h>
#include <linux/completion.h>
#include <linux/eventfd.h>
#include <linux/interrupt.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/mm_types.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/spinlock.h>
#include <linux/version.h>
#include <linux/wait.h>
#include <linux/xarray.h>

#include "p2phub_reg.h"

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
	struct mutex lock;		/* owner, dying, dma_domain, reset_due */
	struct p2phub_nvme_handle *owner;
	bool dying;
	/*
	 * The group's DMA API domain, attached again under p2phub's DMA
	 * ownership of the group while the controller is owned; NULL when
	 * the group is not claimed (see p2phub_nvme_group_claim()).
	 */
	struct iommu_domain *dma_domain;
	/* An owner had the controller since its last function reset. */
	bool reset_due;
	/*
	 * AER recovery under way: RESUME waits for its resume(). Under the
	 * device lock; OPEN clears what a recovery that never reached
	 * resume() left.
	 */
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

extern struct pci_driver p2phub_nvme_driver;
extern struct mutex p2phub_nvme_ctrls_lock;
extern struct list_head p2phub_nvme_ctrls;
extern atomic_t p2phub_nvme_live_bufs;
extern atomic_t p2phub_nvme_live_handles;
extern atomic_t p2phub_nvme_function_resets;
extern atomic_t p2phub_nvme_taken_back;

/*
 * The prologue of every controller fd ioctl that touches the controller:
 * take h->lock, unless the controller was handed back or taken back (then
 * the fd's errno, h->gone).
 */
static inline int p2phub_nvme_lock_live(struct p2phub_nvme_handle *h)
{
	mutex_lock(&h->lock);
	if (h->detached) {
		int ret = h->gone;

		mutex_unlock(&h->lock);
		return ret;
	}
	return 0;
}

/* p2phub_nvme_pci.c */
void p2phub_nvme_ctrl_put(struct p2phub_nvme_ctrl *ctrl);
void p2phub_nvme_quiesce(struct p2phub_nvme_ctrl *ctrl);
bool p2phub_nvme_reset_function(struct p2phub_nvme_ctrl *ctrl,
				struct p2phub_nvme_handle *h);
void p2phub_nvme_reset_locked(struct p2phub_nvme_ctrl *ctrl);

/* p2phub_nvme_confine.c */
int p2phub_nvme_confine_init(void);
void p2phub_nvme_confine_exit(void);
void p2phub_nvme_take_back(struct p2phub_nvme_ctrl *ctrl, int err);
void p2phub_nvme_group_unclaim(struct p2phub_nvme_ctrl *ctrl);

/* p2phub_nvme_fd.c */
extern const struct file_operations p2phub_nvme_handle_fops;
void p2phub_nvme_handle_free(struct p2phub_nvme_handle *h);
void p2phub_nvme_drop_all(struct p2phub_nvme_handle *h);

/* p2phub_nvme_mmap.c */
void p2phub_nvme_zap(struct p2phub_nvme_handle *h, bool block, bool gone);
void p2phub_nvme_owner_mmio(struct p2phub_nvme_ctrl *ctrl, bool block);
int p2phub_nvme_mmap(struct file *file, struct vm_area_struct *vma);

/* p2phub_nvme_intrs.c */
void p2phub_nvme_signal(struct p2phub_nvme_handle *h, u32 bits, bool stop);
void p2phub_nvme_request(struct p2phub_nvme_ctrl *ctrl, u32 bits, bool stop);
void p2phub_nvme_irq_detach(struct p2phub_nvme_handle *h,
			    struct p2phub_nvme_irq *v);
long p2phub_nvme_ioctl_irq_set(struct p2phub_nvme_handle *h, void __user *uarg);
long p2phub_nvme_ioctl_req_set(struct p2phub_nvme_handle *h, void __user *uarg);

#endif /* _P2PHUB_NVME_H */
