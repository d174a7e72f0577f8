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
 * The driver's side of the contract (kernel-open/nvidia/nv-p2p.c): the
 * free callback runs under the driver's API lock, which get_pages(),
 * dma_map_pages() and put_pages() take too; once the callback returns, the
 * driver unmaps every DMA mapping of the table and frees the table itself
 * (nvidia_p2p_free_page_table()/_free_dma_mapping() are no-ops);
 * put_pages() on a table whose callback ran or is running returns 0 and
 * frees nothing; dma_unmap_pages() takes only the table's own lock.
 *
 * How p2phub keeps it:
 *  - reg->lock is never held across get_pages(), dma_map_pages() or
 *    put_pages(), so the callback may take it (no AB-BA with the API lock);
 *  - whoever claims the page table (sets reg->nv.page_table NULL) under
 *    reg->lock owns its end. The callback claims it, revokes (devices stop:
 *    p2phub_reg_revoke() first), tells every export's importers and waits
 *    for their fences (p2phub_export_revoke_sync()), forgets the DMA
 *    mappings and returns: NVIDIA frees them. Release claims it and, in the
 *    same reg->lock section (so a callback cannot let NVIDIA free the table
 *    meanwhile), unmaps every mapping; then, unlocked and once no
 *    dma_map_pages() of ours is in flight, put_pages();
 *  - the callback runs inside an SRCU read section and touches reg only
 *    there; release and a failed setup wait for it (synchronize_srcu())
 *    before reg can be freed;
 *  - setup reads the page table only under reg->lock after checking that
 *    no callback claimed it (freed_early), and publishes it there;
 *  - a map drops reg->lock around dma_map_pages(); afterwards, if the
 *    table was claimed meanwhile, the result is dropped unused: NVIDIA
 *    frees it when the callback claimed the table; when release did, the
 *    map unmaps it and flushes the IOTLB itself (release's flush ran
 *    before), still counted in flight, so put_pages() waits for it. A
 *    mapping undone on any other late path is flushed the same way;
 *  - users re-check the registration after copying addresses out
 *    (p2phub_reg_live()), so addresses freed meanwhile are never trusted.
 *  - release calls put_pages() only if no callback ran since it claimed the
 *    table (the callback notes it, freed_early), decided under reg->lock;
 *    a callback that comes after that decision waits up to
 *    P2PHUB_NV_PUT_GRACE_MS for the put_pages() call before it returns (and
 *    NVIDIA frees the table): R470-era drivers read page_table->gpu_uuid
 *    in put_pages() before they take the API lock. The call blocks on that
 *    lock, so the wait cannot be for its return.
 * One window stays open and is the driver's: dma_map_pages() reads the
 * table before it takes the API lock, so a callback that runs right then
 * frees it under the call. The grace above narrows, but cannot close, the
 * like window of old drivers' put_pages().
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/module.h>
#include <linux/pci.h>
#include <linux/srcu.h>
#include <linux/types.h>
#include <linux/wait_bit.h>

#include "nv-p2p.h"
#include "p2phub_reg.h"

#define P2PHUB_NV_PUT_GRACE_MS	100

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
/* Free callbacks run in a read section; release waits for them. */
DEFINE_STATIC_SRCU(p2phub_nv_srcu);

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

/*
 * The NVIDIA driver frees the memory: may run at any time after
 * get_pages(), even in setup, under the driver's API lock.
 */
static void p2phub_nv_free_callback(void *data)
{
	struct p2phub_reg *reg = data;
	struct nvidia_p2p_page_table *pt;
	struct p2phub_reg_map *map;
	int idx;

	idx = srcu_read_lock(&p2phub_nv_srcu);
	mutex_lock(&reg->lock);
	pt = reg->nv.page_table;
	reg->nv.page_table = NULL;		/* claimed: its end is ours */
	if (!pt) {
		/*
		 * Not yet published (setup sees this), or release has it
		 * (and then calls put_pages() only if it had decided to
		 * before now: let that call read the table before NVIDIA
		 * frees it on our return).
		 */
		bool putting = reg->nv.putting;

		reg->nv.freed_early = true;
		mutex_unlock(&reg->lock);
		if (putting &&
		    !wait_var_event_timeout(&reg->nv.putting,
					    !READ_ONCE(reg->nv.putting),
					    msecs_to_jiffies(P2PHUB_NV_PUT_GRACE_MS)))
			pr_debug("registration %u: free callback during put_pages\n",
				 reg->handle);
		srcu_read_unlock(&p2phub_nv_srcu, idx);
		return;
	}
	/* First: the devices that use the registration stop. */
	p2phub_reg_revoke(reg, "NVIDIA free callback");
	mutex_unlock(&reg->lock);

	/* Then the importers of its exports, before NVIDIA unmaps. */
	p2phub_export_revoke_sync(reg);

	mutex_lock(&reg->lock);
	list_for_each_entry(map, &reg->maps, node) {
		if (!map->nv.mapping)
			continue;
		p2phub_nv.free_dma_mapping(map->nv.mapping);
		map->nv.mapping = NULL;		/* NVIDIA frees it on return */
		atomic_dec(&p2phub_stats.nv_dma_mappings);
	}
	p2phub_nv.free_page_table(pt);
	atomic_dec(&p2phub_stats.nv_page_tables);
	mutex_unlock(&reg->lock);
	srcu_read_unlock(&p2phub_nv_srcu, idx);
}

