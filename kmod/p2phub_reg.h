/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Registration internals, shared by the registration core and its
 * providers. Users outside these files go through p2phub_priv.h.
 */
#ifndef _P2PHUB_REG_H
#define _P2PHUB_REG_H

#include <linux/atomic.h>
#include <linux/iosys-map.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/spinlock.h>
#include <linux/uidgid.h>
#include <linux/workqueue.h>

#include "p2phub_priv.h"

struct dma_buf;
struct dma_buf_attachment;
struct mm_struct;
struct p2phub_db_revoke;
struct page;
struct sg_table;
struct vm_area_struct;

enum p2phub_reg_state {
	P2PHUB_REG_LIVE = P2PHUB_REG_STATE_LIVE,
	P2PHUB_REG_REVOKED = P2PHUB_REG_STATE_REVOKED,
	P2PHUB_REG_DEAD,		/* unregistered or its file closed */
};

/*
 * The registration mapped for one PCI device; or, for a dma-buf source, the
 * CPU map (pdev and addrs NULL, pages set; reg->db.cpu, not on reg->maps).
 */
struct p2phub_reg_map {
	struct list_head node;		/* on p2phub_reg.maps */
	struct p2phub_reg *reg;
	struct pci_dev *pdev;		/* reference held */
	dma_addr_t *addrs;		/* reg->npages entries */
	/*
	 * The device was hot-removed: unmapped by the provider's unmap(),
	 * kept on reg->maps (addrs stays readable) until teardown.
	 */
	bool removed;
	/*
	 * Under reg->lock: a holder let go without unmapping (DMA_PAGES,
	 * REGISTER's F_DEVICE): its addresses stay valid until teardown, so
	 * the last importer of an export to let go leaves this map mapped.
	 */
	bool cached;
	/*
	 * Under reg->state_lock: users of the map (each holder of
	 * p2phub_reg_map_get()'s result until its p2phub_reg_map_put(), an
	 * export attachment until its detach) and, of those, the importers
	 * of exports (an export attachment), which must be told and waited
	 * for before the map goes; every other user of a revoked map is
	 * stopped already (p2phub_reg_user.stop_dma).
	 */
	u32 holds;
	u32 importers;
	union {
		struct {
			struct dma_buf_attachment *attach;
			struct sg_table *sgt;	/* under the source's dma_resv */
			struct page **pages;	/* CPU map: reg->npages */
			struct iosys_map vmap;	/* CPU map: the source's vmap */
			bool wc;	/* CPU map: the exporter maps it WC */
			bool pinned;
			bool mapping;	/* pin/map in progress: ignore moves */
		} db;
		struct {
			void *mapping;	/* struct nvidia_p2p_dma_mapping */
		} nv;
	};
};

struct p2phub_reg;

struct p2phub_provider {
	u32 id;				/* P2PHUB_PROVIDER_* */
	const char *name;
	/*
	 * Fill map->addrs for map->pdev. Called with reg->lock held; the
	 * NVIDIA provider drops it around dma_map_pages() and re-checks
	 * (claimed table: -ESTALE; torn down meanwhile: -ESTALE, unmapped).
	 */
	int (*map)(struct p2phub_reg *reg, struct p2phub_reg_map *map);
	/*
	 * Undo map() for one device before teardown (its last user let go,
	 * its driver left, it is being removed): its addresses go from the
	 * IOMMU's page tables. The core then flushes the device's IOTLB and
	 * only then calls unpin(), if any, which gives the memory back to its
	 * exporter: a lazily flushed IOTLB entry never reaches memory that
	 * was given back. release() then skips the map. Both are called with
	 * reg->lock held.
	 */
	void (*unmap)(struct p2phub_reg *reg, struct p2phub_reg_map *map);
	void (*unpin)(struct p2phub_reg *reg, struct p2phub_reg_map *map);
	/* Whether the device can still reach the memory through @map. */
	bool (*mapped)(const struct p2phub_reg_map *map);
	/*
	 * The struct pages of the registration (reg->npages of PAGE_SIZE),
	 * for mmap of its exports, from the exporter's own CPU mapping (never
	 * an importer's sg_table); valid until release(). NULL, or -ENODEV,
	 * when the memory has none; -EREMOTE when only the exporter can map
	 * them (large folios, a caching p2phub cannot reproduce): then mmap()
	 * below. *@wc: the exporter maps them write-combined. Called with
	 * reg->lock held.
	 */
	int (*cpu_pages)(struct p2phub_reg *reg, struct page ***pages, bool *wc);
	/*
	 * Have the source exporter map @vma (its pgoff relative to the
	 * registration) itself: the VMA becomes the exporter's. Called
	 * without reg->lock.
	 */
	int (*mmap)(struct p2phub_reg *reg, struct vm_area_struct *vma);
	/*
	 * Release the pin and every mapping on @maps (already off reg->maps):
	 * all of them unmapped and their IOTLBs flushed before anything is
	 * unpinned; no callback of the provider runs for @reg afterwards.
	 * Called once, without reg->lock.
	 */
	void (*release)(struct p2phub_reg *reg, struct list_head *maps);
};

