// SPDX-License-Identifier: GPL-2.0-only
/*
 * Registrations: the per-file ledger of pinned memory, per-device DMA page
 * lists, the registration ioctls and the leak counters in debugfs.
 *
 * A registration is LIVE until its owner revokes the memory (REVOKED) or
 * user space lets go of it (DEAD). Its pin is released exactly once, by
 * p2phub_reg_teardown(); its struct goes with the last reference.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/build_bug.h>
#include <linux/capability.h>
#include <linux/debugfs.h>
#include <linux/log2.h>
#include <linux/moduleparam.h>
#include <linux/overflow.h>
#include <linux/pci.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

#include "p2phub_reg.h"

static_assert(sizeof(struct p2phub_register) == 80);
static_assert(offsetof(struct p2phub_register, va) == 24);
static_assert(offsetof(struct p2phub_register, out_handle) == 48);
static_assert(sizeof(struct p2phub_unregister) == 24);
static_assert(sizeof(struct p2phub_reg_info) == 80);
static_assert(offsetof(struct p2phub_reg_info, out_generation) == 24);
static_assert(sizeof(struct p2phub_dma_pages) == 80);
static_assert(offsetof(struct p2phub_dma_pages, first) == 32);
static_assert(offsetof(struct p2phub_dma_pages, out_total) == 48);
static_assert(sizeof(struct p2phub_export) == 32);
static_assert(sizeof(dma_addr_t) <= sizeof(u64));

#define P2PHUB_COPY_CHUNK	512	/* addresses per bounce buffer */

static unsigned int max_reg_gib = 1024;
module_param(max_reg_gib, uint, 0644);
MODULE_PARM_DESC(max_reg_gib,
		 "Bytes one /dev/p2phub open may have registered at once, in GiB (default 1024)");

u64 p2phub_max_reg_bytes(void)
{
	return (u64)READ_ONCE(max_reg_gib) << 30;
}

struct p2phub_reg_stats p2phub_stats;
struct workqueue_struct *p2phub_reg_wq;

/*
 * Every registration, so that a device's removal can find its maps.
 * Lock order: p2phub_all_regs_lock -> p2phub_reg.lock -> the source's
 * dma_resv (see p2phub_reg_pci_notify()).
 */
static DEFINE_MUTEX(p2phub_all_regs_lock);
static LIST_HEAD(p2phub_all_regs);
/* /sys/kernel/debug/p2phub: other parts of the module may add files. */
struct dentry *p2phub_debugfs_dir;

/* --------------------------------------------------------------- lifetime */

static void p2phub_reg_notify_work(struct work_struct *work)
{
	struct p2phub_reg *reg = container_of(work, struct p2phub_reg,
					      notify_work);

	p2phub_export_notify(reg);
	p2phub_reg_put(reg);	/* the reference taken when queued */
}

static struct p2phub_reg *p2phub_reg_alloc(void)
{
	struct p2phub_reg *reg;

	reg = kzalloc(sizeof(*reg), GFP_KERNEL_ACCOUNT);
	if (!reg)
		return NULL;
	kref_init(&reg->kref);
	spin_lock_init(&reg->state_lock);
	reg->state = P2PHUB_REG_LIVE;
	reg->generation = 1;
	mutex_init(&reg->lock);
	INIT_LIST_HEAD(&reg->maps);
	INIT_LIST_HEAD(&reg->exports);
	INIT_LIST_HEAD(&reg->users);
	INIT_WORK(&reg->notify_work, p2phub_reg_notify_work);
	atomic_inc(&p2phub_stats.regs);
	mutex_lock(&p2phub_all_regs_lock);
	list_add_tail(&reg->all_node, &p2phub_all_regs);
	mutex_unlock(&p2phub_all_regs_lock);
	return reg;
}

/*
 * Charge @reg's pages to the caller's pinned_vm (VmPin in /proc/PID/status)
 * against RLIMIT_MEMLOCK, as RDMA memory registrations are; CAP_IPC_LOCK
 * lifts the limit, not the charge. The mm is kept (mmgrab) so that the same
 * mm is uncharged at teardown, whichever task or work item does it.
 * -ENOMEM over the limit.
 */
static int p2phub_reg_charge(struct p2phub_reg *reg)
{
	struct mm_struct *mm = current->mm;
	unsigned long pages, limit;
	s64 pinned;

	if (!mm)			/* a kernel thread: nobody to charge */
		return 0;
	pages = DIV_ROUND_UP(reg->length, PAGE_SIZE);
	limit = rlimit(RLIMIT_MEMLOCK) >> PAGE_SHIFT;
	pinned = atomic64_add_return(pages, &mm->pinned_vm);
	if ((u64)pinned > limit && !capable(CAP_IPC_LOCK)) {
		atomic64_sub(pages, &mm->pinned_vm);
		pr_info_ratelimited("pid %d (%s): REGISTER of %llu bytes refused: over RLIMIT_MEMLOCK (%lu KiB, %lld KiB pinned already); raise ulimit -l or grant CAP_IPC_LOCK\n",
				    task_pid_nr(current), current->comm,
				    reg->length, rlimit(RLIMIT_MEMLOCK) >> 10,
				    (s64)(pinned - pages) << (PAGE_SHIFT - 10));
		return -ENOMEM;
	}
	mmgrab(mm);
	reg->acct_mm = mm;
	reg->acct_pages = pages;
	return 0;
}

