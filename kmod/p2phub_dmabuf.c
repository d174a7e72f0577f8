// SPDX-License-Identifier: GPL-2.0-only
/*
 * The dma-buf pin provider: p2phub as a dynamic, peer-to-peer capable
 * importer. Each PCI device that asks gets its own attachment, pinned and
 * mapped by the exporter for that device (so the addresses are what the
 * device must use, IOVAs included). Works for exporters backed by struct
 * pages (vgem, udmabuf) and for exporters of bus addresses (GPU BARs),
 * which only attach importers that allow peer-to-peer.
 *
 * move_notify means the exporter takes the memory away (a pinned buffer
 * never moves for any other reason). The registration is revoked first,
 * which stops the NVMe controllers that use it (bus mastering off). A
 * device mapping that no importer of an export uses is then unmapped at
 * once, in move_notify, under the resv. For the others the dma-buf rule
 * applies to the importers of the exports: their mappings stay valid until
 * their fences signal. So a fence is added to the source's resv
 * (DMA_RESV_USAGE_BOOKKEEP), and a work item tells the importers of every
 * export (p2phub_export_revoke_sync(): move_notify, then wait for their
 * fences), unmaps, and only then signals. No address the fence covers is
 * reachable once it has signalled, except when the exporter holds its resv
 * while it waits for the fence (TTM eviction does): the work cannot take
 * the resv then, signals (the importers are done) and unmaps right after,
 * with a log line.
 *
 * A source that is one of p2phub's own exports is registered as what it
 * exports: the new registration imports the export of the first
 * registration in the chain that did not come from such an export (window
 * offsets added up), so a device map nests at most one registration lock
 * in another (lock class "derived" -> plain), however long the chain.
 *
 * A source fd not open for writing makes a read-only registration: mapped
 * DMA_TO_DEVICE (with an IOMMU the device cannot write), exports read-only.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/dma-buf.h>
#include <linux/dma-direct.h>
#include <linux/dma-map-ops.h>
#include <linux/dma-fence.h>
#include <linux/dma-resv.h>
#include <linux/hugetlb.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/overflow.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/vmalloc.h>

#include "compat.h"
#include "p2phub_dmabuf_cpu.h"
#include "p2phub_reg.h"

P2PHUB_IMPORT_NS_DMA_BUF();

/* A revocation in progress: its fence sits in the source's resv. */
struct p2phub_db_revoke {
	struct dma_fence base;		/* first: dma_fence_free() frees it all */
	spinlock_t lock;
	struct work_struct work;
	struct p2phub_reg *reg;		/* reference held by the work */
	/* The exports to tell, collected before the fence is published. */
	struct file **files;
	unsigned int nfiles;
};

static const char *p2phub_db_revoke_driver(struct dma_fence *f)
{
	return KBUILD_MODNAME;
}

static const char *p2phub_db_revoke_timeline(struct dma_fence *f)
{
	return "revocation";
}

/*
 * The fence stays in the source's resv after it signalled, for as long as
 * the exporter keeps it there: its ops are p2phub's, so each fence holds a
 * module reference, dropped here, when the last reference to it goes.
 */
static void p2phub_db_revoke_release(struct dma_fence *f)
{
	dma_fence_free(f);
	module_put(THIS_MODULE);
}

static const struct dma_fence_ops p2phub_db_revoke_ops = {
	.get_driver_name = p2phub_db_revoke_driver,
	.get_timeline_name = p2phub_db_revoke_timeline,
	.release = p2phub_db_revoke_release,
};

static enum dma_data_direction p2phub_dmabuf_dir(struct p2phub_reg *reg)
{
	return reg->read_only ? DMA_TO_DEVICE : DMA_BIDIRECTIONAL;
}

/* Unmap every device map still mapped. Source resv held. */
static void p2phub_dmabuf_unmap_all(struct p2phub_reg *reg)
{
	struct p2phub_reg_map *map;

	lockdep_assert_held(&reg->lock);
	dma_resv_assert_held(reg->db.dmabuf->resv);
	list_for_each_entry(map, &reg->maps, node) {
		if (!map->db.sgt)
			continue;
		dma_buf_unmap_attachment(map->db.attach, map->db.sgt,
					 p2phub_dmabuf_dir(reg));
		map->db.sgt = NULL;
		/* Before the fence lets the exporter move the memory. */
		p2phub_flush_iotlb(&map->pdev->dev);
	}
}

