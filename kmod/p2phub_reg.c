// SPDX-License-Identifier: GPL-2.0-only
/*
 * Registrations: their lifetime, what they are charged, the per-file ledger
 * and the leak counters in debugfs. The per-device maps are in
 * p2phub_regmap.c, the registration ioctls in p2phub_reg_ioctl.c.
 *
 * A registration is LIVE until its owner revokes the memory (REVOKED) or
 * user space lets go of it (DEAD). Its pin is released exactly once, by
 * p2phub_reg_teardown(); its struct goes with the last reference.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/capability.h>
#include <linux/cred.h>
#include <linux/debugfs.h>
#include <linux/moduleparam.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/xarray.h>

#include "p2phub_reg.h"
#include "p2phub_regmap.h"
#include "compat.h"

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

struct p2phub_reg *p2phub_reg_alloc(void)
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
	p2phub_regmap_track(reg);
	return reg;
}

static unsigned int max_pinned_gib_per_user;
module_param(max_pinned_gib_per_user, uint, 0644);
MODULE_PARM_DESC(max_pinned_gib_per_user,
		 "Bytes one user (the effective uid that opened /dev/p2phub) may have pinned through all its registrations, in all its processes, in GiB; 0: the registering process's RLIMIT_MEMLOCK (default 0). CAP_IPC_LOCK lifts it");

/*
 * Pages pinned per user (an xa value), under p2phub_pinned_lock (nests in
 * nothing, takes nothing). RLIMIT_MEMLOCK is charged per mm, and
 * registrations outlive their mm: forked children on one inherited fd each
 * start from zero. This ledger sums them all, keyed on the effective uid
 * that opened the file (p2phub_file.uid), as io_uring charges the user that
 * created the ring: a process that shares the fd and changes its uid (in a
 * user namespace of its own, say) still draws on the opener's budget.
 */
static DEFINE_MUTEX(p2phub_pinned_lock);
static DEFINE_XARRAY(p2phub_pinned_users);

/* Add @pages to @uid's pinned pages; -EDQUOT past @limit (0: none). */
static int p2phub_uid_charge(kuid_t uid, unsigned long pages,
			     unsigned long limit, unsigned long *had)
{
	void *entry;
	int ret;

	mutex_lock(&p2phub_pinned_lock);
	entry = xa_load(&p2phub_pinned_users, __kuid_val(uid));
	*had = entry ? xa_to_value(entry) : 0;
	if (limit && (pages > limit || *had > limit - pages))
		ret = -EDQUOT;
	else
		ret = xa_err(xa_store(&p2phub_pinned_users, __kuid_val(uid),
				      xa_mk_value(*had + pages),
				      GFP_KERNEL_ACCOUNT));
	mutex_unlock(&p2phub_pinned_lock);
	return ret;
}

static void p2phub_uid_uncharge(kuid_t uid, unsigned long pages)
{
	unsigned long n;
	void *entry;

	mutex_lock(&p2phub_pinned_lock);
	entry = xa_load(&p2phub_pinned_users, __kuid_val(uid));
	n = entry ? xa_to_value(entry) : 0;
	if (WARN_ON_ONCE(n < pages) || n == pages)
		xa_erase(&p2phub_pinned_users, __kuid_val(uid));
	else	/* replaces a present entry: allocates nothing, cannot fail */
		xa_store(&p2phub_pinned_users, __kuid_val(uid),
			 xa_mk_value(n - pages), GFP_KERNEL);
	mutex_unlock(&p2phub_pinned_lock);
}

/*
 * The per-user half of the charge: the pages of every registration made
 * through any file @uid opened, against max_pinned_gib_per_user, or when
 * that is 0 against the caller's RLIMIT_MEMLOCK. -EDQUOT over it.
 */
static int p2phub_reg_charge_uid(struct p2phub_reg *reg, kuid_t uid,
				 unsigned long pages)
{
	unsigned int gib = READ_ONCE(max_pinned_gib_per_user);
	unsigned long limit, had;
	int ret;

	limit = gib ? (unsigned long)gib << (30 - PAGE_SHIFT) :
		      rlimit(RLIMIT_MEMLOCK) >> PAGE_SHIFT;
	ret = p2phub_uid_charge(uid, pages, limit, &had);
	if (ret == -EDQUOT && capable(CAP_IPC_LOCK))
		ret = p2phub_uid_charge(uid, pages, 0, &had);
	if (ret == -EDQUOT)
		pr_info_ratelimited("pid %d (%s): REGISTER of %llu bytes refused: uid %u (the opener of the file) has %lu KiB pinned through p2phub in all its processes, the limit is %lu KiB (%s); close registrations, raise it or grant CAP_IPC_LOCK\n",
				    task_pid_nr(current), current->comm,
				    reg->length, from_kuid_munged(&init_user_ns, uid),
				    had << (PAGE_SHIFT - 10),
				    limit << (PAGE_SHIFT - 10),
				    gib ? "module parameter max_pinned_gib_per_user" :
					  "RLIMIT_MEMLOCK, summed over the user's processes");
	if (ret)
		return ret;
	reg->acct_uid = uid;
	reg->acct_uid_pages = pages;
	return 0;
}

/*
 * Charge @reg's pages to the caller's pinned_vm (VmPin in /proc/PID/status)
 * against RLIMIT_MEMLOCK, as RDMA memory registrations are, and to the
 * user that opened @pf (p2phub_reg_charge_uid()); CAP_IPC_LOCK lifts the
 * limits, not the charges. The mm is kept (mmgrab) so that the same mm is
 * uncharged at teardown, whichever task or work item does it. -ENOMEM over
 * the mm's limit, -EDQUOT over the user's.
 */
int p2phub_reg_charge(struct p2phub_reg *reg, const struct p2phub_file *pf)
{
	struct mm_struct *mm = current->mm;
	unsigned long pages, limit;
	s64 pinned;
	int ret;

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
	ret = p2phub_reg_charge_uid(reg, pf->uid, pages);
	if (ret) {
		atomic64_sub(pages, &mm->pinned_vm);
		return ret;
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
	p2phub_uid_uncharge(reg->acct_uid, reg->acct_uid_pages);
	atomic64_sub(reg->acct_pages, &reg->acct_mm->pinned_vm);
	mmdrop(reg->acct_mm);
	reg->acct_mm = NULL;
}

/* Release the pin and every device mapping, once. Sleeps. */
void p2phub_reg_teardown(struct p2phub_reg *reg)
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

	p2phub_regmap_untrack(reg);
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

/* Mark @reg dead; false (and nothing done) while someone still uses it. */
bool p2phub_reg_kill(struct p2phub_reg *reg, bool force)
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

	p2phub_reg_wq = alloc_workqueue("p2phub_reg", P2PHUB_WQ_PERCPU, 0);
	if (!p2phub_reg_wq)
		return -ENOMEM;
	ret = p2phub_regmap_init();
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
	p2phub_regmap_exit();
	destroy_workqueue(p2phub_reg_wq);
	debugfs_remove(p2phub_debugfs_dir);
	if (atomic_read(&p2phub_stats.regs))
		pr_err("leak: %d registrations at unload\n",
		       atomic_read(&p2phub_stats.regs));
}