static void p2phub_reg_uncharge(struct p2phub_reg *reg)
{
	if (!reg->acct_mm)
		return;
	atomic64_sub(reg->acct_pages, &reg->acct_mm->pinned_vm);
	mmdrop(reg->acct_mm);
	reg->acct_mm = NULL;
}

/* Release the pin and every device mapping, once. Sleeps. */
static void p2phub_reg_teardown(struct p2phub_reg *reg)
{
	LIST_HEAD(maps);

	mutex_lock(&reg->lock);
	if (reg->torn_down) {
		mutex_unlock(&reg->lock);
		return;
	}
	reg->torn_down = true;
	list_splice_init(&reg->maps, &maps);
	reg->nr_maps = 0;
	mutex_unlock(&reg->lock);

	/* Set up only partially when REGISTER failed before choosing one. */
	if (reg->provider)
		reg->provider->release(reg, &maps);
	p2phub_reg_uncharge(reg);	/* the pin is gone */
}

static void p2phub_reg_release(struct kref *kref)
{
	struct p2phub_reg *reg = container_of(kref, struct p2phub_reg, kref);

	mutex_lock(&p2phub_all_regs_lock);
	list_del(&reg->all_node);
	mutex_unlock(&p2phub_all_regs_lock);
	p2phub_reg_teardown(reg);
	WARN_ON_ONCE(!list_empty(&reg->exports));
	mutex_destroy(&reg->lock);
	atomic_dec(&p2phub_stats.regs);
	kfree(reg);
}

void p2phub_reg_get_ref(struct p2phub_reg *reg)
{
	kref_get(&reg->kref);
}

void p2phub_reg_put(struct p2phub_reg *reg)
{
	might_sleep();
	kref_put(&reg->kref, p2phub_reg_release);
}

struct p2phub_reg *p2phub_reg_get(struct p2phub_file *pf, u64 handle)
{
	struct p2phub_reg *reg;

	if (!handle || handle > U32_MAX)
		return ERR_PTR(-ENOENT);
	mutex_lock(&pf->lock);
	reg = xa_load(&pf->regs, handle);
	if (reg)
		kref_get(&reg->kref);
	mutex_unlock(&pf->lock);
	return reg ?: ERR_PTR(-ENOENT);
}

/* Queue the export notification, holding a reference for the work. */
static void p2phub_reg_queue_notify(struct p2phub_reg *reg)
{
	/* A registration already on its way out has no importers left. */
	if (!kref_get_unless_zero(&reg->kref))
		return;
	if (!queue_work(p2phub_reg_wq, &reg->notify_work))
		kref_put(&reg->kref, p2phub_reg_release);	/* cannot be last */
}

/*
 * The owner took the memory back. Callable from provider callbacks (under
 * the source's dma_resv, or from the NVIDIA free callback): takes only
 * state_lock and defers the rest.
 */
void p2phub_reg_revoke(struct p2phub_reg *reg, const char *why)
{
	struct p2phub_reg_user *u;
	bool first = false;

	spin_lock(&reg->state_lock);
	if (reg->state == P2PHUB_REG_LIVE) {
		reg->state = P2PHUB_REG_REVOKED;
		reg->revoked = true;	/* stays when it dies later */
		reg->generation++;
		first = true;
		/* Devices stop before the memory can go: see p2phub_reg_user. */
		list_for_each_entry(u, &reg->users, node)
			u->stop_dma(u);
	}
	spin_unlock(&reg->state_lock);
	if (!first)
		return;
	atomic_inc(&p2phub_stats.revocations);
	pr_info_ratelimited("registration %u (%s, %llu bytes) revoked: %s\n",
			    reg->handle, reg->provider->name, reg->length, why);
	p2phub_reg_queue_notify(reg);
}

bool p2phub_reg_live(struct p2phub_reg *reg, u64 generation)
{
	bool live;

	spin_lock(&reg->state_lock);
	live = reg->state == P2PHUB_REG_LIVE && reg->generation == generation;
	spin_unlock(&reg->state_lock);
	return live;
}

/*
 * An I/O hold keeps the registration's maps (and so their addrs arrays)
 * from being torn down: UNREGISTER fails with -EBUSY while one is held.
 */
int p2phub_reg_io_begin(struct p2phub_reg *reg, u64 generation)
{
	int ret = 0;

	spin_lock(&reg->state_lock);
	if (reg->state != P2PHUB_REG_LIVE || reg->generation != generation)
		ret = -ESTALE;
	else
		reg->io_holds++;
	spin_unlock(&reg->state_lock);
	return ret;
}