static void p2phub_dmabuf_revoke_work(struct work_struct *work)
{
	struct p2phub_db_revoke *rv = container_of(work, struct p2phub_db_revoke,
						   work);
	struct p2phub_reg *reg = rv->reg;
	bool unmapped = false;
	bool cookie;

	/*
	 * From here to the signal, the dma-fence rules hold: no allocation
	 * that may reclaim, no lock a fence waiter may hold taken blocking.
	 * The devices stopped in p2phub_reg_revoke(); now the importers.
	 */
	cookie = dma_fence_begin_signalling();
	p2phub_export_revoke_files(reg, rv->files, rv->nfiles);

	/*
	 * Nobody uses the mappings any more: drop them before the fence
	 * signals, so that no address it covers is reachable once the
	 * exporter reuses the memory. Only by trylock: an exporter may hold
	 * its resv while it waits for this fence, and p2phub_reg.lock
	 * holders may wait for that resv. reg->db.dmabuf is read only under
	 * reg->lock and before teardown (release clears it).
	 */
	if (mutex_trylock(&reg->lock)) {
		if (reg->torn_down) {
			unmapped = true;	/* release unmaps */
		} else if (dma_resv_trylock(reg->db.dmabuf->resv)) {
			p2phub_dmabuf_unmap_all(reg);
			dma_resv_unlock(reg->db.dmabuf->resv);
			unmapped = true;
		}
		mutex_unlock(&reg->lock);
	}
	dma_fence_signal(&rv->base);	/* the exporter may move it now */
	dma_fence_end_signalling(cookie);
	p2phub_export_files_put(rv->files, rv->nfiles);
	rv->files = NULL;

	if (!unmapped) {
		mutex_lock(&reg->lock);
		if (!reg->torn_down) {		/* else release unmaps */
			pr_info_ratelimited("registration %u: exporter %s held its reservation across the revocation; mappings went after its fence\n",
					    reg->handle, reg->db.dmabuf->exp_name);
			dma_resv_lock(reg->db.dmabuf->resv, NULL);
			p2phub_dmabuf_unmap_all(reg);
			dma_resv_unlock(reg->db.dmabuf->resv);
		}
		mutex_unlock(&reg->lock);
	}
	dma_fence_put(&rv->base);
	p2phub_reg_put(reg);
}

/*
 * Called under the source's resv for each of our attachments, mapped or
 * not (e.g. while pinning), when the exporter takes the memory back.
 * The devices that use the registration are stopped first; a mapping no
 * importer of an export uses is then dropped at once, here. The others
 * (importers of exports may use them until their fences signal) stay until
 * the revocation work has told and waited for those importers; a fence in
 * the source's resv holds the exporter back until then.
 */
static void p2phub_dmabuf_move_notify(struct dma_buf_attachment *attach)
{
	struct p2phub_reg_map *map = attach->importer_priv;
	struct dma_resv *resv = attach->dmabuf->resv;
	struct p2phub_reg *reg = map->reg;
	struct p2phub_db_revoke *rv;
	bool releasing = false;
	bool in_use;

	dma_resv_assert_held(resv);
	if (map->db.mapping || !map->db.sgt)
		return;
	/* First: the devices that use the registration stop. */
	p2phub_reg_revoke(reg, "dma-buf move_notify");
	spin_lock(&reg->state_lock);
	in_use = map->importers;
	spin_unlock(&reg->state_lock);
	if (!in_use) {
		/* Stopped, or never told an address: unmap now. */
		dma_buf_unmap_attachment(attach, map->db.sgt,
					 p2phub_dmabuf_dir(reg));
		map->db.sgt = NULL;
		p2phub_flush_iotlb(&map->pdev->dev);
		return;
	}
	if (reg->db.revoke)
		return;		/* this revocation's fence is in place */

	/*
	 * move_notify may run in the exporter's own fence-signalling path
	 * (an eviction): allocate without reclaim, and fall back below.
	 */
	rv = kzalloc(sizeof(*rv), GFP_NOWAIT | __GFP_NOWARN | __GFP_ACCOUNT);
	if (!rv || dma_resv_reserve_fences(resv, 1))
		goto err_unmap_now;
	/* Each export's file, so that the work allocates nothing. */
	rv->files = p2phub_export_files(reg, &rv->nfiles,
					GFP_NOWAIT | __GFP_NOWARN);
	if (!rv->files && READ_ONCE(reg->nr_exports))
		goto err_unmap_now;
	if (!kref_get_unless_zero(&reg->kref)) {
		releasing = true;	/* nothing uses it any more */
		goto err_unmap_now;
	}
	__module_get(THIS_MODULE);	/* dropped by the fence's release */
	spin_lock_init(&rv->lock);
	dma_fence_init(&rv->base, &p2phub_db_revoke_ops, &rv->lock,
		       dma_fence_context_alloc(1), 1);
	INIT_WORK(&rv->work, p2phub_dmabuf_revoke_work);
	rv->reg = reg;
	dma_resv_add_fence(resv, &rv->base, DMA_RESV_USAGE_BOOKKEEP);
	reg->db.revoke = rv;	/* a marker only: never dereferenced */
	queue_work(p2phub_reg_wq, &rv->work);
	return;

err_unmap_now:
	/*
	 * No fence, or no way to reach the exports' importers before it
	 * (out of memory), or the registration is being released: unmap and
	 * flush at once, before the exporter moves the memory. Importers of
	 * the exports lose it now (their devices fault on the IOMMU) and are
	 * told by the notification p2phub_reg_revoke() queued.
	 */
	if (!releasing)
		pr_err_ratelimited("registration %u: cannot defer the unmap of a revoked dma-buf; importers of its exports are told late\n",
				   reg->handle);
	if (rv)
		p2phub_export_files_put(rv->files, rv->nfiles);
	kfree(rv);
	dma_buf_unmap_attachment(attach, map->db.sgt, p2phub_dmabuf_dir(reg));
	map->db.sgt = NULL;
	p2phub_flush_iotlb(&map->pdev->dev);
}

