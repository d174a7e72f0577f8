// SPDX-License-Identifier: GPL-2.0-only
/*
 * p2phub as a dma-buf exporter: a registration, whatever pinned it (a
 * dma-buf import or the NVIDIA P2P API), handed out as a new dma-buf, so a
 * NIC can ibv_reg_dmabuf_mr() memory that came in through nvidia_p2p_*.
 *
 * Importers get bus addresses without struct pages: they must allow
 * peer-to-peer, must be attached to a PCI device (the registration is
 * mapped for it, with the IOMMU when there is one) and must be dynamic, so
 * that a revocation reaches them through move_notify.
 *
 * Revocation. When the owner takes the memory back (a dma-buf source's
 * move_notify, the NVIDIA free callback), the provider calls
 * p2phub_export_revoke_sync() before the source mapping goes away: every
 * export gets move_notify under its reservation lock, and the provider
 * waits until the fences its importers added there have signalled. Pinning
 * is therefore refused (-EOPNOTSUPP) when the registration is revocable: a
 * pinned importer promises nothing on move_notify. Without
 * CONFIG_DMABUF_MOVE_NOTIFY the dma-buf core pins every dynamic attachment
 * itself before each map; an importer's own pin is then seen at map time
 * (more pins than maps) and the map is refused instead.
 *
 * Read-only sources (the fd given to REGISTER was not open for writing)
 * give read-only exports: the file is O_RDONLY, writable mmaps are refused
 * and importers may map only DMA_TO_DEVICE (the device reads).
 *
 * mmap: where the source's memory has struct pages (a dma-buf source that
 * gives a vmap of its pages: vgem, udmabuf), the export can be mapped by
 * the CPU, so that a NIC without dma-buf MRs (soft-RoCE) can take a VA MR
 * on it: pin_user_pages() needs normal pages in a VMA that is neither
 * VM_PFNMAP nor VM_IO, which is what the source's own mapping (vgem's) is
 * not. The pages come from the source exporter's own CPU mapping
 * (dma_buf_vmap(), kept until teardown), never from an importer's
 * sg_table; faults insert them with vm_insert_page() into a VM_MIXEDMAP
 * VMA, with the caching of the exporter's own kernel mapping (vgem's is
 * write-combined: a write-back alias would break x86 PAT). Pages p2phub
 * cannot map itself (large folios, whose pages the exporter's vmap may not
 * name one by one; hugetlb; a caching it cannot read or reproduce; the page
 * cache of a file user space may truncate, such as udmabuf's memfd) are
 * mapped by the source exporter instead (dma_buf_mmap() of the window):
 * that VMA is the exporter's, as if the source fd had been mapped, and is
 * neither counted nor zapped by p2phub. Memory without pages (a GPU BAR
 * export, NVIDIA P2P, an I/O-memory vmap) and revocable memory refuse mmap
 * with -ENODEV.
 *
 * Page references: each PTE holds a reference on its page (taken by
 * vm_insert_page(), dropped by the zap or munmap), on top of the source's
 * vmap. A get_user_pages()/pin_user_pages() user, an RDMA MR in particular,
 * takes its own reference or pin on each page and keeps it after the VMA
 * is unmapped or zapped, until it lets go itself (ib_dereg_mr): p2phub
 * cannot take those back. The source's pages cannot be freed under any of
 * these references, only left unused.
 *
 * Each VMA counts as a user of the registration, like an attached
 * importer: UNREGISTER is refused with -EBUSY while one exists, and the
 * VMA holds the dma-buf file, hence the export and its reference on the
 * registration. When the registration stops being live (its file closed),
 * the notify work zaps every export's mappings under p2phub_reg.lock;
 * faults take that lock and check the state, so no PTE is inserted after
 * the zap.
 *
 * Locking: reg->exports and reg->nr_exports change under both
 * p2phub_reg.lock and p2phub_reg.state_lock; walks take state_lock only,
 * with a reference on each export's file (an export whose file count is
 * already zero is being released and is skipped), so an export's
 * dma_resv is never taken under p2phub_reg.lock.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/delay.h>
#include <linux/dma-buf.h>
#include <linux/dma-resv.h>
#include <linux/fs.h>
#include <linux/jiffies.h>
#include <linux/mm.h>
#include <linux/moduleparam.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>

#include "compat.h"
#include "p2phub_reg.h"

#define P2PHUB_EXPORT_MAX_SEG	SZ_1G	/* bytes per scatterlist entry */