void p2phub_reg_io_end(struct p2phub_reg *reg)
{
	spin_lock(&reg->state_lock);
	if (!WARN_ON_ONCE(!reg->io_holds))
		reg->io_holds--;
	spin_unlock(&reg->state_lock);
}

int p2phub_reg_user_add(struct p2phub_reg *reg, struct p2phub_reg_user *u,
			u64 generation)
{
	int ret = 0;

	spin_lock(&reg->state_lock);
	if (reg->state != P2PHUB_REG_LIVE || reg->generation != generation) {
		ret = -ESTALE;
	} else {
		reg->io_holds++;
		list_add_tail(&u->node, &reg->users);
	}
	spin_unlock(&reg->state_lock);
	return ret;
}

void p2phub_reg_user_del(struct p2phub_reg *reg, struct p2phub_reg_user *u)
{
	spin_lock(&reg->state_lock);
	list_del_init(&u->node);
	if (!WARN_ON_ONCE(!reg->io_holds))
		reg->io_holds--;
	spin_unlock(&reg->state_lock);
}

/* ------------------------------------------------------- device mappings */

static void p2phub_reg_map_free(struct p2phub_reg_map *map)
{
	pci_dev_put(map->pdev);
	kvfree(map->addrs);
	kfree(map);
	atomic_dec(&p2phub_stats.dev_maps);
}

/* ------------------------------------------------------- device removal */

/*
 * PCI devices between BUS_NOTIFY_DEL_DEVICE and BUS_NOTIFY_REMOVED_DEVICE:
 * no new map is made for them. Their IOMMU state goes at REMOVED_DEVICE,
 * so every map of theirs is undone at DEL_DEVICE, while it still exists.
 */
static DEFINE_SPINLOCK(p2phub_removing_lock);
static struct pci_dev *p2phub_removing[8];

static bool p2phub_dev_removing(struct pci_dev *pdev)
{
	bool found = false;
	int i;

	spin_lock(&p2phub_removing_lock);
	for (i = 0; i < ARRAY_SIZE(p2phub_removing); i++)
		found |= p2phub_removing[i] == pdev;
	spin_unlock(&p2phub_removing_lock);
	return found;
}

/* Returns false when the table is full: the caller then scans only. */
static bool p2phub_dev_removing_set(struct pci_dev *pdev, bool on)
{
	bool done = false;
	int i;

	spin_lock(&p2phub_removing_lock);
	for (i = 0; i < ARRAY_SIZE(p2phub_removing) && !done; i++) {
		if (on && !p2phub_removing[i]) {
			p2phub_removing[i] = pdev;
			done = true;
		} else if (!on && p2phub_removing[i] == pdev) {
			p2phub_removing[i] = NULL;
			done = true;
		}
	}
	spin_unlock(&p2phub_removing_lock);
	return done;
}

/*
 * Undo every map for @pdev; returns how many there were. A map nobody holds
 * is freed; a held one stays on the list, marked removed, until its holder
 * lets go (its registration's teardown frees it).
 */
static unsigned int p2phub_reg_unmap_device(struct pci_dev *pdev)
{
	struct p2phub_reg_map *map, *tmp;
	struct p2phub_reg *reg;
	unsigned int n = 0;
	bool held;

	mutex_lock(&p2phub_all_regs_lock);
	list_for_each_entry(reg, &p2phub_all_regs, all_node) {
		mutex_lock(&reg->lock);
		list_for_each_entry_safe(map, tmp, &reg->maps, node) {
			if (map->pdev != pdev || map->removed)
				continue;
			reg->provider->unmap(reg, map);
			reg->nr_maps--;
			n++;
			spin_lock(&reg->state_lock);
			held = map->holds;
			map->removed = true;
			spin_unlock(&reg->state_lock);
			if (!held) {
				list_del(&map->node);
				p2phub_reg_map_free(map);
			}
		}
		mutex_unlock(&reg->lock);
	}
	mutex_unlock(&p2phub_all_regs_lock);
	return n;
}

static int p2phub_reg_pci_notify(struct notifier_block *nb,
				 unsigned long action, void *data)
{
	struct pci_dev *pdev = to_pci_dev(data);
	unsigned int n;

	switch (action) {
	case BUS_NOTIFY_UNBOUND_DRIVER:
		/*
		 * Its driver has stopped it and let it go: nothing drives it
		 * now, so nothing may keep addresses mapped for it (the
		 * DMA-API debug check of this same event counts them as that
		 * driver's leak). A driver bound later gets fresh maps.
		 */
		n = p2phub_reg_unmap_device(pdev);
		if (n)
			pci_info(pdev, "p2phub: driver unbound: unmapped %u registration(s) for it\n",
				 n);
		break;
	case BUS_NOTIFY_DEL_DEVICE:
		if (!p2phub_dev_removing_set(pdev, true))
			pci_warn(pdev, "p2phub: too many devices leaving at once; a map made during this removal may outlive it\n");
		n = p2phub_reg_unmap_device(pdev);
		if (n)
			pci_info(pdev, "p2phub: device removed: unmapped %u registration(s) for it\n",
				 n);
		break;
	case BUS_NOTIFY_REMOVED_DEVICE:
		p2phub_dev_removing_set(pdev, false);
		break;
	}
	return NOTIFY_DONE;
}