static const struct dma_buf_attach_ops p2phub_dmabuf_importer_ops = {
	.allow_peer2peer = true,
	P2PHUB_DMA_BUF_ATTACH_OPS_INVALIDATE(p2phub_dmabuf_move_notify),
};

/*
 * Devices reach registered memory with no kernel call around each transfer
 * (the NVMe engine and NICs are driven from user space), so nothing could
 * dma_sync a bounce buffer or a non-coherent cache: why @sgt needs that, or
 * NULL. P2P segments (bus addresses) never bounce.
 */
static const char *p2phub_dmabuf_needs_sync(struct device *dev,
					    struct sg_table *sgt)
{
	struct scatterlist *sg;
	unsigned int i;

	if (!dev_is_dma_coherent(dev))
		return "the device is not DMA-coherent";
	if (p2phub_dev_translated(dev)) {
		/* dma-iommu bounces only for untrusted (external) devices. */
		if (dev_is_pci(dev) && to_pci_dev(dev)->untrusted)
			return "the IOMMU bounces DMA of this untrusted device";
		return NULL;
	}
	for_each_sgtable_dma_sg(sgt, sg, i)
		if (p2phub_swiotlb_addr(dev, dma_to_phys(dev, sg_dma_address(sg))))
			return "the exporter mapped it through swiotlb bounce buffers";
	return NULL;
}

/*
 * Fill map->addrs with one DMA address per page of the window
 * [offset, offset + length) of the mapped buffer. Every DMA segment must
 * start and end on a page boundary.
 */
static int p2phub_dmabuf_flatten(struct p2phub_reg *reg,
				 struct p2phub_reg_map *map,
				 struct sg_table *sgt)
{
	u64 start = reg->db.offset, end = reg->db.offset + reg->length;
	struct scatterlist *sg;
	u64 pos = 0, n = 0;
	unsigned int i;

	for_each_sgtable_dma_sg(sgt, sg, i) {
		dma_addr_t addr = sg_dma_address(sg);
		u64 len = sg_dma_len(sg);
		u64 from, to;

		if (pos >= end)
			break;
		if (!PAGE_ALIGNED(addr) || !PAGE_ALIGNED(len)) {
			dev_err_ratelimited(&map->pdev->dev,
					    "p2phub: registration %u: exporter %s gave an unaligned DMA segment (%pad + %llu)\n",
					    reg->handle, reg->db.dmabuf->exp_name,
					    &addr, len);
			return -EINVAL;
		}
		from = max(pos, start);
		to = min(pos + len, end);
		for (; from < to; from += PAGE_SIZE)
			map->addrs[n++] = addr + (from - pos);
		pos += len;
	}
	if (n != reg->npages) {
		dev_err_ratelimited(&map->pdev->dev,
				    "p2phub: registration %u: exporter %s mapped %llu of %llu pages\n",
				    reg->handle, reg->db.dmabuf->exp_name, n,
				    reg->npages);
		return -EIO;
	}
	return 0;
}

