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
 * never moves for any other reason): the mapping is dropped and the
 * registration revoked.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/dma-buf.h>
#include <linux/dma-resv.h>
#include <linux/mm.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>

#include "compat.h"
#include "p2phub_reg.h"

P2PHUB_IMPORT_NS_DMA_BUF();

static void p2phub_dmabuf_move_notify(struct dma_buf_attachment *attach)
{
	struct p2phub_reg_map *map = attach->importer_priv;

	dma_resv_assert_held(attach->dmabuf->resv);
	/* Called for every attachment, mapped or not (e.g. while pinning). */
	if (map->db.mapping || !map->db.sgt)
		return;
	dma_buf_unmap_attachment(attach, map->db.sgt, DMA_BIDIRECTIONAL);
	map->db.sgt = NULL;
	p2phub_reg_revoke(map->reg, "dma-buf move_notify");
}

static const struct dma_buf_attach_ops p2phub_dmabuf_importer_ops = {
	.allow_peer2peer = true,
	.move_notify = p2phub_dmabuf_move_notify,
};

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

/*
 * The struct pages of the window, for the CPU map (see p2phub_dmabuf_cpu_pages()).
 * -ENODEV when the exporter gave bus addresses without pages (a GPU BAR).
 */
static int p2phub_dmabuf_pages(struct p2phub_reg *reg,
			       struct p2phub_reg_map *map,
			       struct sg_table *sgt)
{
	u64 first = reg->db.offset >> PAGE_SHIFT, n = 0, idx = 0;
	struct scatterlist *sg;
	unsigned int i;

	/* Check the CPU side of every entry before walking its pages. */
	for_each_sgtable_sg(sgt, sg, i) {
		if (!sg_page(sg) || sg->offset || !PAGE_ALIGNED(sg->length)) {
			pr_info_ratelimited("registration %u: exporter %s gave no struct pages (or unaligned ones); its export cannot be mmapped\n",
					    reg->handle, reg->db.dmabuf->exp_name);
			return -ENODEV;
		}
	}
	for_each_sgtable_sg(sgt, sg, i) {
		u64 j, cnt = sg->length >> PAGE_SHIFT;

		for (j = 0; j < cnt && n < reg->npages; j++, idx++) {
			if (idx >= first)
				map->db.pages[n++] = nth_page(sg_page(sg), j);
		}
	}
	if (n != reg->npages) {
		pr_err_ratelimited("registration %u: exporter %s gave %llu of %llu pages\n",
				   reg->handle, reg->db.dmabuf->exp_name, n,
				   reg->npages);
		return -EIO;
	}
	return 0;
}

/* The device a map is made for: its PCI function, or p2phub's own (CPU). */
static struct device *p2phub_dmabuf_map_dev(struct p2phub_reg_map *map)
{
	return map->pdev ? &map->pdev->dev : p2phub_device;
}

/*
 * Attach for the map's device, pin, map, then flatten (a PCI device) or
 * collect the pages (the CPU map). Called with reg->lock held.
 */