static struct notifier_block p2phub_reg_pci_nb = {
	.notifier_call = p2phub_reg_pci_notify,
	.priority = 1,	/* before DMA-API debug's UNBOUND_DRIVER check (0) */
};

/*
 * The mapping of @reg for @pdev, made on first ask and cached until
 * teardown. Returns ERR_PTR(-ESTALE) once the registration is not live.
 */
struct p2phub_reg_map *p2phub_reg_map_get(struct p2phub_reg *reg,
					  struct pci_dev *pdev)
{
	struct p2phub_reg_map *map;
	int ret;

	mutex_lock(&reg->lock);
	if (reg->torn_down || READ_ONCE(reg->state) != P2PHUB_REG_LIVE) {
		ret = -ESTALE;
		goto err_unlock;
	}
	list_for_each_entry(map, &reg->maps, node) {
		/* A removed map's device left or was let go of: see below. */
		if (map->pdev == pdev && !map->removed)
			goto out_hold;
	}
	if (p2phub_dev_removing(pdev)) {
		ret = -ENODEV;
		goto err_unlock;
	}
	/*
	 * A function no driver drives cannot use the addresses, and its DMA
	 * parameters are only the PCI core's defaults (64 KiB segments),
	 * which exporters do not honour when they build their tables.
	 */
	if (!READ_ONCE(pdev->dev.driver)) {
		dev_info_ratelimited(&pdev->dev,
				     "p2phub: registration %u: refusing a map for a device no driver is bound to\n",
				     reg->handle);
		ret = -ENODEV;
		goto err_unlock;
	}

	map = kzalloc(sizeof(*map), GFP_KERNEL_ACCOUNT);
	if (!map) {
		ret = -ENOMEM;
		goto err_unlock;
	}
	atomic_inc(&p2phub_stats.dev_maps);
	map->reg = reg;
	map->pdev = pci_dev_get(pdev);
	map->addrs = kvmalloc_array(reg->npages, sizeof(*map->addrs),
				    GFP_KERNEL_ACCOUNT);
	if (!map->addrs) {
		ret = -ENOMEM;
		goto err_free_map;
	}
	ret = reg->provider->map(reg, map);
	if (ret)
		goto err_free_map;
	/*
	 * A provider may drop reg->lock in map(): the device may be going, or
	 * its driver (whose UNBOUND_DRIVER unmap may have passed this one).
	 */
	if (p2phub_dev_removing(pdev) || !READ_ONCE(pdev->dev.driver)) {
		reg->provider->unmap(reg, map);
		ret = -ENODEV;
		goto err_free_map;
	}
	list_add_tail(&map->node, &reg->maps);
	reg->nr_maps++;
out_hold:
	spin_lock(&reg->state_lock);
	map->holds++;
	spin_unlock(&reg->state_lock);
	mutex_unlock(&reg->lock);
	return map;

err_free_map:
	p2phub_reg_map_free(map);
err_unlock:
	mutex_unlock(&reg->lock);
	return ERR_PTR(ret);
}

void p2phub_reg_map_put(struct p2phub_reg *reg, struct p2phub_reg_map *map,
			bool unmap)
{
	bool last;

	mutex_lock(&reg->lock);
	if (reg->torn_down) {		/* the map is gone with the pin */
		mutex_unlock(&reg->lock);
		return;
	}
	spin_lock(&reg->state_lock);
	last = !WARN_ON_ONCE(!map->holds) && !--map->holds;
	spin_unlock(&reg->state_lock);
	if (unmap && last && !map->removed) {
		list_del(&map->node);
		reg->nr_maps--;
		reg->provider->unmap(reg, map);
		p2phub_reg_map_free(map);
	}
	mutex_unlock(&reg->lock);
}

bool p2phub_reg_dev_revoked_mapped(struct pci_dev *pdev)
{
	struct p2phub_reg_map *map;
	struct p2phub_reg *reg;
	bool found = false;

	mutex_lock(&p2phub_all_regs_lock);
	list_for_each_entry(reg, &p2phub_all_regs, all_node) {
		mutex_lock(&reg->lock);
		if (!reg->torn_down && READ_ONCE(reg->revoked)) {
			list_for_each_entry(map, &reg->maps, node)
				found |= map->pdev == pdev && !map->removed &&
					 reg->provider->mapped(map);
		}
		mutex_unlock(&reg->lock);
		if (found)
			break;
	}
	mutex_unlock(&p2phub_all_regs_lock);
	return found;
}