struct p2phub_reg {
	struct kref kref;
	struct list_head all_node;	/* on p2phub_all_regs */
	u32 handle;
	const struct p2phub_provider *provider;
	u32 page_shift;
	u64 length;
	u64 npages;

	spinlock_t state_lock;		/* protects the block below */
	enum p2phub_reg_state state;
	bool revoked;			/* the owner took the memory back */
	u64 generation;
	u32 io_holds;			/* users plus ioctls reading the maps */
	struct list_head users;		/* struct p2phub_reg_user */
	u32 export_attached;
	u32 export_mmaps;		/* VMAs mapping one of its exports */

	struct mutex lock;		/* protects the block below */
	struct list_head maps;		/* struct p2phub_reg_map */
	u32 nr_maps;
	struct list_head exports;	/* struct p2phub_export_buf */
	u32 nr_exports;
	bool torn_down;

	struct work_struct notify_work;	/* tells export importers */

	/*
	 * RLIMIT_MEMLOCK: reg->length in pages, added to acct_mm->pinned_vm
	 * at REGISTER (acct_mm mmgrab()ed) and taken off at teardown. NULL
	 * when nothing was charged.
	 */
	struct mm_struct *acct_mm;
	unsigned long acct_pages;
	/* The same pages, charged to the file opener's uid (set with acct_mm). */
	kuid_t acct_uid;
	unsigned long acct_uid_pages;

	/* Set up by the provider's setup, constant afterwards. */
	bool read_only;			/* the source fd was not writable */
	bool revocable;			/* the owner may take it back (revoke) */

	union {
		struct {
			struct dma_buf *dmabuf;	/* reference held */
			u64 offset;
			struct p2phub_reg_map *cpu;	/* under lock */
			/* set once a revocation fence was added (a marker,
			 * never dereferenced); under the source's resv */
			struct p2phub_db_revoke *revoke;
		} db;
		struct {
			u64 va;
			void *page_table;	/* under lock; NULL once claimed */
			bool freed_early;	/* callback ran unpublished/claimed */
			bool putting;		/* under lock: release's put_pages due */
			bool released;		/* under lock: release claimed the table */
			u32 maps_in_flight;	/* under lock: dma_map_pages running */
		} nv;
	};
};

/* Leak counters, shown in /sys/kernel/debug/p2phub/. */
struct p2phub_reg_stats {
	atomic_t regs;			/* struct p2phub_reg alive */
	atomic_t dev_maps;		/* struct p2phub_reg_map alive */
	atomic_t dmabuf_attachments;	/* our attachments to source dma-bufs */
	atomic_t dmabuf_pins;
	atomic_t exports;		/* exported dma-bufs alive */
	atomic_t export_attachments;	/* importers attached to them */
	atomic_t export_mmaps;		/* VMAs mapping them */
	atomic_t nv_page_tables;	/* NVIDIA page tables held */
	atomic_t nv_dma_mappings;
	atomic_t revocations;		/* total, not a leak counter */
};
extern struct p2phub_reg_stats p2phub_stats;