/* Attach for the map's device, pin, map, flatten. Called with reg->lock held. */
static int p2phub_dmabuf_map(struct p2phub_reg *reg, struct p2phub_reg_map *map)
{
	struct device *dev = &map->pdev->dev;
	struct dma_buf *dmabuf = reg->db.dmabuf;
	struct dma_buf_attachment *attach;
	struct sg_table *sgt;
	const char *why;
	int ret;

	attach = dma_buf_dynamic_attach(dmabuf, dev,
					&p2phub_dmabuf_importer_ops, map);
	if (IS_ERR(attach))
		return PTR_ERR(attach);
	atomic_inc(&p2phub_stats.dmabuf_attachments);
	map->db.attach = attach;

	dma_resv_lock(dmabuf->resv, NULL);
	map->db.mapping = true;
	/*
	 * Pin, so that the exporter does not move the memory (any move is a
	 * revocation here). Not p2phub's own exports: they never move, and
	 * refuse pins of revocable memory; this import follows move_notify.
	 */
	if (!p2phub_export_reg(dmabuf)) {
		ret = dma_buf_pin(attach);
		if (ret)
			goto err_unlock;
		atomic_inc(&p2phub_stats.dmabuf_pins);
		map->db.pinned = true;
	}
	sgt = dma_buf_map_attachment(attach, p2phub_dmabuf_dir(reg));
	if (IS_ERR(sgt)) {
		ret = PTR_ERR(sgt);
		goto err_unpin;
	}
	map->db.sgt = sgt;
	map->db.mapping = false;
	why = p2phub_dmabuf_needs_sync(dev, sgt);
	if (why) {
		dev_info_ratelimited(dev,
				     "p2phub: registration %u: refusing a map that would need dma_sync: %s\n",
				     reg->handle, why);
		ret = -EOPNOTSUPP;
		goto err_unmap;
	}
	ret = p2phub_dmabuf_flatten(reg, map, sgt);
	if (ret)
		goto err_unmap;
	dma_resv_unlock(dmabuf->resv);

	/*
	 * The mapping is valid now, but the exporter may still have work
	 * queued on the buffer (a clear, a migration): wait for it, so the
	 * first device access sees settled contents.
	 */
	if (dma_resv_wait_timeout(dmabuf->resv, DMA_RESV_USAGE_KERNEL, false,
				  10 * HZ) <= 0)
		dev_warn_ratelimited(dev,
				     "p2phub: registration %u: exporter %s still busy after 10 s\n",
				     reg->handle, dmabuf->exp_name);
	return 0;

err_unmap:
	dma_buf_unmap_attachment(attach, sgt, p2phub_dmabuf_dir(reg));
	map->db.sgt = NULL;
err_unpin:
	if (map->db.pinned) {
		dma_buf_unpin(attach);
		atomic_dec(&p2phub_stats.dmabuf_pins);
		map->db.pinned = false;
	}
err_unlock:
	map->db.mapping = false;
	dma_resv_unlock(dmabuf->resv);
	dma_buf_detach(dmabuf, attach);
	atomic_dec(&p2phub_stats.dmabuf_attachments);
	map->db.attach = NULL;
	if (ret != -EOPNOTSUPP && ret != -ENODEV)
		dev_info_ratelimited(dev,
				     "p2phub: registration %u: cannot map dma-buf (%s) for this device: %d\n",
				     reg->handle, dmabuf->exp_name, ret);
	return ret;
}

/* The device's addresses go; the core flushes the IOTLB before unpin. */
static void p2phub_dmabuf_unmap(struct p2phub_reg *reg,
				struct p2phub_reg_map *map)
{
	struct dma_buf *dmabuf = reg->db.dmabuf;

	dma_resv_lock(dmabuf->resv, NULL);
	if (map->db.sgt) {
		dma_buf_unmap_attachment(map->db.attach, map->db.sgt,
					 p2phub_dmabuf_dir(reg));
		map->db.sgt = NULL;
	}
	dma_resv_unlock(dmabuf->resv);
}

/* Then the exporter may move the memory again: unpin and detach. */
static void p2phub_dmabuf_unpin(struct p2phub_reg *reg,
				struct p2phub_reg_map *map)
{
	struct dma_buf *dmabuf = reg->db.dmabuf;

	if (map->db.pinned) {
		dma_resv_lock(dmabuf->resv, NULL);
		dma_buf_unpin(map->db.attach);
		dma_resv_unlock(dmabuf->resv);
		atomic_dec(&p2phub_stats.dmabuf_pins);
		map->db.pinned = false;
	}
	dma_buf_detach(dmabuf, map->db.attach);
	atomic_dec(&p2phub_stats.dmabuf_attachments);
	map->db.attach = NULL;
}

