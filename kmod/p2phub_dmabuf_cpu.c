// SPDX-License-Identifier: GPL-2.0-only
/*
 * The CPU side of a dma-buf source, for mmap of its exports: the struct
 * pages behind the window, found through the exporter's own kernel mapping
 * (dma_buf_vmap()), with the caching that mapping has; or, where p2phub
 * may not map them itself, the exporter's own mmap of the window.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/dma-buf.h>
#include <linux/hugetlb.h>
#include <linux/mm.h>
#include <linux/overflow.h>
#include <linux/slab.h>
#include <linux/string.h>
#include <linux/vmalloc.h>

#include "compat.h"
#include "p2phub_dmabuf_cpu.h"
#include "p2phub_reg.h"

P2PHUB_IMPORT_NS_DMA_BUF();

static void p2phub_dmabuf_cpu_map_free(struct p2phub_reg_map *map)
{
	kvfree(map->db.pages);
	kfree(map);
	atomic_dec(&p2phub_stats.dev_maps);
}

static struct page *p2phub_dmabuf_vaddr_page(const void *p)
{
	if (is_vmalloc_addr(p))
		return vmalloc_to_page(p);
	if (virt_addr_valid(p))
		return virt_to_page(p);
	return NULL;
}

enum p2phub_dmabuf_cache {
	P2PHUB_CACHE_WB,
	P2PHUB_CACHE_WC,
	P2PHUB_CACHE_OTHER,	/* or unknown: only the exporter may map it */
};

/*
 * The caching of the exporter's own kernel mapping at @p, which is what it
 * set up for the memory (vgem: write-combined, in the linear map as well).
 * A CPU mapping with another caching would be an alias x86 PAT forbids.
 * Only x86's page tables are read; elsewhere the exporter maps.
 */
static enum p2phub_dmabuf_cache p2phub_dmabuf_vaddr_cache(const void *p)
{
#ifdef CONFIG_X86
	unsigned long cache = _PAGE_CACHE_MASK;
	unsigned int level;
	pte_t *pte;

	pte = lookup_address((unsigned long)p, &level);
	if (!pte || level != PG_LEVEL_4K || !pte_present(*pte))
		return P2PHUB_CACHE_OTHER;
	cache &= pte_val(*pte);
	if (cache == (pgprot_val(PAGE_KERNEL) & _PAGE_CACHE_MASK))
		return P2PHUB_CACHE_WB;
	if (cache == (pgprot_val(pgprot_writecombine(PAGE_KERNEL)) &
		      _PAGE_CACHE_MASK))
		return P2PHUB_CACHE_WC;
#endif
	return P2PHUB_CACHE_OTHER;
}

/*
 * Whether the page cache behind @dmabuf's pages belongs to its exporter
 * alone for as long as the buffer lives. A DRM PRIME export's GEM object
 * keeps its shmem file private, and drm-shmem never purges an exported
 * object. Other exporters' page-cache pages may belong to a file user space
 * still holds: udmabuf's memfd can have a hole punched in it, or be closed
 * and evicted, while the dma-buf keeps only pins. Truncation then removes
 * the folios from the page cache while a PTE p2phub inserted (with a file
 * rmap, in its own VMA, which that file's truncation cannot find) still
 * maps them: "Bad page" reports and leaked pages.
 */
static bool p2phub_dmabuf_cache_private(const struct dma_buf *dmabuf)
{
	return dmabuf->exp_name && !strcmp(dmabuf->exp_name, "drm");
}

/*
 * Whether p2phub may put @page into a user mapping of its own with the
 * caching *@cache (all pages alike): an order-0 page that is not hugetlb
 * (the exporter's vmap may name a large folio's head for each of its
 * pages, and tail pages need the exporter's own accounting), and either in
 * no page cache or anonymous mapping at all, or in one that only the
 * exporter can truncate (@cache_private).
 */
static bool p2phub_dmabuf_page_mappable(struct page *page, const void *p,
					enum p2phub_dmabuf_cache *cache,
					bool first, bool cache_private)
{
	struct folio *folio = page_folio(page);
	enum p2phub_dmabuf_cache c;

	if (PageHuge(page) || folio_test_large(folio))
		return false;
	if (READ_ONCE(folio->mapping) && !cache_private)
		return false;
	c = p2phub_dmabuf_vaddr_cache(p);
	if (c == P2PHUB_CACHE_OTHER || (!first && c != *cache))
		return false;
	*cache = c;
	return true;
}