/*
 * Undo a mapping no device was told about yet, and flush: the device's
 * IOTLB may still have been filled through it (a guess, a stale queue).
 * Caller holds reg->lock with the table valid.
 */
static void p2phub_nv_unmap_flush(struct pci_dev *pdev,
				  struct nvidia_p2p_page_table *pt,
				  struct nvidia_p2p_dma_mapping *m)
{
	p2phub_nv.dma_unmap_pages(pdev, pt, m);
	p2phub_flush_iotlb(&pdev->dev);
}

/*
 * Map for map->pdev. Called with reg->lock held; drops it around
 * dma_map_pages(), which takes the driver's API lock.
 */
static int p2phub_nv_map(struct p2phub_reg *reg, struct p2phub_reg_map *map)
{
	struct nvidia_p2p_page_table *pt = reg->nv.page_table;
	struct nvidia_p2p_dma_mapping *m = NULL;
	u64 i;
	int ret;

	lockdep_assert_held(&reg->lock);
	if (!pt)
		return -ESTALE;
	reg->nv.maps_in_flight++;
	mutex_unlock(&reg->lock);
	ret = p2phub_nv.dma_map_pages(map->pdev, pt, &m);
	mutex_lock(&reg->lock);
	if (reg->nv.page_table != pt) {
		/*
		 * Claimed meanwhile. By the callback: NVIDIA frees the table
		 * and this mapping. By release, with no callback since: its
		 * flush ran already, and the table stays valid while we hold
		 * reg->lock and count as in flight (a callback needs the lock
		 * before NVIDIA frees anything, put_pages() waits for us), so
		 * the mapping goes here, flushed like every other.
		 */
		if (!ret && reg->nv.released && !reg->nv.freed_early)
			p2phub_nv_unmap_flush(map->pdev, pt, m);
		ret = -ESTALE;
		goto out_in_flight;
	}
	if (ret)
		goto out_in_flight;
	if (reg->torn_down) {
		/* Teardown took the maps meanwhile; this one would be lost. */
		p2phub_nv_unmap_flush(map->pdev, pt, m);
		ret = -ESTALE;
		goto out_in_flight;
	}
	if (!NVIDIA_P2P_DMA_MAPPING_VERSION_COMPATIBLE(m) ||
	    p2phub_nv_page_shift(m->page_size_type) != reg->page_shift ||
	    m->entries != reg->npages) {
		dev_err_ratelimited(&map->pdev->dev,
				    "p2phub: registration %u: unexpected NVIDIA DMA mapping (version 0x%x, %u entries of type %u)\n",
				    reg->handle, m->version, m->entries,
				    m->page_size_type);
		p2phub_nv_unmap_flush(map->pdev, pt, m);
		ret = -EPROTO;
		goto out_in_flight;
	}
	atomic_inc(&p2phub_stats.nv_dma_mappings);
	for (i = 0; i < reg->npages; i++)
		map->addrs[i] = m->dma_addresses[i];
	map->nv.mapping = m;
out_in_flight:
	if (!--reg->nv.maps_in_flight)
		wake_up_var(&reg->nv.maps_in_flight);
	return ret;
}

/* Unmap map->pdev now, as release() would; the core flushes the IOTLB. */
static void p2phub_nv_unmap(struct p2phub_reg *reg, struct p2phub_reg_map *map)
{
	lockdep_assert_held(&reg->lock);
	/* Without the table a callback claimed it: NVIDIA frees the mapping. */
	if (!map->nv.mapping || !reg->nv.page_table)
		return;
	p2phub_nv.dma_unmap_pages(map->pdev, reg->nv.page_table,
				  map->nv.mapping);
	map->nv.mapping = NULL;
	atomic_dec(&p2phub_stats.nv_dma_mappings);
}

static bool p2phub_nv_mapped(const struct p2phub_reg_map *map)
{
	return READ_ONCE(map->nv.mapping);
}