/* Used by providers' release(): frees what p2phub_reg_map_get() made. */
void p2phub_reg_maps_free(struct list_head *maps)
{
	struct p2phub_reg_map *map, *tmp;

	list_for_each_entry_safe(map, tmp, maps, node) {
		list_del(&map->node);
		p2phub_reg_map_free(map);
	}
}

int p2phub_reg_dma_pages(struct p2phub_reg *reg, struct pci_dev *pdev,
			 struct p2phub_dma_list *list)
{
	struct p2phub_reg_map *map;
	u64 gen;

	gen = READ_ONCE(reg->generation);
	map = p2phub_reg_map_get(reg, pdev);
	if (IS_ERR(map))
		return PTR_ERR(map);
	list->addrs = map->addrs;
	list->npages = reg->npages;
	list->page_shift = reg->page_shift;
	list->generation = gen;
	list->map = map;
	/* Revoked while mapping: the caller must not see these addresses. */
	if (!p2phub_reg_live(reg, gen)) {
		p2phub_reg_dma_pages_put(reg, list, false);
		return -ESTALE;
	}
	return 0;
}

void p2phub_reg_dma_pages_hold(struct p2phub_reg *reg,
			       const struct p2phub_dma_list *list)
{
	spin_lock(&reg->state_lock);
	list->map->holds++;
	spin_unlock(&reg->state_lock);
}

void p2phub_reg_dma_pages_put(struct p2phub_reg *reg,
			      struct p2phub_dma_list *list, bool unmap)
{
	if (!list->map)
		return;
	p2phub_reg_map_put(reg, list->map, unmap);
	list->map = NULL;
	list->addrs = NULL;
}

/* ------------------------------------------------------------------ ioctls */

static struct pci_dev *p2phub_pci_get(u32 domain, u8 bus, u8 devfn)
{
	if (domain > 0xffff)
		return NULL;
	return pci_get_domain_bus_and_slot(domain, bus, devfn);
}

static int p2phub_reg_validate_register(const struct p2phub_register *a)
{
	u32 kind = a->flags & (P2PHUB_REGISTER_F_DMABUF |
			       P2PHUB_REGISTER_F_NVIDIA);
	u64 end;

	if (a->__reserved0 || a->__reserved1 ||
	    !p2phub_all_zero(a->reserved, sizeof(a->reserved)) ||
	    a->out_handle || a->out_page_size || a->out_provider)
		return -EINVAL;
	if (!(a->flags & P2PHUB_REGISTER_F_DEVICE) &&
	    (a->domain || a->bus || a->devfn))
		return -EINVAL;
	if (!a->length)
		return -EINVAL;
	if (kind == P2PHUB_REGISTER_F_DMABUF) {
		if (a->va || a->fd < 0)
			return a->fd < 0 ? -EBADF : -EINVAL;
		if (!PAGE_ALIGNED(a->offset) || !PAGE_ALIGNED(a->length))
			return -EINVAL;
		if (check_add_overflow(a->offset, a->length, &end))
			return -EOVERFLOW;
		return 0;
	}
	if (kind == P2PHUB_REGISTER_F_NVIDIA) {
		if (a->fd != -1 || a->offset)
			return -EINVAL;
		if (!IS_ALIGNED(a->va, SZ_64K) || !IS_ALIGNED(a->length, SZ_64K))
			return -EINVAL;
		if (check_add_overflow(a->va, a->length, &end))
			return -EOVERFLOW;
		return 0;
	}
	return -EINVAL;		/* neither or both */
}

/* Mark @reg dead; false (and nothing done) while someone still uses it. */
static bool p2phub_reg_kill(struct p2phub_reg *reg, bool force)
{
	bool busy;

	spin_lock(&reg->state_lock);
	busy = reg->io_holds || reg->export_attached || reg->export_mmaps;
	if (!busy || force) {
		reg->state = P2PHUB_REG_DEAD;
		reg->generation++;
	}
	spin_unlock(&reg->state_lock);
	return !busy;
}