struct p2phub_export_buf {
	struct list_head node;		/* on reg->exports: see the top */
	struct p2phub_reg *reg;		/* reference held */
	struct dma_buf *dmabuf;
};

/* attach->priv: one per importer attachment. */
struct p2phub_export_att {
	struct p2phub_reg_map *map;	/* lives until teardown */
	/* under the export's dma_resv */
	unsigned int pins;
	unsigned int maps;
};

static const struct dma_buf_ops p2phub_export_ops;

static bool p2phub_export_live(struct p2phub_reg *reg)
{
	return READ_ONCE(reg->state) == P2PHUB_REG_LIVE;
}

struct p2phub_reg *p2phub_export_reg(struct dma_buf *dmabuf)
{
	struct p2phub_export_buf *exp;

	if (dmabuf->ops != &p2phub_export_ops)
		return NULL;
	exp = dmabuf->priv;
	return exp->reg;
}

static int p2phub_export_attach(struct dma_buf *dmabuf,
				struct dma_buf_attachment *attach)
{
	struct p2phub_export_buf *exp = dmabuf->priv;
	struct p2phub_reg *reg = exp->reg;
	struct p2phub_export_att *att;
	struct p2phub_reg_map *map;
	int ret = 0;

	/* Bus addresses without pages, revocable: see the top of the file. */
	if (!attach->peer2peer || !attach->importer_ops ||
	    !dev_is_pci(attach->dev))
		return -EOPNOTSUPP;
	att = kzalloc(sizeof(*att), GFP_KERNEL_ACCOUNT);
	if (!att)
		return -ENOMEM;

	spin_lock(&reg->state_lock);
	if (reg->state != P2PHUB_REG_LIVE)
		ret = -ENODEV;
	else
		reg->export_attached++;
	spin_unlock(&reg->state_lock);
	if (ret)
		goto err_free;

	map = p2phub_reg_map_get(reg, to_pci_dev(attach->dev));
	if (IS_ERR(map)) {
		spin_lock(&reg->state_lock);
		reg->export_attached--;
		spin_unlock(&reg->state_lock);
		ret = PTR_ERR(map) == -ESTALE ? -ENODEV : PTR_ERR(map);
		goto err_free;
	}
	spin_lock(&reg->state_lock);
	map->importers++;		/* the hold is the attachment's now */
	spin_unlock(&reg->state_lock);
	att->map = map;
	attach->priv = att;
	atomic_inc(&p2phub_stats.export_attachments);
	return 0;

err_free:
	kfree(att);
	return ret;
}

/*
 * Called outside the export's dma_resv, by an importer or, for a
 * registration made from this export, under that one's p2phub_reg.lock
 * (class "derived", which nests outside ours).
 */
static void p2phub_export_detach(struct dma_buf *dmabuf,
				 struct dma_buf_attachment *attach)
{
	struct p2phub_export_buf *exp = dmabuf->priv;
	struct p2phub_export_att *att = attach->priv;
	struct p2phub_reg *reg = exp->reg;

	/*
	 * Attached, the registration is not torn down: the map is there.
	 * The importer stopped using it; its device keeps no address of it
	 * once the last hold goes (unmapped and flushed then), as if it had
	 * mapped the registration itself. export_attached goes last, so
	 * UNREGISTER stays refused until that is done.
	 */
	p2phub_reg_map_put_importer(reg, att->map);
	spin_lock(&reg->state_lock);
	if (!WARN_ON_ONCE(!reg->export_attached))
		reg->export_attached--;
	spin_unlock(&reg->state_lock);
	kfree(attach->priv);
	attach->priv = NULL;
	atomic_dec(&p2phub_stats.export_attachments);
}

/* Under the export's dma_resv. */
static int p2phub_export_pin(struct dma_buf_attachment *attach)
{
	struct p2phub_export_buf *exp = attach->dmabuf->priv;
	struct p2phub_export_att *att = attach->priv;

	/* With MOVE_NOTIFY the core never pins for us: this is the importer. */
	if (P2PHUB_DMA_BUF_MOVE_NOTIFY && exp->reg->revocable)
		return -EOPNOTSUPP;
	att->pins++;
	return 0;
}

