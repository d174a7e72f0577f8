// SPDX-License-Identifier: GPL-2.0-only
/*
 * The NVIDIA P2P pin provider: nvidia_p2p_get_pages() pins a GPU virtual
 * address range, nvidia_p2p_dma_map_pages() maps it per PCI device.
 *
 * The nvidia_p2p_* symbols are looked up at run time (symbol_get), so
 * p2phub.ko loads without nvidia.ko; they are held while any NVIDIA
 * registration exists. symbol_get() only finds EXPORT_SYMBOL_GPL symbols on
 * newer kernels, which is how nvidia.ko exports them.
 *
 * The contract, and how it is kept:
 *  - the free callback may run at any time after get_pages() returns, even
 *    before p2phub has stored the page table: it takes reg->lock, claims
 *    the page table (sets it NULL) and frees it with the callback-safe
 *    nvidia_p2p_free_dma_mapping()/_free_page_table(); if there was none
 *    yet it leaves a note (freed_early) and setup gives up;
 *  - the page table is published (stored under reg->lock) only once it is
 *    checked;
 *  - release happens exactly once: whoever claims the page table under
 *    reg->lock releases it; normal release uses dma_unmap_pages() and
 *    put_pages(), never while holding reg->lock, since put_pages() may wait
 *    for a callback in progress;
 *  - users re-check the registration after copying addresses out
 *    (p2phub_reg_live()), so addresses freed meanwhile are never trusted.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/module.h>
#include <linux/pci.h>
#include <linux/types.h>

#include "nv-p2p.h"
#include "p2phub_reg.h"

static struct {
	typeof(&nvidia_p2p_get_pages) get_pages;
	typeof(&nvidia_p2p_put_pages) put_pages;
	typeof(&nvidia_p2p_free_page_table) free_page_table;
	typeof(&nvidia_p2p_dma_map_pages) dma_map_pages;
	typeof(&nvidia_p2p_dma_unmap_pages) dma_unmap_pages;
	typeof(&nvidia_p2p_free_dma_mapping) free_dma_mapping;
} p2phub_nv;
static unsigned int p2phub_nv_users;	/* registrations holding the symbols */
static DEFINE_MUTEX(p2phub_nv_sym_lock);

static void p2phub_nv_syms_drop(void)
{
	if (p2phub_nv.get_pages)
		symbol_put(nvidia_p2p_get_pages);
	if (p2phub_nv.put_pages)
		symbol_put(nvidia_p2p_put_pages);
	if (p2phub_nv.free_page_table)
		symbol_put(nvidia_p2p_free_page_table);
	if (p2phub_nv.dma_map_pages)
		symbol_put(nvidia_p2p_dma_map_pages);
	if (p2phub_nv.dma_unmap_pages)
		symbol_put(nvidia_p2p_dma_unmap_pages);
	if (p2phub_nv.free_dma_mapping)
		symbol_put(nvidia_p2p_free_dma_mapping);
	memset(&p2phub_nv, 0, sizeof(p2phub_nv));
}

static int p2phub_nv_syms_get(void)
{
	int ret = 0;

	mutex_lock(&p2phub_nv_sym_lock);
	if (!p2phub_nv_users) {
		p2phub_nv.get_pages = symbol_get(nvidia_p2p_get_pages);
		p2phub_nv.put_pages = symbol_get(nvidia_p2p_put_pages);
		p2phub_nv.free_page_table = symbol_get(nvidia_p2p_free_page_table);
		p2phub_nv.dma_map_pages = symbol_get(nvidia_p2p_dma_map_pages);
		p2phub_nv.dma_unmap_pages = symbol_get(nvidia_p2p_dma_unmap_pages);
		p2phub_nv.free_dma_mapping = symbol_get(nvidia_p2p_free_dma_mapping);
		if (!p2phub_nv.get_pages || !p2phub_nv.put_pages ||
		    !p2phub_nv.free_page_table || !p2phub_nv.dma_map_pages ||
		    !p2phub_nv.dma_unmap_pages || !p2phub_nv.free_dma_mapping) {
			p2phub_nv_syms_drop();
			ret = -ENXIO;
		}
	}
	if (!ret)
		p2phub_nv_users++;
	mutex_unlock(&p2phub_nv_sym_lock);
	return ret;
}