static long p2phub_ioctl_register(struct p2phub_file *pf, void __user *uarg)
{
	struct p2phub_register a;
	struct pci_dev *pdev = NULL;
	struct p2phub_reg *reg;
	struct p2phub_reg_map *map;
	u32 handle;
	int ret;

	ret = p2phub_copy_args(&a, sizeof(a), uarg, P2PHUB_REGISTER_F_DMABUF |
			       P2PHUB_REGISTER_F_NVIDIA |
			       P2PHUB_REGISTER_F_DEVICE);
	if (ret)
		return ret;
	ret = p2phub_reg_validate_register(&a);
	if (ret)
		return ret;
	if (a.flags & P2PHUB_REGISTER_F_DEVICE) {
		if (!capable(CAP_SYS_ADMIN))	/* as for P2PHUB_DMA_PAGES */
			return -EPERM;
		pdev = p2phub_pci_get(a.domain, a.bus, a.devfn);
		if (!pdev)
			return -ENODEV;
	}

	reg = p2phub_reg_alloc();
	if (!reg) {
		ret = -ENOMEM;
		goto err_put_pdev;
	}
	reg->length = a.length;
	ret = p2phub_reg_charge(reg);
	if (ret)
		goto err_put_reg;
	if (a.flags & P2PHUB_REGISTER_F_DMABUF) {
		ret = p2phub_dmabuf_setup(reg, a.fd, a.offset, a.length);
	} else {
#ifdef P2PHUB_HAVE_NV_P2P
		ret = p2phub_nv_setup(reg, a.va, a.length);
#else
		ret = -EOPNOTSUPP;
#endif
	}
	if (ret)
		goto err_put_reg;

	if (pdev) {
		map = p2phub_reg_map_get(reg, pdev);
		if (IS_ERR(map)) {
			ret = PTR_ERR(map);
			goto err_put_reg;
		}
		p2phub_reg_map_put(reg, map, false);	/* cached until teardown */
	}

	/* Publish: the handle becomes visible to the file's other users. */
	mutex_lock(&pf->lock);
	if (reg->length > p2phub_max_reg_bytes() - min(pf->reg_bytes,
						       p2phub_max_reg_bytes()))
		ret = -ENOSPC;
	else
		ret = xa_alloc(&pf->regs, &handle, reg,
			       XA_LIMIT(1, P2PHUB_MAX_REGS_PER_FILE),
			       GFP_KERNEL_ACCOUNT);
	if (!ret) {
		reg->handle = handle;
		pf->reg_bytes += reg->length;
	}
	mutex_unlock(&pf->lock);
	if (ret) {
		ret = ret == -EBUSY ? -ENOSPC : ret;
		goto err_put_reg;
	}

	a.out_handle = handle;
	a.out_page_size = p2phub_reg_page_size(reg);
	a.out_provider = reg->provider->id;
	if (copy_to_user(uarg, &a, sizeof(a))) {
		/* Take the handle back, unless a racing UNREGISTER did. */
		mutex_lock(&pf->lock);
		if (xa_load(&pf->regs, handle) == reg &&
		    p2phub_reg_kill(reg, false)) {
			xa_erase(&pf->regs, handle);
			pf->reg_bytes -= reg->length;
		} else
			reg = NULL;
		mutex_unlock(&pf->lock);
		ret = -EFAULT;
		if (!reg)
			goto err_put_pdev;
		goto err_put_reg;
	}
	pci_dev_put(pdev);
	return 0;

err_put_reg:
	p2phub_reg_put(reg);		/* releases whatever was set up */
err_put_pdev:
	pci_dev_put(pdev);
	return ret;
}

static long p2phub_ioctl_unregister(struct p2phub_file *pf, void __user *uarg)
{
	struct p2phub_unregister a;
	struct p2phub_reg *reg;
	int ret;

	ret = p2phub_copy_args(&a, sizeof(a), uarg, 0);
	if (ret)
		return ret;
	if (!p2phub_all_zero(a.reserved, sizeof(a.reserved)))
		return -EINVAL;
	if (!a.handle || a.handle > U32_MAX)
		return -ENOENT;

	mutex_lock(&pf->lock);
	reg = xa_load(&pf->regs, a.handle);
	if (!reg) {
		ret = -ENOENT;
	} else if (!p2phub_reg_kill(reg, false)) {
		ret = -EBUSY;
	} else {
		xa_erase(&pf->regs, a.handle);	/* its reference is ours now */
		pf->reg_bytes -= reg->length;
		ret = 0;
	}
	mutex_unlock(&pf->lock);
	if (ret)
		return ret;

	p2phub_reg_teardown(reg);
	p2phub_reg_put(reg);
	return 0;
}

static long p2phub_ioctl_reg_info(struct p2phub_file *pf, void __user *uarg)
{
	struct p2phub_reg_info a;
	struct p2phub_reg *reg;
	int ret;

	ret = p2phub_copy_args(&a, sizeof(a), uarg, 0);
	if (ret)
		return ret;
	if (!p2phub_outputs_zero(&a, out_state, out_flags) ||
	    !p2phub_all_zero(a.reserved, sizeof(a.reserved)))
		return -EINVAL;
	reg = p2phub_reg_get(pf, a.handle);
	if (IS_ERR(reg))
		return PTR_ERR(reg);

	a.out_flags = (reg->read_only ? P2PHUB_REG_INFO_F_READ_ONLY : 0) |
		      (reg->revocable ? P2PHUB_REG_INFO_F_REVOCABLE : 0);
	mutex_lock(&reg->lock);
	a.out_nr_devices = reg->nr_maps;
	a.out_nr_exports = reg->nr_exports;
	mutex_unlock(&reg->lock);
	spin_lock(&reg->state_lock);
	a.out_state = reg->state;
	a.out_generation = reg->generation;
	a.out_nr_attached = reg->export_attached;
	a.out_io_holds = reg->io_holds;
	spin_unlock(&reg->state_lock);
	a.out_provider = reg->provider->id;
	a.out_length = reg->length;
	a.out_page_size = p2phub_reg_page_size(reg);
	p2phub_reg_put(reg);

	if (copy_to_user(uarg, &a, sizeof(a)))
		return -EFAULT;
	return 0;
}