static int p2phub_dmabuf_map(struct p2phub_reg *reg, struct p2phub_reg_map *map)
{
	struct device *dev = p2phub_dmabuf_map_dev(map);
	struct dma_buf *dmabuf = reg->db.dmabuf;
	struct dma_buf_attachment *attach;
	struct sg_table *sgt;
	int ret;

	attach = dma_buf_dynamic_attach(dmabuf, dev,
					&p2phub_dmabuf_importer_ops, map);
	if (IS_ERR(attach))
		return PTR_ERR(attach);
	atomic_inc(&p2phub_stats.dmabuf_attachments);
	map->db.attach = attach;

	dma_resv_lock(dmabuf->resv, NULL);
	map->db.mapping = true;
	ret = dma_buf_pin(attach);
	if (ret)
		goto err_unlock;
	atomic_inc(&p2phub_stats.dmabuf_pins);
	map->db.pinned = true;
	sgt = dma_buf_map_attachment(attach, DMA_BIDIRECTIONAL);
	if (IS_ERR(sgt)) {
		ret = PTR_ERR(sgt);
		goto err_unpin;
	}
	map->db.sgt = sgt;
	map->db.mapping = false;
	if (map->pdev)
		ret = p2phub_dmabuf_flatten(reg, map, sgt);
	else
		ret = p2phub_dmabuf_pages(reg, map, sgt);
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
	dma_buf_unmap_attachment(attach, sgt, DMA_BIDIRECTIONAL);
	map->db.sgt = NULL;
err_unpin:
	dma_buf_unpin(attach);
	atomic_dec(&p2phub_stats.dmabuf_pins);
	map->db.pinned = false;
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

static void p2phub_dmabuf_unmap(struct p2phub_reg *reg,
				struct p2phub_reg_map *map)
{
	struct dma_buf *dmabuf = reg->db.dmabuf;

	dma_resv_lock(dmabuf->resv, NULL);
	if (map->db.sgt) {
		dma_buf_unmap_attachment(map->db.attach, map->db.sgt,
					 DMA_BIDIRECTIONAL);
		map->db.sgt = NULL;
	}
	if (map->db.pinned) {
		dma_buf_unpin(map->db.attach);
		atomic_dec(&p2phub_stats.dmabuf_pins);
		map->db.pinned = false;
	}
	dma_resv_unlock(dmabuf->resv);
	dma_buf_detach(dmabuf, map->db.attach);
	atomic_dec(&p2phub_stats.dmabuf_attachments);
	map->db.attach = NULL;
}

static void p2phub_dmabuf_cpu_map_free(struct p2phub_reg_map *map)
{
	kvfree(map->db.pages);
	kfree(map);
	atomic_dec(&p2phub_stats.dev_maps);
}

/*
 * The pages of the window, through an attachment of p2phub's own device
 * made on the first mmap of an export and kept, pinned, until teardown.
 * Called with reg->lock held. -ENODEV: the exporter has no struct pages
 * (a GPU BAR) or refuses a non-PCI importer; nothing is kept then.
 */
static int p2phub_dmabuf_cpu_pages(struct p2phub_reg *reg,
				   struct page ***pages)
{
	struct p2phub_reg_map *map = reg->db.cpu;
	int ret;

	lockdep_assert_held(&reg->lock);
	if (map) {
		*pages = map->db.pages;
		return 0;
	}
	if (!p2phub_device)
		return -ENODEV;
	map = kzalloc(sizeof(*map), GFP_KERNEL);
	if (!map)
		return -ENOMEM;
	atomic_inc(&p2phub_stats.dev_maps);
	map->reg = reg;
	INIT_LIST_HEAD(&map->node);	/* never on reg->maps */
	map->db.pages = kvmalloc_array(reg->npages, sizeof(*map->db.pages),
				       GFP_KERNEL);
	if (!map->db.pages) {
		ret = -ENOMEM;
		goto err_free;
	}
	ret = p2phub_dmabuf_map(reg, map);
	if (ret)
		goto err_free;
	reg->db.cpu = map;
	*pages = map->db.pages;
	return 0;

err_free:
	p2phub_dmabuf_cpu_map_free(map);
	return ret == -EOPNOTSUPP || ret == -EINVAL ? -ENODEV : ret;
}

static void p2phub_dmabuf_release(struct p2phub_reg *reg,
				  struct list_head *maps)
{
	struct p2phub_reg_map *map;

	list_for_each_entry(map, maps, node)
		p2phub_dmabuf_unmap(reg, map);
	p2phub_reg_maps_free(maps);
	/* No export is mapped any more: each mapping holds a reference. */
	if (reg->db.cpu) {
		p2phub_dmabuf_unmap(reg, reg->db.cpu);
		p2phub_dmabuf_cpu_map_free(reg->db.cpu);
		reg->db.cpu = NULL;
	}
	dma_buf_put(reg->db.dmabuf);
	reg->db.dmabuf = NULL;
}

const struct p2phub_provider p2phub_dmabuf_provider = {
	.id	= P2PHUB_PROVIDER_DMABUF,
	.name	= "dma-buf",
	.map	= p2phub_dmabuf_map,
	.cpu_pages = p2phub_dmabuf_cpu_pages,
	.release = p2phub_dmabuf_release,
};

/*
 * Take a reference on the dma-buf behind @fd and check the window against
 * it. The caller validated alignment and overflow. Mapping (and with it
 * the pin) happens per device, in p2phub_dmabuf_map().
 */
int p2phub_dmabuf_setup(struct p2phub_reg *reg, int fd, u64 offset, u64 length)
{
	struct dma_buf *dmabuf;

	dmabuf = dma_buf_get(fd);	/* -EBADF, or -EINVAL: not a dma-buf */
	if (IS_ERR(dmabuf))
		return PTR_ERR(dmabuf);
	if (offset + length > dmabuf->size) {
		dma_buf_put(dmabuf);
		return -ERANGE;
	}
	reg->db.dmabuf = dmabuf;	/* the registration owns the reference */
	reg->db.offset = offset;
	reg->page_shift = PAGE_SHIFT;
	reg->npages = length >> PAGE_SHIFT;
	reg->provider = &p2phub_dmabuf_provider;
	return 0;
}