static void p2phub_export_unpin(struct dma_buf_attachment *attach)
{
	struct p2phub_export_att *att = attach->priv;

	if (!WARN_ON_ONCE(!att->pins))
		att->pins--;
}

static struct sg_table *p2phub_export_map(struct dma_buf_attachment *attach,
					  enum dma_data_direction dir)
{
	struct p2phub_export_buf *exp = attach->dmabuf->priv;
	struct p2phub_export_att *att = attach->priv;
	struct p2phub_reg_map *map = att->map;
	struct p2phub_reg *reg = exp->reg;
	size_t ps = p2phub_reg_page_size(reg);
	struct scatterlist *sg;
	struct sg_table *sgt;
	unsigned int nsegs = 1;
	dma_addr_t start;
	u64 i, len;
	int ret;

	if (!p2phub_export_live(reg))
		return ERR_PTR(-ENODEV);
	if (reg->read_only && dir != DMA_TO_DEVICE)
		return ERR_PTR(-EACCES);
	/*
	 * Without MOVE_NOTIFY the core pinned once for this map; a pin more
	 * than the maps is the importer's own, refused for revocable memory.
	 */
	if (!P2PHUB_DMA_BUF_MOVE_NOTIFY && reg->revocable &&
	    att->pins > att->maps + 1)
		return ERR_PTR(-EOPNOTSUPP);

	/* One entry per run of contiguous DMA addresses. */
	for (i = 1, len = ps; i < reg->npages; i++, len += ps) {
		if (map->addrs[i] != map->addrs[i - 1] + ps ||
		    len + ps > P2PHUB_EXPORT_MAX_SEG) {
			nsegs++;
			len = 0;
		}
	}
	sgt = kzalloc(sizeof(*sgt), GFP_KERNEL_ACCOUNT);
	if (!sgt)
		return ERR_PTR(-ENOMEM);
	ret = sg_alloc_table(sgt, nsegs, GFP_KERNEL_ACCOUNT);
	if (ret)
		goto err_free_sgt;

	sg = sgt->sgl;
	start = map->addrs[0];
	for (i = 1, len = ps; i <= reg->npages; i++, len += ps) {
		if (i < reg->npages && map->addrs[i] == map->addrs[i - 1] + ps &&
		    len + ps <= P2PHUB_EXPORT_MAX_SEG)
			continue;
		/* No page behind the address: importers use the DMA side only. */
		sg_set_page(sg, NULL, 0, 0);
		sg_dma_address(sg) = start;
		sg_dma_len(sg) = len;
		sg = sg_next(sg);
		if (i < reg->npages) {
			start = map->addrs[i];
			len = 0;
		}
	}
	att->maps++;
	return sgt;

err_free_sgt:
	kfree(sgt);
	return ERR_PTR(ret);
}

static void p2phub_export_unmap(struct dma_buf_attachment *attach,
				struct sg_table *sgt,
				enum dma_data_direction dir)
{
	struct p2phub_export_att *att = attach->priv;

	if (!WARN_ON_ONCE(!att->maps))
		att->maps--;
	sg_free_table(sgt);
	kfree(sgt);
}

static void p2phub_export_release(struct dma_buf *dmabuf)
{
	struct p2phub_export_buf *exp = dmabuf->priv;
	struct p2phub_reg *reg = exp->reg;

	mutex_lock(&reg->lock);
	spin_lock(&reg->state_lock);
	list_del(&exp->node);
	reg->nr_exports--;
	spin_unlock(&reg->state_lock);
	mutex_unlock(&reg->lock);
	kfree(exp);
	atomic_dec(&p2phub_stats.exports);
	p2phub_reg_put(reg);	/* may release the pin */
}

/* ------------------------------------------------------------------ mmap */

static void p2phub_export_vm_open(struct vm_area_struct *vma)
{
	struct p2phub_export_buf *exp = vma->vm_private_data;
	struct p2phub_reg *reg = exp->reg;

	/* A split or a fork: one more VMA, counted whatever the state. */
	spin_lock(&reg->state_lock);
	reg->export_mmaps++;
	spin_unlock(&reg->state_lock);
	atomic_inc(&p2phub_stats.export_mmaps);
}