static bool p2phub_dmabuf_mapped(const struct p2phub_reg_map *map)
{
	return READ_ONCE(map->db.sgt);
}

static void p2phub_dmabuf_release(struct p2phub_reg *reg,
				  struct list_head *maps)
{
	struct p2phub_reg_map *map;

	/* Every address gone and flushed before any pin is dropped. */
	list_for_each_entry(map, maps, node) {
		if (!map->removed)	/* else unmapped at its removal */
			p2phub_dmabuf_unmap(reg, map);
	}
	list_for_each_entry(map, maps, node) {
		if (!map->removed) {
			p2phub_flush_iotlb(&map->pdev->dev);
			p2phub_dmabuf_unpin(reg, map);
		}
	}
	p2phub_reg_maps_free(maps);
	p2phub_dmabuf_cpu_release(reg);
	dma_buf_put(reg->db.dmabuf);
	reg->db.dmabuf = NULL;
}

const struct p2phub_provider p2phub_dmabuf_provider = {
	.id	= P2PHUB_PROVIDER_DMABUF,
	.name	= "dma-buf",
	.map	= p2phub_dmabuf_map,
	.unmap	= p2phub_dmabuf_unmap,
	.unpin	= p2phub_dmabuf_unpin,
	.mapped	= p2phub_dmabuf_mapped,
	.cpu_pages = p2phub_dmabuf_cpu_pages,
	.mmap	= p2phub_dmabuf_mmap,
	.release = p2phub_dmabuf_release,
};

static struct lock_class_key p2phub_reg_derived_key;

/*
 * @dmabuf is an export of @src: resolve it to what @src imports when that
 * is itself a p2phub export, so that chains stay one level deep. Replaces
 * *dmabuf (reference moved) and adds to *offset.
 */
static int p2phub_dmabuf_resolve(struct p2phub_reg *src,
				 struct dma_buf **dmabuf, u64 *offset)
{
	struct dma_buf *inner = NULL;
	u64 inner_off = 0;
	int ret = 0;

	mutex_lock(&src->lock);
	if (src->torn_down || !src->provider) {
		ret = -ENODEV;	/* unregistered: its export maps nothing */
	} else if (src->provider == &p2phub_dmabuf_provider &&
		   p2phub_export_reg(src->db.dmabuf)) {
		inner = src->db.dmabuf;
		inner_off = src->db.offset;
		get_dma_buf(inner);
	}
	mutex_unlock(&src->lock);
	if (ret || !inner)
		return ret;
	if (check_add_overflow(*offset, inner_off, offset)) {
		dma_buf_put(inner);
		return -EOVERFLOW;
	}
	dma_buf_put(*dmabuf);
	*dmabuf = inner;
	return 0;
}

/*
 * Take a reference on the dma-buf behind @fd and check the window against
 * it. The caller validated alignment and overflow. Mapping (and with it
 * the pin) happens per device, in p2phub_dmabuf_map().
 */
int p2phub_dmabuf_setup(struct p2phub_reg *reg, int fd, u64 offset, u64 length)
{
	struct p2phub_reg *src;
	struct dma_buf *dmabuf;
	bool read_only;
	int ret;

	dmabuf = dma_buf_get(fd);	/* -EBADF, or -EINVAL: not a dma-buf */
	if (IS_ERR(dmabuf))
		return PTR_ERR(dmabuf);
	/* Every fd of a dma-buf shares its one struct file, and its mode. */
	read_only = !(dmabuf->file->f_mode & FMODE_WRITE);
	if (offset + length > dmabuf->size) {
		ret = -ERANGE;
		goto err_put;
	}
	src = p2phub_export_reg(dmabuf);
	if (src) {
		/* @dmabuf holds @src: it stays valid while we look. */
		ret = p2phub_dmabuf_resolve(src, &dmabuf, &offset);
		if (ret)
			goto err_put;
		read_only |= src->read_only;
		reg->revocable = src->revocable;
		lockdep_set_class(&reg->lock, &p2phub_reg_derived_key);
	} else {
		/* An exporter with pin/unpin may revoke through move_notify. */
		reg->revocable = !!dmabuf->ops->pin;
	}
	reg->read_only = read_only;
	reg->db.dmabuf = dmabuf;	/* the registration owns the reference */
	reg->db.offset = offset;
	reg->page_shift = PAGE_SHIFT;
	reg->npages = length >> PAGE_SHIFT;
	reg->provider = &p2phub_dmabuf_provider;
	return 0;

err_put:
	dma_buf_put(dmabuf);
	return ret;
}