static void p2phub_nv_syms_put(void)
{
	mutex_lock(&p2phub_nv_sym_lock);
	if (!WARN_ON_ONCE(!p2phub_nv_users) && !--p2phub_nv_users)
		p2phub_nv_syms_drop();
	mutex_unlock(&p2phub_nv_sym_lock);
}

/* Whether the nvidia_p2p_* API can be used right now. */
bool p2phub_nv_live(void)
{
	bool live = true;

	mutex_lock(&p2phub_nv_sym_lock);
	if (!p2phub_nv_users) {
		typeof(&nvidia_p2p_get_pages) fn = symbol_get(nvidia_p2p_get_pages);

		live = fn;
		if (fn)
			symbol_put(nvidia_p2p_get_pages);
	}
	mutex_unlock(&p2phub_nv_sym_lock);
	return live;
}

static int p2phub_nv_page_shift(u32 page_size)
{
	switch (page_size) {
	case NVIDIA_P2P_PAGE_SIZE_4KB:
		return 12;
	case NVIDIA_P2P_PAGE_SIZE_64KB:
		return 16;
	case NVIDIA_P2P_PAGE_SIZE_128KB:
		return 17;
	}
	return -EPROTO;
}

/* The NVIDIA driver frees the memory: may run at any time, even in setup. */
static void p2phub_nv_free_callback(void *data)
{
	struct p2phub_reg *reg = data;
	struct nvidia_p2p_page_table *pt;
	struct p2phub_reg_map *map;

	mutex_lock(&reg->lock);
	pt = reg->nv.page_table;
	reg->nv.page_table = NULL;		/* claimed: we release it */
	if (!pt) {
		/* Not yet published (setup sees this), or release has it. */
		reg->nv.freed_early = true;
		mutex_unlock(&reg->lock);
		return;
	}
	list_for_each_entry(map, &reg->maps, node) {
		if (!map->nv.mapping)
			continue;
		p2phub_nv.free_dma_mapping(map->nv.mapping);
		map->nv.mapping = NULL;
		atomic_dec(&p2phub_stats.nv_dma_mappings);
	}
	p2phub_nv.free_page_table(pt);
	atomic_dec(&p2phub_stats.nv_page_tables);
	mutex_unlock(&reg->lock);

	p2phub_reg_revoke(reg, "NVIDIA free callback");
}

/* Map for map->pdev. Called with reg->lock held, so no callback runs. */
static int p2phub_nv_map(struct p2phub_reg *reg, struct p2phub_reg_map *map)
{
	struct nvidia_p2p_page_table *pt = reg->nv.page_table;
	struct nvidia_p2p_dma_mapping *m;
	u64 i;
	int ret;

	lockdep_assert_held(&reg->lock);
	if (!pt)
		return -ESTALE;
	ret = p2phub_nv.dma_map_pages(map->pdev, pt, &m);
	if (ret)
		return ret;
	atomic_inc(&p2phub_stats.nv_dma_mappings);
	if (!NVIDIA_P2P_DMA_MAPPING_VERSION_COMPATIBLE(m) ||
	    p2phub_nv_page_shift(m->page_size_type) != reg->page_shift ||
	    m->entries != reg->npages) {
		dev_err_ratelimited(&map->pdev->dev,
				    "p2phub: registration %u: unexpected NVIDIA DMA mapping (version 0x%x, %u entries of type %u)\n",
				    reg->handle, m->version, m->entries,
				    m->page_size_type);
		p2phub_nv.dma_unmap_pages(map->pdev, pt, m);
		atomic_dec(&p2phub_stats.nv_dma_mappings);
		return -EPROTO;
	}
	for (i = 0; i < reg->npages; i++)
		map->addrs[i] = m->dma_addresses[i];
	map->nv.mapping = m;
	return 0;
}