static void p2phub_export_vm_close(struct vm_area_struct *vma)
{
	struct p2phub_export_buf *exp = vma->vm_private_data;
	struct p2phub_reg *reg = exp->reg;

	spin_lock(&reg->state_lock);
	if (!WARN_ON_ONCE(!reg->export_mmaps))
		reg->export_mmaps--;
	spin_unlock(&reg->state_lock);
	atomic_dec(&p2phub_stats.export_mmaps);
}

static vm_fault_t p2phub_export_vm_fault(struct vm_fault *vmf)
{
	struct vm_area_struct *vma = vmf->vma;
	struct p2phub_export_buf *exp = vma->vm_private_data;
	struct p2phub_reg *reg = exp->reg;
	struct page **pages = NULL;
	vm_fault_t ret = VM_FAULT_SIGBUS;
	bool wc;
	int err;

	/* Serialized with the zap in p2phub_export_notify(). */
	mutex_lock(&reg->lock);
	if (reg->torn_down || !p2phub_export_live(reg) ||
	    vmf->pgoff >= reg->npages)
		goto out_unlock;
	err = reg->provider->cpu_pages(reg, &pages, &wc);
	if (err) {
		ret = err == -ENOMEM ? VM_FAULT_OOM : VM_FAULT_SIGBUS;
		goto out_unlock;
	}
	err = vm_insert_page(vma, vmf->address & PAGE_MASK, pages[vmf->pgoff]);
	if (!err || err == -EBUSY)	/* -EBUSY: another fault won */
		ret = VM_FAULT_NOPAGE;
	else if (err == -ENOMEM)
		ret = VM_FAULT_OOM;
out_unlock:
	mutex_unlock(&reg->lock);
	return ret;
}

static const struct vm_operations_struct p2phub_export_vm_ops = {
	.open	= p2phub_export_vm_open,
	.close	= p2phub_export_vm_close,
	.fault	= p2phub_export_vm_fault,
};

/*
 * Called with the mm's mmap_lock held for write (and, on 6.2-6.4, the
 * export's dma_resv: see compat.h). The dma-buf core checked the range
 * against the buffer's size; the registration's length is the same, but
 * check it here too, so the fault handler's index is known to be sound.
 */
static int p2phub_export_mmap(struct dma_buf *dmabuf,
			      struct vm_area_struct *vma)
{
	struct p2phub_export_buf *exp = dmabuf->priv;
	struct p2phub_reg *reg = exp->reg;
	unsigned long npages = vma_pages(vma);
	struct page **pages = NULL;
	bool wc = false;
	u64 end;
	int ret;

	/* VM_MAYSHARE: MAP_SHARED of a read-only file has no VM_SHARED. */
	if (!(vma->vm_flags & VM_MAYSHARE))
		return -EINVAL;		/* a private (COW) copy makes no sense */
	if (check_add_overflow((u64)vma->vm_pgoff, (u64)npages, &end) ||
	    end > reg->length >> PAGE_SHIFT)
		return -EINVAL;
	if (reg->read_only && (vma->vm_flags & VM_WRITE))
		return -EACCES;
	if (!reg->provider->cpu_pages || reg->page_shift != PAGE_SHIFT ||
	    reg->revocable) {
		pr_info_ratelimited("registration %u (%s): memory without struct pages, or revocable; its export cannot be mmapped\n",
				    reg->handle, reg->provider->name);
		return -ENODEV;
	}
	/*
	 * DONTEXPAND: mremap cannot grow it past what was checked above,
	 * whoever maps it (an exporter below maps only the window).
	 */
	p2phub_vm_flags_set(vma, VM_DONTEXPAND | VM_DONTDUMP);
	if (reg->read_only)
		p2phub_vm_flags_clear(vma, VM_MAYWRITE);

	mutex_lock(&reg->lock);
	if (reg->torn_down || !p2phub_export_live(reg)) {
		ret = -ENODEV;
		goto out_unlock;
	}
	/* Learn the pages now, so that memory without them fails here. */
	ret = reg->provider->cpu_pages(reg, &pages, &wc);
	if (ret)
		goto out_unlock;