static inline size_t p2phub_reg_page_size(const struct p2phub_reg *reg)
{
	return (size_t)1 << reg->page_shift;
}

/*
 * Mark @reg revoked (idempotent), stop the devices that use it and queue
 * the importer notification. Call it first in every revocation path, before
 * any unmap. Takes only spinlocks.
 */
void p2phub_reg_revoke(struct p2phub_reg *reg, const char *why);
/* Registration work (notify, revocation); drained at module exit. */
extern struct workqueue_struct *p2phub_reg_wq;
/*
 * Map @reg for @pdev (cached) and take a hold on the map. Returns the map;
 * reg->lock must not be held. p2phub_reg_map_put() drops the hold; with
 * @unmap, the last hold also unmaps and flushes the device (what UNMAP_REG
 * and the controller's release want: no address of it stays reachable).
 * p2phub_reg_map_put_importer() drops an export importer's hold and count
 * (its detach): the last hold unmaps and flushes too, unless a put without
 * @unmap handed the addresses out until teardown (map->cached). Both take
 * reg->lock, then the provider's locks (a dma-buf source's dma_resv).
 */
struct p2phub_reg_map *p2phub_reg_map_get(struct p2phub_reg *reg,
					  struct pci_dev *pdev);
void p2phub_reg_map_put(struct p2phub_reg *reg, struct p2phub_reg_map *map,
			bool unmap);
void p2phub_reg_map_put_importer(struct p2phub_reg *reg,
				 struct p2phub_reg_map *map);
void p2phub_reg_get_ref(struct p2phub_reg *reg);
void p2phub_reg_maps_free(struct list_head *maps);

/*
 * Registration lifetime (p2phub_reg.c), for the ioctls: a registration is
 * allocated (one reference, tracked), charged, set up by its provider,
 * published; p2phub_reg_kill() marks it dead unless @force and someone
 * uses it (false then); p2phub_reg_teardown() releases the pin once.
 */
struct p2phub_reg *p2phub_reg_alloc(void);
int p2phub_reg_charge(struct p2phub_reg *reg, const struct p2phub_file *pf);
bool p2phub_reg_kill(struct p2phub_reg *reg, bool force);
void p2phub_reg_teardown(struct p2phub_reg *reg);

/* p2phub_dmabuf.c */
extern const struct p2phub_provider p2phub_dmabuf_provider;
int p2phub_dmabuf_setup(struct p2phub_reg *reg, int fd, u64 offset, u64 length);

/* p2phub_nvp2p.c */
#ifdef P2PHUB_HAVE_NV_P2P
extern const struct p2phub_provider p2phub_nv_provider;
int p2phub_nv_setup(struct p2phub_reg *reg, u64 va, u64 length);
bool p2phub_nv_live(void);
#endif

/* p2phub_export.c */
int p2phub_export_create(struct p2phub_reg *reg, u32 flags);
void p2phub_export_notify(struct p2phub_reg *reg);
/*
 * move_notify on every export of @reg, then wait until their importers'
 * fences signal, for at most revoke_wait_ms. Takes no p2phub_reg.lock;
 * sleeps.
 */
void p2phub_export_revoke_sync(struct p2phub_reg *reg);
/*
 * The same for the exports whose @files were collected beforehand
 * (p2phub_export_files(), put with p2phub_export_files_put()), so that a
 * fence-signalling path allocates nothing; their resvs are only tried.
 */
struct file **p2phub_export_files(struct p2phub_reg *reg, unsigned int *n,
				  gfp_t gfp);
void p2phub_export_files_put(struct file **files, unsigned int n);
void p2phub_export_revoke_files(struct p2phub_reg *reg, struct file **files,
				unsigned int n);
/* The registration behind @dmabuf when it is one of p2phub's exports. */
struct p2phub_reg *p2phub_export_reg(struct dma_buf *dmabuf);

#endif /* _P2PHUB_REG_H */