static void p2phub_nv_release(struct p2phub_reg *reg, struct list_head *maps)
{
	struct nvidia_p2p_page_table *pt;
	struct p2phub_reg_map *map;
	bool claimed;
	int ret;

	mutex_lock(&reg->lock);
	pt = reg->nv.page_table;
	claimed = pt;
	reg->nv.page_table = NULL;		/* claimed: its end is ours */
	reg->nv.released = claimed;		/* a late map unmaps itself */
	/*
	 * A callback cannot let NVIDIA free the table while we hold the lock
	 * (it waits for it). Without the table the callback ran: NVIDIA
	 * freed the mappings, nothing is left to unmap.
	 */
	list_for_each_entry(map, maps, node) {
		if (!map->nv.mapping)
			continue;
		if (pt)
			p2phub_nv.dma_unmap_pages(map->pdev, pt, map->nv.mapping);
		map->nv.mapping = NULL;
		atomic_dec(&p2phub_stats.nv_dma_mappings);
	}
	mutex_unlock(&reg->lock);
	/* No stale IOTLB entry may reach the pages once put_pages() runs. */
	list_for_each_entry(map, maps, node) {
		if (!map->removed)
			p2phub_flush_iotlb(&map->pdev->dev);
	}
	p2phub_reg_maps_free(maps);

	if (pt) {
		/* A map that dropped reg->lock still uses the table. */
		wait_var_event(&reg->nv.maps_in_flight,
			       !READ_ONCE(reg->nv.maps_in_flight));
		/*
		 * A callback that ran since the claim let NVIDIA free the
		 * table: never hand it to put_pages() then. Otherwise a
		 * callback from now on waits for the call (see the top).
		 */
		mutex_lock(&reg->lock);
		if (reg->nv.freed_early)
			pt = NULL;
		else
			reg->nv.putting = true;
		mutex_unlock(&reg->lock);
	}
	if (pt) {
		/* 0 also when a callback ran meanwhile: NVIDIA frees then. */
		ret = p2phub_nv.put_pages(0, 0, reg->nv.va, pt);
		if (ret)
			pr_warn_ratelimited("registration %u: nvidia_p2p_put_pages(0x%llx) failed: %d\n",
					    reg->handle, reg->nv.va, ret);
		WRITE_ONCE(reg->nv.putting, false);
		wake_up_var(&reg->nv.putting);
	}
	if (claimed)
		atomic_dec(&p2phub_stats.nv_page_tables);
	/* A callback still running touches reg: let it finish. */
	synchronize_srcu(&p2phub_nv_srcu);
	p2phub_nv_syms_put();
}

const struct p2phub_provider p2phub_nv_provider = {
	.id	= P2PHUB_PROVIDER_NVIDIA,
	.name	= "nvidia-p2p",
	.map	= p2phub_nv_map,
	.unmap	= p2phub_nv_unmap,
	.mapped	= p2phub_nv_mapped,
	.release = p2phub_nv_release,
};

/* Pin [va, va + length). The caller validated 64 KiB alignment. */
int p2phub_nv_setup(struct p2phub_reg *reg, u64 va, u64 length)
{
	struct nvidia_p2p_page_table *pt;
	int shift, ret;

	ret = p2phub_nv_syms_get();
	if (ret)
		return ret;
	reg->nv.va = va;
	reg->revocable = true;
	ret = p2phub_nv.get_pages(0, 0, va, length, &pt,
				  p2phub_nv_free_callback, reg);
	if (ret)
		goto err_put_syms;
	atomic_inc(&p2phub_stats.nv_page_tables);

	/* The table is ours to read only while no callback has claimed it. */
	mutex_lock(&reg->lock);
	if (reg->nv.freed_early) {
		/* The callback ran already: NVIDIA frees the table. */
		mutex_unlock(&reg->lock);
		atomic_dec(&p2phub_stats.nv_page_tables);
		ret = -ESTALE;
		goto err_sync;
	}
	shift = p2phub_nv_page_shift(pt->page_size);
	if (!NVIDIA_P2P_PAGE_TABLE_VERSION_COMPATIBLE(pt) || shift < 0 ||
	    ((u64)pt->entries << shift) != length) {
		pr_err_ratelimited("NVIDIA page table for 0x%llx+0x%llx unusable (version 0x%x, %u entries of type %u)\n",
				   va, length, pt->version, pt->entries,
				   pt->page_size);
		mutex_unlock(&reg->lock);
		/* A callback from now on finds nothing published: fine. */
		p2phub_nv.put_pages(0, 0, va, pt);
		atomic_dec(&p2phub_stats.nv_page_tables);
		ret = -EPROTO;
		goto err_sync;
	}
	reg->page_shift = shift;
	reg->npages = pt->entries;
	reg->provider = &p2phub_nv_provider;
	reg->nv.page_table = pt;		/* published */
	mutex_unlock(&reg->lock);
	return 0;

err_sync:
	/* reg is freed once we return: no callback may still be in it. */
	synchronize_srcu(&p2phub_nv_srcu);
err_put_syms:
	p2phub_nv_syms_put();
	return ret;
}