	/*
	 * VM_MIXEDMAP: PTEs of normal, refcounted pages that GUP accepts
	 * (not VM_PFNMAP, not VM_IO), with the exporter's caching.
	 */
	p2phub_vm_flags_set(vma, VM_MIXEDMAP);
	if (wc)
		vma->vm_page_prot = pgprot_writecombine(vma->vm_page_prot);
	vma->vm_ops = &p2phub_export_vm_ops;
	vma->vm_private_data = exp;
	p2phub_export_vm_open(vma);	/* the core calls open only on copies */
out_unlock:
	mutex_unlock(&reg->lock);
	/* Pages only the exporter can map: it maps the window itself. */
	if (ret == -EREMOTE)
		ret = reg->provider->mmap ? reg->provider->mmap(reg, vma) : -ENODEV;
	return ret;
}

static const struct dma_buf_ops p2phub_export_ops = {
	.attach		= p2phub_export_attach,
	.detach		= p2phub_export_detach,
	.pin		= p2phub_export_pin,
	.unpin		= p2phub_export_unpin,
	.map_dma_buf	= p2phub_export_map,
	.unmap_dma_buf	= p2phub_export_unmap,
	.mmap		= p2phub_export_mmap,
	.release	= p2phub_export_release,
};

/* Export @reg as a new dma-buf; returns its fd. */
int p2phub_export_create(struct p2phub_reg *reg, u32 flags)
{
	DEFINE_DMA_BUF_EXPORT_INFO(exp_info);
	struct p2phub_export_buf *exp;
	struct dma_buf *dmabuf;
	int fd, ret;

	if (!p2phub_export_live(reg))
		return -ESTALE;
	exp = kzalloc(sizeof(*exp), GFP_KERNEL_ACCOUNT);
	if (!exp)
		return -ENOMEM;
	p2phub_reg_get_ref(reg);
	exp->reg = reg;
	INIT_LIST_HEAD(&exp->node);

	exp_info.ops = &p2phub_export_ops;
	exp_info.size = reg->length;
	/* The same access as the fd the memory came in through. */
	exp_info.flags = reg->read_only ? O_RDONLY : O_RDWR;
	exp_info.priv = exp;
	dmabuf = dma_buf_export(&exp_info);
	if (IS_ERR(dmabuf)) {
		ret = PTR_ERR(dmabuf);
		goto err_put_reg;
	}
	exp->dmabuf = dmabuf;
	atomic_inc(&p2phub_stats.exports);
	mutex_lock(&reg->lock);
	spin_lock(&reg->state_lock);
	list_add_tail(&exp->node, &reg->exports);
	reg->nr_exports++;
	spin_unlock(&reg->state_lock);
	mutex_unlock(&reg->lock);

	fd = dma_buf_fd(dmabuf, flags & P2PHUB_EXPORT_F_CLOEXEC ? O_CLOEXEC : 0);
	if (fd < 0)
		dma_buf_put(dmabuf);	/* release() frees exp, drops the ref */
	return fd;

err_put_reg:
	p2phub_reg_put(reg);
	kfree(exp);
	return ret;
}

/*
 * The files of @reg's exports, each with a reference (fput() them), in a
 * kvmalloc()ed array; *n is set to how many. NULL (and *n 0) when there
 * are none or on allocation failure (then nobody is told: logged).
 */
struct file **p2phub_export_files(struct p2phub_reg *reg, unsigned int *n,
				  gfp_t gfp)
{
	struct p2phub_export_buf *exp;
	struct file **files;
	unsigned int cap, i;

	*n = 0;
	for (;;) {
		cap = READ_ONCE(reg->nr_exports);
		if (!cap)
			return NULL;
		files = kvmalloc_array(cap, sizeof(*files), gfp);
		if (!files) {
			pr_err_ratelimited("registration %u: no memory to notify %u export(s)\n",
					   reg->handle, cap);
			return NULL;
		}
		spin_lock(&reg->state_lock);
		if (reg->nr_exports > cap) {
			spin_unlock(&reg->state_lock);
			kvfree(files);
			continue;	/* grew meanwhile */
		}
		i = 0;
		list_for_each_entry(exp, &reg->exports, node) {
			struct file *file = exp->dmabuf->file;

			/* Count zero: on its way out, its inode maybe gone. */
			if (p2phub_file_get_unless_zero(file))
				files[i++] = file;
		}
		spin_unlock(&reg->state_lock);
		*n = i;
		return files;
	}
}