/*
 * Copy entries [first, first + n) of the list, in units of 1 << shift
 * (no larger than the registration's pages), to user space.
 */
static int p2phub_copy_addrs(const struct p2phub_dma_list *list, u32 shift,
			     u64 first, u32 n, u64 __user *uaddrs)
{
	u32 per_page = 1U << (list->page_shift - shift);
	u64 *buf;
	u32 done = 0;
	int ret = 0;

	buf = kmalloc_array(P2PHUB_COPY_CHUNK, sizeof(*buf), GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	while (done < n) {
		u32 i, chunk = min_t(u32, n - done, P2PHUB_COPY_CHUNK);

		for (i = 0; i < chunk; i++) {
			u64 idx = first + done + i;

			buf[i] = list->addrs[idx / per_page] +
				 ((idx % per_page) << shift);
		}
		if (copy_to_user(uaddrs + done, buf, chunk * sizeof(*buf))) {
			ret = -EFAULT;
			break;
		}
		done += chunk;
		cond_resched();
	}
	kfree(buf);
	return ret;
}

int p2phub_reg_copy_dma_pages(struct p2phub_reg *reg,
			      const struct p2phub_dma_list *list,
			      u32 page_size, u64 first, u32 count,
			      u64 __user *uaddrs, u64 *total)
{
	u32 shift, n;

	if (page_size && (!is_power_of_2(page_size) || page_size < SZ_4K))
		return -EINVAL;
	if (count > P2PHUB_DMA_PAGES_MAX)
		return -E2BIG;
	if (count && !uaddrs)
		return -EINVAL;
	shift = page_size ? ilog2(page_size) : list->page_shift;
	if (shift > list->page_shift)
		return -EINVAL;
	*total = reg->length >> shift;
	if (count && first >= *total)
		return -ERANGE;
	n = count ? min_t(u64, count, *total - first) : 0;
	return p2phub_copy_addrs(list, shift, first, n, uaddrs);
}

static long p2phub_ioctl_dma_pages(struct p2phub_file *pf, void __user *uarg)
{
	struct p2phub_dma_pages a;
	struct p2phub_dma_list list;
	struct p2phub_reg *reg;
	struct pci_dev *pdev;
	u64 total;
	int ret;

	ret = p2phub_copy_args(&a, sizeof(a), uarg, 0);
	if (ret)
		return ret;
	if (a.__reserved0 || !p2phub_all_zero(a.reserved, sizeof(a.reserved)) ||
	    a.out_total || a.out_generation)
		return -EINVAL;
	/*
	 * Mapping memory for a device of another driver and reading back bus
	 * addresses is an administrator's business; an NVMe controller's
	 * owner gets its addresses through P2PHUB_NVME_MAP_REG.
	 */
	if (!capable(CAP_SYS_ADMIN))
		return -EPERM;

	reg = p2phub_reg_get(pf, a.handle);
	if (IS_ERR(reg))
		return PTR_ERR(reg);
	pdev = p2phub_pci_get(a.domain, a.bus, a.devfn);
	if (!pdev) {
		ret = -ENODEV;
		goto out_put_reg;
	}

	ret = p2phub_reg_dma_pages(reg, pdev, &list);
	if (ret)
		goto out_put_pdev;
	/* Keep the map's address array from a racing UNREGISTER. */
	ret = p2phub_reg_io_begin(reg, list.generation);
	if (ret) {
		p2phub_reg_dma_pages_put(reg, &list, false);
		goto out_put_pdev;
	}
	ret = p2phub_reg_copy_dma_pages(reg, &list, a.page_size, a.first,
					a.count, u64_to_user_ptr(a.addrs),
					&total);
	p2phub_reg_io_end(reg);
	p2phub_reg_dma_pages_put(reg, &list, false);	/* cached until teardown */
	if (ret)
		goto out_put_pdev;
	/* Revoked while copying: what user space holds is already stale. */
	if (!p2phub_reg_live(reg, list.generation)) {
		ret = -ESTALE;
		goto out_put_pdev;
	}

	a.count = a.count ? min_t(u64, a.count, total - a.first) : 0;
	a.out_total = total;
	a.out_generation = list.generation;
	if (copy_to_user(uarg, &a, sizeof(a)))
		ret = -EFAULT;
out_put_pdev:
	pci_dev_put(pdev);
out_put_reg:
	p2phub_reg_put(reg);
	return ret;
}

static long p2phub_ioctl_export(struct p2phub_file *pf, void __user *uarg)
{
	struct p2phub_export a;
	struct p2phub_reg *reg;
	int ret;

	ret = p2phub_copy_args(&a, sizeof(a), uarg, P2PHUB_EXPORT_F_CLOEXEC);
	if (ret)
		return ret;
	if (!p2phub_all_zero(a.reserved, sizeof(a.reserved)))
		return -EINVAL;
	reg = p2phub_reg_get(pf, a.handle);
	if (IS_ERR(reg))
		return PTR_ERR(reg);
	ret = p2phub_export_create(reg, a.flags);	/* the fd, last */
	p2phub_reg_put(reg);
	return ret;
}

long p2phub_reg_ioctl(struct p2phub_file *pf, unsigned int cmd,
		      void __user *uarg)
{
	switch (cmd) {
	case P2PHUB_REGISTER:
		return p2phub_ioctl_register(pf, uarg);
	case P2PHUB_UNREGISTER:
		return p2phub_ioctl_unregister(pf, uarg);
	case P2PHUB_REG_INFO:
		return p2phub_ioctl_reg_info(pf, uarg);
	case P2PHUB_DMA_PAGES:
		return p2phub_ioctl_dma_pages(pf, uarg);
	case P2PHUB_EXPORT:
		return p2phub_ioctl_export(pf, uarg);
	default:
		return -ENOTTY;
	}
}

/* ------------------------------------------------------------- the ledger */

void p2phub_reg_file_init(struct p2phub_file *pf)
{
	xa_init_flags(&pf->regs, XA_FLAGS_ALLOC1);
}

/*
 * The file is closing (or its process died): every registration goes. One
 * still used by an importer or by in-kernel I/O is marked dead, its
 * importers are told, and its pin goes with its last reference.
 */
void p2phub_reg_file_release(struct p2phub_file *pf)
{
	struct p2phub_reg *reg;
	unsigned long handle;

	xa_for_each(&pf->regs, handle, reg) {
		xa_erase(&pf->regs, handle);
		if (p2phub_reg_kill(reg, true))
			p2phub_reg_teardown(reg);
		else
			p2phub_reg_queue_notify(reg);
		p2phub_reg_put(reg);
	}
	xa_destroy(&pf->regs);
}

/* -------------------------------------------------------------- module */

u64 p2phub_reg_caps(void)
{
	u64 caps = P2PHUB_CAP_DMABUF_IMPORT | P2PHUB_CAP_DMABUF_EXPORT;

#ifdef P2PHUB_HAVE_NV_P2P
	caps |= P2PHUB_CAP_NVIDIA_P2P_BUILT;
	if (p2phub_nv_live())
		caps |= P2PHUB_CAP_NVIDIA_P2P_LIVE;
#endif
	return caps;
}

int p2phub_reg_init(void)
{
	static const struct {
		const char *name;
		atomic_t *val;
	} counters[] = {
		{ "regs", &p2phub_stats.regs },
		{ "dev_maps", &p2phub_stats.dev_maps },
		{ "dmabuf_attachments", &p2phub_stats.dmabuf_attachments },
		{ "dmabuf_pins", &p2phub_stats.dmabuf_pins },
		{ "exports", &p2phub_stats.exports },
		{ "export_attachments", &p2phub_stats.export_attachments },
		{ "export_mmaps", &p2phub_stats.export_mmaps },
		{ "nv_page_tables", &p2phub_stats.nv_page_tables },
		{ "nv_dma_mappings", &p2phub_stats.nv_dma_mappings },
		{ "revocations", &p2phub_stats.revocations },
	};
	int i, ret;

	p2phub_reg_wq = alloc_workqueue("p2phub_reg", 0, 0);
	if (!p2phub_reg_wq)
		return -ENOMEM;
	ret = bus_register_notifier(&pci_bus_type, &p2phub_reg_pci_nb);
	if (ret) {
		destroy_workqueue(p2phub_reg_wq);
		return ret;
	}
	/* debugfs is best effort: counters are for tests and debugging. */
	p2phub_debugfs_dir = debugfs_create_dir(KBUILD_MODNAME, NULL);
	for (i = 0; i < ARRAY_SIZE(counters); i++)
		debugfs_create_atomic_t(counters[i].name, 0444,
					p2phub_debugfs_dir, counters[i].val);
	return 0;
}

void p2phub_reg_exit(void)
{
	/* Files and exported dma-bufs pin the module, so all are gone. */
	bus_unregister_notifier(&pci_bus_type, &p2phub_reg_pci_nb);
	destroy_workqueue(p2phub_reg_wq);
	debugfs_remove(p2phub_debugfs_dir);
	if (atomic_read(&p2phub_stats.regs))
		pr_err("leak: %d registrations at unload\n",
		       atomic_read(&p2phub_stats.regs));
}