static void p2phub_nv_release(struct p2phub_reg *reg, struct list_head *maps)
{
	struct nvidia_p2p_page_table *pt;
	struct p2phub_reg_map *map;
	int ret;

	mutex_lock(&reg->lock);
	pt = reg->nv.page_table;
	reg->nv.page_table = NULL;		/* claimed: we release it */
	mutex_unlock(&reg->lock);

	list_for_each_entry(map, maps, node) {
		if (!map->nv.mapping)
			continue;
		/* Without the page table the callback ran: just free. */
		if (pt)
			p2phub_nv.dma_unmap_pages(map->pdev, pt, map->nv.mapping);
		else
			p2phub_nv.free_dma_mapping(map->nv.mapping);
		map->nv.mapping = NULL;
		atomic_dec(&p2phub_stats.nv_dma_mappings);
	}
	p2phub_reg_maps_free(maps);
	if (pt) {
		ret = p2phub_nv.put_pages(0, 0, reg->nv.va, pt);
		if (ret)
			pr_warn_ratelimited("registration %u: nvidia_p2p_put_pages(0x%llx) failed: %d\n",
					    reg->handle, reg->nv.va, ret);
		atomic_dec(&p2phub_stats.nv_page_tables);
	}
	p2phub_nv_syms_put();
}

const struct p2phub_provider p2phub_nv_provider = {
	.id	= P2PHUB_PROVIDER_NVIDIA,
	.name	= "nvidia-p2p",
	.map	= p2phub_nv_map,
	.release = p2phub_nv_release,
};

/* Pin [va, va + length). The caller validated 64 KiB alignment. */
int p2phub_nv_setup(struct p2phub_reg *reg, u64 va, u64 length)
{
	struct nvidia_p2p_page_table *pt;
	int shift, ret;
	bool early;

	ret = p2phub_nv_syms_get();
	if (ret)
		return ret;
	reg->nv.va = va;
	ret = p2phub_nv.get_pages(0, 0, va, length, &pt,
				  p2phub_nv_free_callback, reg);
	if (ret)
		goto err_put_syms;
	atomic_inc(&p2phub_stats.nv_page_tables);

	shift = p2phub_nv_page_shift(pt->page_size);
	if (!NVIDIA_P2P_PAGE_TABLE_VERSION_COMPATIBLE(pt) || shift < 0 ||
	    ((u64)pt->entries << shift) != length) {
		pr_err_ratelimited("NVIDIA page table for 0x%llx+0x%llx unusable (version 0x%x, %u entries of type %u)\n",
				   va, length, pt->version, pt->entries,
				   pt->page_size);
		ret = -EPROTO;
		goto err_put_pages;
	}

	mutex_lock(&reg->lock);
	if (reg->nv.freed_early) {
		/* The callback ran already; it could not free what it lacked. */
		mutex_unlock(&reg->lock);
		p2phub_nv.free_page_table(pt);
		atomic_dec(&p2phub_stats.nv_page_tables);
		ret = -ESTALE;
		goto err_put_syms;
	}
	reg->page_shift = shift;
	reg->npages = pt->entries;
	reg->provider = &p2phub_nv_provider;
	reg->nv.page_table = pt;		/* published */
	mutex_unlock(&reg->lock);
	return 0;

err_put_pages:
	mutex_lock(&reg->lock);
	early = reg->nv.freed_early;
	mutex_unlock(&reg->lock);
	if (early)
		p2phub_nv.free_page_table(pt);
	else
		p2phub_nv.put_pages(0, 0, va, pt);
	atomic_dec(&p2phub_stats.nv_page_tables);
err_put_syms:
	p2phub_nv_syms_put();
	return ret;
}