void p2phub_export_files_put(struct file **files, unsigned int n)
{
	unsigned int i;

	for (i = 0; i < n; i++)
		fput(files[i]);
	kvfree(files);
}

static void p2phub_export_move_notify(struct dma_buf *dmabuf)
{
	dma_resv_lock(dmabuf->resv, NULL);
	p2phub_dma_buf_invalidate(dmabuf);
	dma_resv_unlock(dmabuf->resv);
}

static unsigned int revoke_wait_ms = 10000;
module_param(revoke_wait_ms, uint, 0644);
MODULE_PARM_DESC(revoke_wait_ms,
		 "How long a revocation waits for the importers of a registration's exports to finish, in ms, before the memory is taken from them anyway (default 10000)");

/*
 * move_notify with the export's resv taken by trylock only, retried until
 * @deadline: this runs before a revocation fence signals, and an importer
 * may hold that resv while it waits for the fence (a blocking lock, which
 * no ww ctx can back off from a fence wait, would never return then).
 */
static bool p2phub_export_move_notify_until(struct dma_buf *dmabuf,
					    unsigned long deadline)
{
	while (!dma_resv_trylock(dmabuf->resv)) {
		if (time_after(jiffies, deadline))
			return false;
		usleep_range(500, 1000);
	}
	p2phub_dma_buf_invalidate(dmabuf);
	dma_resv_unlock(dmabuf->resv);
	return true;
}

void p2phub_export_revoke_files(struct p2phub_reg *reg, struct file **files,
				unsigned int n)
{
	unsigned long deadline = jiffies +
				 msecs_to_jiffies(READ_ONCE(revoke_wait_ms));
	unsigned int i;

	for (i = 0; i < n; i++) {
		if (!p2phub_export_move_notify_until(files[i]->private_data,
						     deadline))
			pr_warn_ratelimited("registration %u: an importer of its export held the export's reservation for %u ms; revoking without telling it\n",
					    reg->handle, READ_ONCE(revoke_wait_ms));
	}
	/*
	 * Importers add a fence for what their devices still do; wait for it,
	 * but not for ever: this can run inside NVIDIA's free callback, under
	 * the lock every NVIDIA release takes. An importer still busy at the
	 * deadline loses the memory anyway (its device faults on the IOMMU).
	 */
	for (i = 0; i < n; i++) {
		struct dma_buf *dmabuf = files[i]->private_data;
		long left = max_t(long, (long)(deadline - jiffies), 0);

		if (dma_resv_wait_timeout(dmabuf->resv, DMA_RESV_USAGE_BOOKKEEP,
					  false, left) <= 0)
			pr_warn_ratelimited("registration %u: an importer of its export is still busy after %u ms; revoking anyway\n",
					    reg->handle, READ_ONCE(revoke_wait_ms));
	}
}

void p2phub_export_revoke_sync(struct p2phub_reg *reg)
{
	unsigned int n;
	struct file **files = p2phub_export_files(reg, &n, GFP_KERNEL);

	p2phub_export_revoke_files(reg, files, n);
	p2phub_export_files_put(files, n);
}

/*
 * Tell the importers of every export of @reg that its memory is gone
 * (revoked, unregistered or closed), and take away CPU mappings of the
 * exports. Runs from a work item, so it never nests inside another
 * dma-buf's reservation lock.
 */
void p2phub_export_notify(struct p2phub_reg *reg)
{
	unsigned int i, n;
	struct file **files = p2phub_export_files(reg, &n, GFP_KERNEL);

	for (i = 0; i < n; i++)
		p2phub_export_move_notify(files[i]->private_data);
	mutex_lock(&reg->lock);
	for (i = 0; i < n; i++) {
		/*
		 * Each dma-buf has its own inode (alive: we hold its file),
		 * so this reaches exactly the VMAs of this export. Under
		 * reg->lock, after the state left LIVE: a fault either
		 * inserted before (zapped now) or sees the state and fails
		 * with SIGBUS.
		 */
		unmap_mapping_range(files[i]->f_mapping, 0, 0, 1);
	}
	mutex_unlock(&reg->lock);
	p2phub_export_files_put(files, n);
}