/*
 * The pages of the window, for mmap of the exports: found through the
 * source exporter's own kernel mapping of the buffer (dma_buf_vmap(), made
 * on the first mmap and kept until teardown), never from an importer's
 * sg_table, whose page links belong to the exporter (CONFIG_DMABUF_DEBUG
 * scrambles them). Called with reg->lock held. -ENODEV: the exporter gives
 * no vmap, or one of I/O memory (a GPU BAR); -EREMOTE: pages p2phub cannot
 * map itself (see p2phub_dmabuf_page_mappable(): large folios, another
 * file's page cache); nothing is kept then.
 */
int p2phub_dmabuf_cpu_pages(struct p2phub_reg *reg,
				   struct page ***pages, bool *wc)
{
	struct p2phub_reg_map *map = reg->db.cpu;
	enum p2phub_dmabuf_cache cache = P2PHUB_CACHE_WB;
	bool cache_private = p2phub_dmabuf_cache_private(reg->db.dmabuf);
	u8 *vaddr;
	u64 i;
	int ret;

	lockdep_assert_held(&reg->lock);
	if (map) {
		*pages = map->db.pages;
		*wc = map->db.wc;
		return 0;
	}
	map = kzalloc(sizeof(*map), GFP_KERNEL_ACCOUNT);
	if (!map)
		return -ENOMEM;
	atomic_inc(&p2phub_stats.dev_maps);
	map->reg = reg;
	INIT_LIST_HEAD(&map->node);	/* never on reg->maps */
	map->db.pages = kvmalloc_array(reg->npages, sizeof(*map->db.pages),
				       GFP_KERNEL_ACCOUNT);
	if (!map->db.pages) {
		ret = -ENOMEM;
		goto err_free;
	}
	ret = p2phub_dma_buf_vmap(reg->db.dmabuf, &map->db.vmap);
	if (ret) {
		ret = ret == -ENOMEM ? -ENOMEM : -ENODEV;
		goto err_free;
	}
	ret = -ENODEV;
	if (map->db.vmap.is_iomem || !map->db.vmap.vaddr)
		goto err_vunmap;
	vaddr = (u8 *)map->db.vmap.vaddr + reg->db.offset;
	for (i = 0; i < reg->npages; i++) {
		u8 *p = vaddr + i * PAGE_SIZE;

		map->db.pages[i] = p2phub_dmabuf_vaddr_page(p);
		if (!map->db.pages[i] || !pfn_valid(page_to_pfn(map->db.pages[i])))
			goto err_vunmap;
		if (!p2phub_dmabuf_page_mappable(map->db.pages[i], p, &cache,
						 !i, cache_private)) {
			ret = -EREMOTE;
			goto err_vunmap_quiet;
		}
	}
	map->db.wc = cache == P2PHUB_CACHE_WC;
	reg->db.cpu = map;
	*pages = map->db.pages;
	*wc = map->db.wc;
	return 0;

err_vunmap:
	pr_info_ratelimited("registration %u: exporter %s gave no struct pages; its export cannot be mmapped\n",
			    reg->handle, reg->db.dmabuf->exp_name);
err_vunmap_quiet:
	p2phub_dma_buf_vunmap(reg->db.dmabuf, &map->db.vmap);
err_free:
	p2phub_dmabuf_cpu_map_free(map);
	return ret;
}

/*
 * mmap of an export whose pages p2phub cannot map itself: the source
 * exporter maps the window, as for an mmap of the source's own fd at that
 * offset (its pages, its caching, its fault handler). The VMA then holds
 * the source dma-buf, not the export: it is not one of the registration's
 * users.
 */
int p2phub_dmabuf_mmap(struct p2phub_reg *reg, struct vm_area_struct *vma)
{
	struct dma_buf *src = NULL;
	unsigned long pgoff = 0;
	int ret = -ENODEV;

	mutex_lock(&reg->lock);
	if (!reg->torn_down && reg->db.dmabuf) {
		src = reg->db.dmabuf;
		get_dma_buf(src);
		pgoff = reg->db.offset >> PAGE_SHIFT;
	}
	mutex_unlock(&reg->lock);
	if (!src)
		return ret;
	if (check_add_overflow(pgoff, vma->vm_pgoff, &pgoff))
		ret = -EOVERFLOW;
	else
		ret = dma_buf_mmap(src, vma, pgoff);
	if (ret)
		pr_info_ratelimited("registration %u: exporter %s refused to map its export: %d\n",
				    reg->handle, src->exp_name, ret);
	dma_buf_put(src);
	return ret;
}

/* At release: no export is mapped any more (each mapping holds a reference). */
void p2phub_dmabuf_cpu_release(struct p2phub_reg *reg)
{
	if (!reg->db.cpu)
		return;
	p2phub_dma_buf_vunmap(reg->db.dmabuf, &reg->db.cpu->db.vmap);
	p2phub_dmabuf_cpu_map_free(reg->db.cpu);
	reg->db.cpu = NULL;
}
