// SPDX-License-Identifier: GPL-2.0-only
/*
 * p2phub_fakegpu.ko: the lab's stand-in GPU (test-only, never installed).
 *
 * Binds QEMU's ivshmem-plain device (1af4:1110). Its BAR2, backed by a host
 * file, plays the GPU memory: a device DMA into it lands in that file, which
 * the tests read from outside the VM.
 *
 *   dma-buf exporter   BAR ranges exported as VRAM is: bus addresses from
 *                      dma_map_resource() for the importer, no struct pages,
 *                      peer-to-peer dynamic importers only, revocable.
 *   NVIDIA P2P API     nvidia_p2p_get_pages() and friends over a fake GPU VA
 *                      space (P2PHUB_FAKEGPU_VA_BASE maps linearly onto BAR2,
 *                      64 KiB GPU pages), with the free callback fired on
 *                      demand (P2PHUB_FAKEGPU_FREE).
 *   /dev/p2phub_fakegpu  QUERY, EXPORT_DMABUF, REVOKE, FREE, mmap of BAR2.
 *
 * It behaves like the real driver where consumers get it wrong most easily:
 *  - REVOKE of a dma-buf calls move_notify under the reservation lock,
 *    then waits (lock dropped) for every fence in the reservation object
 *    before it returns, as an exporter does before it moves memory;
 *  - the NVIDIA P2P free callback runs under fakegpu_rm_lock, the stand-in
 *    for the driver's API lock, which get_pages, put_pages and
 *    dma_map_pages also take (a consumer holding its own lock across those
 *    while its callback takes that lock deadlocks here, as with NVIDIA);
 *  - once the callback returns, the table's DMA mappings are unmapped and
 *    the table is freed (kfree: a consumer that touches it later is a
 *    use-after-free, which KASAN sees); late calls on a freed table are
 *    recognised by its address (a small record of freed tables) and
 *    tolerated, as the real driver's put_pages tolerates them;
 *  - dma_unmap_pages and free_page_table take only fakegpu_lock (the real
 *    driver's per-table lock), so they may be called under a consumer lock
 *    that its callback takes.
 * callback_delay_ms (debugfs) makes FREE sleep, holding fakegpu_rm_lock,
 * before it runs the callbacks: tests use it to line up races.
 * legacy_put_pages (module parameter) models an R470-era driver, whose
 * put_pages reads page_table->gpu_uuid before it takes the API lock and
 * looks the table up: put_pages on a table a free callback already let the
 * driver free is then a use-after-free (KASAN sees the read; the stand-in
 * counts it as misuse).
 *
 * Lock order (outer first):
 *   fakegpu_free_lock     serialises FREE and unbind
 *   fakegpu_rm_lock       the "API lock": get/put_pages, dma_map_pages, FREE
 *                         (held across free callbacks)
 *   fakegpu_lock          the device, the buffer list, the page tables
 *   dma_buf.resv          per buffer: revoked, mappings, pins
 *
 * Only one device is driven; bind attributes are suppressed, so the device
 * goes away only at rmmod, when no dma-buf (each holds a module reference)
 * and no open control file remain.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/atomic.h>
#include <linux/debugfs.h>
#include <linux/dma-buf.h>
#include <linux/dma-direction.h>
#include <linux/dma-mapping.h>
#include <linux/delay.h>
#include <linux/dma-resv.h>
#include <linux/fs.h>
#include <linux/list.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/overflow.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/sched.h>
#include <linux/seq_file.h>
#include <linux/slab.h>
#include <linux/string.h>
#include <linux/uaccess.h>

#include "p2phub_fakegpu.h"
#include "p2phub_uargs.h"

/* The dma-buf API's spelling on this kernel (conftest.sh; the same as p2phub's compat.h). */
#include "conftest.h"
#ifdef P2PHUB_HAVE_DMA_BUF_INVALIDATE_MAPPINGS
#define fakegpu_dma_buf_invalidate(dmabuf)	dma_buf_invalidate_mappings(dmabuf)
#else
#define fakegpu_dma_buf_invalidate(dmabuf)	dma_buf_move_notify(dmabuf)
#endif

#ifdef P2PHUB_FAKEGPU_NV_P2P
#include "nv-p2p.h"
#endif

#define FAKEGPU_BAR	2

static_assert(sizeof(struct p2phub_fakegpu_query) == 112);
static_assert(offsetof(struct p2phub_fakegpu_query, bufs) == 32);
static_assert(offsetof(struct p2phub_fakegpu_query, reserved) == 80);
static_assert(sizeof(struct p2phub_fakegpu_export) == 32);
static_assert(sizeof(struct p2phub_fakegpu_revoke) == 24);
static_assert(sizeof(struct p2phub_fakegpu_free) == 32);

struct fakegpu {
	struct pci_dev *pdev;		/* NULL while unbound */
	phys_addr_t bar_addr;
	u64 bar_size;
	struct miscdevice misc;
	struct dentry *debugfs;

	struct list_head bufs;		/* struct fakegpu_buf.node */
	atomic_t nbufs, nrevoked, nattach, nmaps, npins, nrefused;

	struct list_head tables;	/* live page tables: struct fakegpu_pt.node */
	struct list_head revoking;	/* tables whose free callback is due or running */
	const void *freed[64];		/* addresses of tables freed lately */
	unsigned int freed_next;
	u32 ntables, ndma_maps, ncallbacks, nunacked, nlate, nmisuse;
	u32 nrevoking;			/* tables in FREE, before their callback */
	u32 callback_delay_ms;		/* debugfs knob */
};

static DEFINE_MUTEX(fakegpu_free_lock);
static DEFINE_MUTEX(fakegpu_rm_lock);
static struct task_struct *fakegpu_rm_owner;	/* holds fakegpu_rm_lock */
static DEFINE_MUTEX(fakegpu_lock);
static struct fakegpu fg = {
	.bufs = LIST_HEAD_INIT(fg.bufs),
	.tables = LIST_HEAD_INIT(fg.tables),
	.revoking = LIST_HEAD_INIT(fg.revoking),
};

/* ------------------------------------------------------------------ dma-buf */

struct fakegpu_buf {
	struct dma_buf *dmabuf;
	struct list_head node;		/* fg.bufs, under fakegpu_lock */
	u64 offset;			/* in BAR2 */
	u64 length;
	bool revoked;			/* under dmabuf->resv */
	unsigned int mappings;		/* under dmabuf->resv */
	unsigned int pins;		/* under dmabuf->resv */
	atomic_t attachments;
};

static const struct dma_buf_ops fakegpu_dmabuf_ops;

static int fakegpu_dmabuf_attach(struct dma_buf *dmabuf,
				 struct dma_buf_attachment *attach)
{
	struct fakegpu_buf *buf = dmabuf->priv;

	/* VRAM behind a BAR: only importers that can do peer-to-peer. */
	if (!attach->peer2peer) {
		atomic_inc(&fg.nrefused);
		dev_info_ratelimited(&fg.pdev->dev,
				     "dma-buf %llu: refusing %s, importer does not allow peer-to-peer\n",
				     (unsigned long long)file_inode(dmabuf->file)->i_ino,
				     dev_name(attach->dev));
		return -EOPNOTSUPP;
	}
	if (!attach->dev->dma_mask) {
		atomic_inc(&fg.nrefused);
		return -EOPNOTSUPP;
	}
	/* Unlocked peek; map_dma_buf checks again under the reservation lock. */
	if (READ_ONCE(buf->revoked)) {
		atomic_inc(&fg.nrefused);
		return -ENODEV;
	}
	atomic_inc(&buf->attachments);
	atomic_inc(&fg.nattach);
	return 0;
}

static void fakegpu_dmabuf_detach(struct dma_buf *dmabuf,
				  struct dma_buf_attachment *attach)
{
	struct fakegpu_buf *buf = dmabuf->priv;

	atomic_dec(&buf->attachments);
	atomic_dec(&fg.nattach);
}

/*
 * Called for every map when CONFIG_DMABUF_MOVE_NOTIFY is off (the dma-buf
 * core pins on behalf of dynamic importers), and by importers that pin.
 */
static int fakegpu_dmabuf_pin(struct dma_buf_attachment *attach)
{
	struct fakegpu_buf *buf = attach->dmabuf->priv;

	dma_resv_assert_held(attach->dmabuf->resv);
	if (buf->revoked)
		return -ENODEV;
	buf->pins++;
	atomic_inc(&fg.npins);
	return 0;
}

static void fakegpu_dmabuf_unpin(struct dma_buf_attachment *attach)
{
	struct fakegpu_buf *buf = attach->dmabuf->priv;

	dma_resv_assert_held(attach->dmabuf->resv);
	if (buf->pins) {
		buf->pins--;
		atomic_dec(&fg.npins);
	}
}

/*
 * One IOVA (or bus address) range for the whole buffer, split into
 * segments the importing device accepts. The table has no pages: only
 * sg_dma_address()/sg_dma_len() are meaningful.
 */
static struct sg_table *fakegpu_dmabuf_map(struct dma_buf_attachment *attach,
					   enum dma_data_direction dir)
{
	struct fakegpu_buf *buf = attach->dmabuf->priv;
	struct scatterlist *sg;
	struct sg_table *sgt;
	unsigned int seg, nents, i;
	dma_addr_t dma;
	u64 done;
	int ret;

	dma_resv_assert_held(attach->dmabuf->resv);
	if (buf->revoked)
		return ERR_PTR(-ENODEV);
	if (!valid_dma_direction(dir))
		return ERR_PTR(-EINVAL);

	seg = round_down(dma_get_max_seg_size(attach->dev), PAGE_SIZE);
	if (!seg)
		seg = PAGE_SIZE;
	nents = DIV_ROUND_UP_ULL(buf->length, seg);

	sgt = kzalloc(sizeof(*sgt), GFP_KERNEL);
	if (!sgt)
		return ERR_PTR(-ENOMEM);
	ret = sg_alloc_table(sgt, nents, GFP_KERNEL);
	if (ret)
		goto err_free_sgt;

	dma = dma_map_resource(attach->dev, fg.bar_addr + buf->offset,
			       buf->length, dir, DMA_ATTR_SKIP_CPU_SYNC);
	if (dma_mapping_error(attach->dev, dma)) {
		dev_warn_ratelimited(&fg.pdev->dev,
				     "dma-buf %llu: cannot map BAR [%#llx, +%#llx) for %s\n",
				     (unsigned long long)file_inode(attach->dmabuf->file)->i_ino,
				     buf->offset, buf->length,
				     dev_name(attach->dev));
		ret = -EIO;
		goto err_free_table;
	}

	done = 0;
	for_each_sgtable_dma_sg(sgt, sg, i) {
		unsigned int len = min_t(u64, seg, buf->length - done);

		sg_dma_address(sg) = dma + done;
		sg_dma_len(sg) = len;
		done += len;
	}

	buf->mappings++;
	atomic_inc(&fg.nmaps);
	return sgt;

err_free_table:
	sg_free_table(sgt);
err_free_sgt:
	kfree(sgt);
	return ERR_PTR(ret);
}

static void fakegpu_dmabuf_unmap(struct dma_buf_attachment *attach,
				 struct sg_table *sgt,
				 enum dma_data_direction dir)
{
	struct fakegpu_buf *buf = attach->dmabuf->priv;

	dma_resv_assert_held(attach->dmabuf->resv);
	dma_unmap_resource(attach->dev, sg_dma_address(sgt->sgl), buf->length,
			   dir, DMA_ATTR_SKIP_CPU_SYNC);
	sg_free_table(sgt);
	kfree(sgt);
	buf->mappings--;
	atomic_dec(&fg.nmaps);
}

static void fakegpu_dmabuf_release(struct dma_buf *dmabuf)
{
	struct fakegpu_buf *buf = dmabuf->priv;

	mutex_lock(&fakegpu_lock);
	list_del(&buf->node);
	mutex_unlock(&fakegpu_lock);
	if (buf->revoked)
		atomic_dec(&fg.nrevoked);
	atomic_dec(&fg.nbufs);
	kfree(buf);
}

static const struct dma_buf_ops fakegpu_dmabuf_ops = {
	.attach		= fakegpu_dmabuf_attach,
	.detach		= fakegpu_dmabuf_detach,
	.pin		= fakegpu_dmabuf_pin,
	.unpin		= fakegpu_dmabuf_unpin,
	.map_dma_buf	= fakegpu_dmabuf_map,
	.unmap_dma_buf	= fakegpu_dmabuf_unmap,
	.release	= fakegpu_dmabuf_release,
};

/* ------------------------------------------------------------------ NVIDIA P2P */

#ifdef P2PHUB_FAKEGPU_NV_P2P

enum fakegpu_pt_state {
	FAKEGPU_PT_LIVE,	/* handed out, callback armed */
	FAKEGPU_PT_REVOKING,	/* free callback due or running; freed after */
};

struct fakegpu_pt {
	struct nvidia_p2p_page_table pt;	/* what the consumer holds */
	struct list_head node;		/* fg.tables or fg.revoking */
	enum fakegpu_pt_state state;
	bool persistent;
	bool acked;			/* nvidia_p2p_free_page_table() seen */
	u64 va;
	u64 length;
	void (*free_callback)(void *data);
	void *data;
	struct list_head maps;		/* struct fakegpu_map.node */
	struct nvidia_p2p_page *page_array;
	u8 uuid[NVIDIA_P2P_GPU_UUID_LEN];
};

struct fakegpu_map {
	struct nvidia_p2p_dma_mapping m;	/* what the consumer holds */
	struct list_head node;			/* fakegpu_pt.maps */
};

#define fakegpu_misuse(fmt, ...)					\
	do {								\
		fg.nmisuse++;						\
		pr_notice_ratelimited("nvidia_p2p misuse: " fmt, ##__VA_ARGS__); \
	} while (0)

/* The driver's API lock. */
static void fakegpu_rm_lock_acquire(void)
{
	mutex_lock(&fakegpu_rm_lock);
	WRITE_ONCE(fakegpu_rm_owner, current);
}

static void fakegpu_rm_lock_release(void)
{
	WRITE_ONCE(fakegpu_rm_owner, NULL);
	mutex_unlock(&fakegpu_rm_lock);
}

/*
 * Called from inside a free callback (this thread holds the API lock): a
 * call that takes the lock again would deadlock. Refuse it as misuse.
 */
static bool fakegpu_in_callback(const char *fn)
{
	if (READ_ONCE(fakegpu_rm_owner) != current)
		return false;
	mutex_lock(&fakegpu_lock);
	fakegpu_misuse("%s: called from a free callback\n", fn);
	mutex_unlock(&fakegpu_lock);
	return true;
}

/* Caller holds fakegpu_lock. Finds a live or revoking table, or NULL. */
static struct fakegpu_pt *fakegpu_pt_find(struct nvidia_p2p_page_table *pt)
{
	struct list_head *lists[] = { &fg.tables, &fg.revoking };
	struct fakegpu_pt *fpt;
	unsigned int i;

	lockdep_assert_held(&fakegpu_lock);
	for (i = 0; i < ARRAY_SIZE(lists); i++)
		list_for_each_entry(fpt, lists[i], node)
			if (&fpt->pt == pt)
				return fpt;
	return NULL;
}

/* Caller holds fakegpu_lock. Whether @pt is a table freed lately. */
static bool fakegpu_pt_was_freed(const void *pt)
{
	unsigned int i;

	lockdep_assert_held(&fakegpu_lock);
	for (i = 0; i < ARRAY_SIZE(fg.freed); i++)
		if (pt && fg.freed[i] == pt)
			return true;
	return false;
}

/* Caller holds fakegpu_lock; @fpt is off every list. */
static void fakegpu_pt_note_freed(struct fakegpu_pt *fpt)
{
	lockdep_assert_held(&fakegpu_lock);
	fg.freed[fg.freed_next++ % ARRAY_SIZE(fg.freed)] = &fpt->pt;
}

static void fakegpu_pt_free(struct fakegpu_pt *fpt)
{
	kvfree(fpt->pt.pages);
	kvfree(fpt->page_array);
	kfree(fpt);
}

/* Caller holds fakegpu_lock. */
static void fakegpu_map_release(struct fakegpu_map *fm)
{
	u32 i;

	lockdep_assert_held(&fakegpu_lock);
	for (i = 0; i < fm->m.entries; i++)
		dma_unmap_resource(&fm->m.pci_dev->dev, fm->m.dma_addresses[i],
				   P2PHUB_FAKEGPU_GPU_PAGE_SIZE,
				   DMA_BIDIRECTIONAL, DMA_ATTR_SKIP_CPU_SYNC);
	list_del(&fm->node);
	pci_dev_put(fm->m.pci_dev);
	kvfree(fm->m.dma_addresses);
	kfree(fm);
	fg.ndma_maps--;
}

/* Caller holds fakegpu_lock. Returns how many mappings it had to drop. */
static unsigned int fakegpu_pt_drop_maps(struct fakegpu_pt *fpt)
{
	struct fakegpu_map *fm, *tmp;
	unsigned int n = 0;

	list_for_each_entry_safe(fm, tmp, &fpt->maps, node) {
		fakegpu_map_release(fm);
		n++;
	}
	return n;
}

static int fakegpu_get_pages(u64 va, u64 length,
			     struct nvidia_p2p_page_table **page_table,
			     void (*free_callback)(void *data), void *data,
			     bool persistent)
{
	struct fakegpu_pt *fpt;
	u64 end, off, i;
	u32 entries;
	int ret;

	if (fakegpu_in_callback("get_pages"))
		return -EINVAL;
	fakegpu_rm_lock_acquire();
	mutex_lock(&fakegpu_lock);
	if (!page_table) {
		fakegpu_misuse("get_pages: NULL page_table pointer\n");
		ret = -EINVAL;
		goto out_unlock;
	}
	*page_table = NULL;
	if (!fg.pdev) {
		ret = -ENODEV;
		goto out_unlock;
	}
	if (!length || !IS_ALIGNED(va, P2PHUB_FAKEGPU_GPU_PAGE_SIZE) ||
	    !IS_ALIGNED(length, P2PHUB_FAKEGPU_GPU_PAGE_SIZE) ||
	    check_add_overflow(va, length, &end) ||
	    va < P2PHUB_FAKEGPU_VA_BASE ||
	    end > P2PHUB_FAKEGPU_VA_BASE + fg.bar_size) {
		fakegpu_misuse("get_pages: bad range va %#llx length %#llx (64 KiB aligned, inside [%#llx, +%#llx) expected)\n",
			       va, length, P2PHUB_FAKEGPU_VA_BASE, fg.bar_size);
		ret = -EINVAL;
		goto out_unlock;
	}
	off = va - P2PHUB_FAKEGPU_VA_BASE;
	entries = length / P2PHUB_FAKEGPU_GPU_PAGE_SIZE;

	ret = -ENOMEM;
	fpt = kzalloc(sizeof(*fpt), GFP_KERNEL);
	if (!fpt)
		goto out_unlock;
	fpt->page_array = kvcalloc(entries, sizeof(*fpt->page_array), GFP_KERNEL);
	fpt->pt.pages = kvcalloc(entries, sizeof(*fpt->pt.pages), GFP_KERNEL);
	if (!fpt->page_array || !fpt->pt.pages)
		goto err_free_pt;

	for (i = 0; i < entries; i++) {
		fpt->page_array[i].physical_address = fg.bar_addr + off +
			i * P2PHUB_FAKEGPU_GPU_PAGE_SIZE;
		fpt->pt.pages[i] = &fpt->page_array[i];
	}
	/* A stable fake UUID: "p2phub-fakegpu" plus the device's BDF. */
	memcpy(fpt->uuid, "p2phubfakegpu", 13);
	fpt->uuid[13] = fg.pdev->bus->number;
	fpt->uuid[14] = fg.pdev->devfn;
	fpt->pt.version = NVIDIA_P2P_PAGE_TABLE_VERSION;
	fpt->pt.page_size = NVIDIA_P2P_PAGE_SIZE_64KB;
	fpt->pt.entries = entries;
	fpt->pt.gpu_uuid = fpt->uuid;
	fpt->va = va;
	fpt->length = length;
	fpt->persistent = persistent;
	fpt->free_callback = free_callback;
	fpt->data = data;
	fpt->state = FAKEGPU_PT_LIVE;
	INIT_LIST_HEAD(&fpt->maps);

	list_add_tail(&fpt->node, &fg.tables);
	fg.ntables++;
	*page_table = &fpt->pt;
	mutex_unlock(&fakegpu_lock);
	fakegpu_rm_lock_release();
	return 0;

err_free_pt:
	fakegpu_pt_free(fpt);
out_unlock:
	mutex_unlock(&fakegpu_lock);
	fakegpu_rm_lock_release();
	return ret;
}

int nvidia_p2p_get_pages(uint64_t p2p_token, uint32_t va_space,
			 uint64_t virtual_address, uint64_t length,
			 struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data)
{
	/* The real driver insists on a callback for non-persistent pages. */
	if (!free_callback) {
		mutex_lock(&fakegpu_lock);
		fakegpu_misuse("get_pages: no free callback (use the persistent variant)\n");
		mutex_unlock(&fakegpu_lock);
		return -EINVAL;
	}
	return fakegpu_get_pages(virtual_address, length, page_table,
				 free_callback, data, false);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_get_pages);

int nvidia_p2p_get_pages_persistent(uint64_t virtual_address, uint64_t length,
				    struct nvidia_p2p_page_table **page_table,
				    uint32_t flags)
{
	if (flags) {
		mutex_lock(&fakegpu_lock);
		fakegpu_misuse("get_pages_persistent: flags %#x must be 0\n", flags);
		mutex_unlock(&fakegpu_lock);
		return -EINVAL;
	}
	return fakegpu_get_pages(virtual_address, length, page_table,
				 NULL, NULL, true);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_get_pages_persistent);

static bool legacy_put_pages;
module_param(legacy_put_pages, bool, 0644);
MODULE_PARM_DESC(legacy_put_pages,
		 "put_pages reads the page table's gpu_uuid before taking the API lock, as R470-era drivers do (default off)");

/*
 * R470-era put_pages: the table's GPU UUID is read first, unlocked, to find
 * the GPU. On a table already freed that read is a use-after-free.
 */
static void fakegpu_put_pages_legacy_read(struct nvidia_p2p_page_table *pt,
					  const char *fn)
{
	u8 uuid[NVIDIA_P2P_GPU_UUID_LEN];

	memcpy(uuid, pt->gpu_uuid, sizeof(uuid));	/* KASAN: use-after-free */
	mutex_lock(&fakegpu_lock);
	if (!fakegpu_pt_find(pt) && fakegpu_pt_was_freed(pt))
		fakegpu_misuse("%s: read gpu_uuid of page table %p, which the driver already freed (a use-after-free with R470-era drivers)\n",
			       fn, pt);
	mutex_unlock(&fakegpu_lock);
}

static int fakegpu_put_pages(u64 va, struct nvidia_p2p_page_table *pt,
			     bool persistent)
{
	const char *fn = persistent ? "put_pages_persistent" : "put_pages";
	struct fakegpu_pt *fpt;
	unsigned int dropped;
	int ret = 0;

	if (!pt)
		return 0;	/* as the real driver */
	if (READ_ONCE(legacy_put_pages))
		fakegpu_put_pages_legacy_read(pt, fn);
	if (fakegpu_in_callback(fn))
		return -EINVAL;	/* the contract: never put in the callback */

	fakegpu_rm_lock_acquire();
	mutex_lock(&fakegpu_lock);
	fpt = fakegpu_pt_find(pt);
	if (!fpt) {
		if (fakegpu_pt_was_freed(pt)) {
			/* After the free callback: the real driver returns 0. */
			fg.nlate++;
		} else {
			fakegpu_misuse("%s: unknown page table %p\n", fn, pt);
			ret = -EINVAL;
		}
		goto out_unlock;
	}
	/* Under the API lock a table is never seen mid-callback. */
	WARN_ON_ONCE(fpt->state != FAKEGPU_PT_LIVE);
	if (fpt->persistent != persistent) {
		fakegpu_misuse("%s: page table va %#llx was got with the other variant\n",
			       fn, fpt->va);
		ret = -EINVAL;
		goto out_unlock;
	}
	if (va != fpt->va) {
		fakegpu_misuse("%s: va %#llx does not match the table's %#llx\n",
			       fn, va, fpt->va);
		ret = -EINVAL;
		goto out_unlock;
	}
	dropped = fakegpu_pt_drop_maps(fpt);
	if (dropped)
		pr_notice_ratelimited("%s: va %#llx still had %u DMA mapping(s); unmapped them\n",
				      fn, fpt->va, dropped);
	list_del(&fpt->node);
	fg.ntables--;
	fakegpu_pt_note_freed(fpt);
	mutex_unlock(&fakegpu_lock);
	fakegpu_rm_lock_release();
	fakegpu_pt_free(fpt);
	return 0;

out_unlock:
	mutex_unlock(&fakegpu_lock);
	fakegpu_rm_lock_release();
	return ret;
}

int nvidia_p2p_put_pages(uint64_t p2p_token, uint32_t va_space,
			 uint64_t virtual_address,
			 struct nvidia_p2p_page_table *page_table)
{
	return fakegpu_put_pages(virtual_address, page_table, false);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_put_pages);

int nvidia_p2p_put_pages_persistent(uint64_t virtual_address,
				    struct nvidia_p2p_page_table *page_table,
				    uint32_t flags)
{
	if (flags) {
		mutex_lock(&fakegpu_lock);
		fakegpu_misuse("put_pages_persistent: flags %#x must be 0\n", flags);
		mutex_unlock(&fakegpu_lock);
		return -EINVAL;
	}
	return fakegpu_put_pages(virtual_address, page_table, true);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_put_pages_persistent);

/*
 * A no-op in the real driver, which frees the table itself once the free
 * callback returns. Here it acknowledges the callback, and is refused on a
 * table that is still live (put_pages releases those).
 */
int nvidia_p2p_free_page_table(struct nvidia_p2p_page_table *page_table)
{
	struct fakegpu_pt *fpt;
	int ret = 0;

	mutex_lock(&fakegpu_lock);
	fpt = page_table ? fakegpu_pt_find(page_table) : NULL;
	if (!fpt) {
		if (fakegpu_pt_was_freed(page_table)) {
			fg.nlate++;
		} else {
			fakegpu_misuse("free_page_table: unknown page table %p\n",
				       page_table);
			ret = -EINVAL;
		}
	} else if (fpt->state == FAKEGPU_PT_LIVE) {
		fakegpu_misuse("free_page_table: va %#llx is live, release it with put_pages\n",
			       fpt->va);
		ret = -EINVAL;
	} else {
		fpt->acked = true;
	}
	mutex_unlock(&fakegpu_lock);
	return ret;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_free_page_table);

int nvidia_p2p_dma_map_pages(struct pci_dev *peer,
			     struct nvidia_p2p_page_table *page_table,
			     struct nvidia_p2p_dma_mapping **dma_mapping)
{
	struct fakegpu_pt *fpt;
	struct fakegpu_map *fm;
	u32 i, n;
	int ret;

	if (fakegpu_in_callback("dma_map_pages"))
		return -EINVAL;
	fakegpu_rm_lock_acquire();
	mutex_lock(&fakegpu_lock);
	if (!peer || !page_table || !dma_mapping) {
		fakegpu_misuse("dma_map_pages: NULL argument\n");
		ret = -EINVAL;
		goto out_unlock;
	}
	*dma_mapping = NULL;
	fpt = fakegpu_pt_find(page_table);
	if (!fpt) {
		if (fakegpu_pt_was_freed(page_table)) {
			/* The real driver's open window (a use-after-free). */
			fg.nlate++;
		} else {
			fakegpu_misuse("dma_map_pages: unknown page table %p\n",
				       page_table);
		}
		ret = -EINVAL;
		goto out_unlock;
	}
	WARN_ON_ONCE(fpt->state != FAKEGPU_PT_LIVE);
	n = fpt->pt.entries;

	ret = -ENOMEM;
	fm = kzalloc(sizeof(*fm), GFP_KERNEL);
	if (!fm)
		goto out_unlock;
	fm->m.dma_addresses = kvcalloc(n, sizeof(*fm->m.dma_addresses), GFP_KERNEL);
	if (!fm->m.dma_addresses)
		goto err_free_map;

	/* One mapping per GPU page, as the real driver makes them. */
	for (i = 0; i < n; i++) {
		dma_addr_t dma;

		dma = dma_map_resource(&peer->dev,
				       fpt->pt.pages[i]->physical_address,
				       P2PHUB_FAKEGPU_GPU_PAGE_SIZE,
				       DMA_BIDIRECTIONAL, DMA_ATTR_SKIP_CPU_SYNC);
		if (dma_mapping_error(&peer->dev, dma)) {
			dev_warn_ratelimited(&fg.pdev->dev,
					     "cannot map GPU page %#llx for %s\n",
					     fpt->va + (u64)i * P2PHUB_FAKEGPU_GPU_PAGE_SIZE,
					     pci_name(peer));
			ret = -EIO;
			goto err_unmap;
		}
		fm->m.dma_addresses[i] = dma;
	}
	fm->m.version = NVIDIA_P2P_DMA_MAPPING_VERSION;
	fm->m.page_size_type = fpt->pt.page_size;
	fm->m.entries = n;
	fm->m.pci_dev = pci_dev_get(peer);
	list_add_tail(&fm->node, &fpt->maps);
	fg.ndma_maps++;
	*dma_mapping = &fm->m;
	mutex_unlock(&fakegpu_lock);
	fakegpu_rm_lock_release();
	return 0;

err_unmap:
	while (i--)
		dma_unmap_resource(&peer->dev, fm->m.dma_addresses[i],
				   P2PHUB_FAKEGPU_GPU_PAGE_SIZE,
				   DMA_BIDIRECTIONAL, DMA_ATTR_SKIP_CPU_SYNC);
	kvfree(fm->m.dma_addresses);
err_free_map:
	kfree(fm);
out_unlock:
	mutex_unlock(&fakegpu_lock);
	fakegpu_rm_lock_release();
	return ret;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_dma_map_pages);

/* Caller holds fakegpu_lock. */
static struct fakegpu_map *fakegpu_map_find(struct fakegpu_pt *fpt,
					    struct nvidia_p2p_dma_mapping *m)
{
	struct fakegpu_map *fm;

	list_for_each_entry(fm, &fpt->maps, node)
		if (&fm->m == m)
			return fm;
	return NULL;
}

/* Takes only the table's lock (fakegpu_lock here), as the real driver. */
int nvidia_p2p_dma_unmap_pages(struct pci_dev *peer,
			       struct nvidia_p2p_page_table *page_table,
			       struct nvidia_p2p_dma_mapping *dma_mapping)
{
	struct fakegpu_map *fm;
	struct fakegpu_pt *fpt;
	int ret = 0;

	mutex_lock(&fakegpu_lock);
	if (!peer || !page_table || !dma_mapping) {
		fakegpu_misuse("dma_unmap_pages: NULL argument\n");
		ret = -EINVAL;
		goto out_unlock;
	}
	fpt = fakegpu_pt_find(page_table);
	if (!fpt) {
		/* The real driver would down() a freed semaphore here. */
		fakegpu_misuse("dma_unmap_pages: %s page table %p\n",
			       fakegpu_pt_was_freed(page_table) ? "freed" : "unknown",
			       page_table);
		ret = -EINVAL;
		goto out_unlock;
	}
	fm = fakegpu_map_find(fpt, dma_mapping);
	if (!fm) {
		if (fpt->state == FAKEGPU_PT_LIVE) {
			fakegpu_misuse("dma_unmap_pages: mapping %p is not of va %#llx\n",
				       dma_mapping, fpt->va);
			ret = -EINVAL;
		} else {
			fg.nlate++;
		}
		goto out_unlock;
	}
	if (fm->m.pci_dev != peer) {
		fakegpu_misuse("dma_unmap_pages: mapping of va %#llx belongs to %s, not %s\n",
			       fpt->va, pci_name(fm->m.pci_dev), pci_name(peer));
		ret = -EINVAL;
		goto out_unlock;
	}
	fakegpu_map_release(fm);
out_unlock:
	mutex_unlock(&fakegpu_lock);
	return ret;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_dma_unmap_pages);

/* A no-op in the real driver too: the free path releases what is left. */
int nvidia_p2p_free_dma_mapping(struct nvidia_p2p_dma_mapping *dma_mapping)
{
	return dma_mapping ? 0 : -EINVAL;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_free_dma_mapping);

int nvidia_p2p_init_mapping(uint64_t p2p_token, struct nvidia_p2p_params *params,
			    void (*destroy_callback)(void *data), void *data)
{
	return -ENOTSUPP;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_init_mapping);

int nvidia_p2p_destroy_mapping(uint64_t p2p_token)
{
	return -ENOTSUPP;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_destroy_mapping);

/*
 * Fire the free callback of every live, non-persistent table overlapping
 * [va, end), as the GPU driver does on cudaFree(): under the API lock,
 * then unmap what the consumers left and free the tables. Caller holds
 * fakegpu_free_lock. Returns the number of callbacks run.
 */
static unsigned int fakegpu_nv_revoke(u64 va, u64 end)
{
	struct fakegpu_pt *fpt, *tmp;
	unsigned int n = 0, dropped;
	LIST_HEAD(dead);

	lockdep_assert_held(&fakegpu_free_lock);
	fakegpu_rm_lock_acquire();
	mutex_lock(&fakegpu_lock);
	list_for_each_entry_safe(fpt, tmp, &fg.tables, node) {
		if (fpt->persistent || fpt->va >= end || fpt->va + fpt->length <= va)
			continue;
		fpt->state = FAKEGPU_PT_REVOKING;
		list_move_tail(&fpt->node, &fg.revoking);
		fg.ntables--;
		n++;
	}
	fg.nrevoking = n;
	mutex_unlock(&fakegpu_lock);

	if (n && READ_ONCE(fg.callback_delay_ms))
		msleep(READ_ONCE(fg.callback_delay_ms));

	/* Only this path moves tables out of fg.revoking: walk it unlocked. */
	WRITE_ONCE(fg.nrevoking, 0);
	list_for_each_entry(fpt, &fg.revoking, node)
		fpt->free_callback(fpt->data);

	mutex_lock(&fakegpu_lock);
	list_for_each_entry_safe(fpt, tmp, &fg.revoking, node) {
		dropped = fakegpu_pt_drop_maps(fpt);
		if (!fpt->acked) {
			fg.nunacked++;
			pr_notice_ratelimited("free callback of va %#llx returned without nvidia_p2p_free_page_table()\n",
					      fpt->va);
		}
		if (dropped)
			pr_debug("free of va %#llx unmapped %u DMA mapping(s)\n",
				 fpt->va, dropped);
		list_move_tail(&fpt->node, &dead);
		fakegpu_pt_note_freed(fpt);
		fg.ncallbacks++;
	}
	mutex_unlock(&fakegpu_lock);
	fakegpu_rm_lock_release();

	/* Gone, as in the real driver: later use by a consumer is a UAF. */
	list_for_each_entry_safe(fpt, tmp, &dead, node)
		fakegpu_pt_free(fpt);
	return n;
}

/* At unbind (rmmod): nobody can hold our symbols any more. */
static void fakegpu_nv_teardown(void)
{
	struct fakegpu_pt *fpt, *tmp;

	mutex_lock(&fakegpu_lock);
	if (fg.ntables)
		pr_err("p2phub: leak: %u NVIDIA P2P page table(s) never released\n",
		       fg.ntables);
	list_for_each_entry_safe(fpt, tmp, &fg.tables, node) {
		fakegpu_pt_drop_maps(fpt);
		list_del(&fpt->node);
		fakegpu_pt_free(fpt);
	}
	fg.ntables = 0;
	mutex_unlock(&fakegpu_lock);
}

#else /* !P2PHUB_FAKEGPU_NV_P2P */

static unsigned int fakegpu_nv_revoke(u64 va, u64 end)
{
	return 0;
}

static void fakegpu_nv_teardown(void)
{
}

#endif /* P2PHUB_FAKEGPU_NV_P2P */

/* ------------------------------------------------------------------ ioctls */

static long fakegpu_ioctl_query(void __user *uarg)
{
	struct p2phub_fakegpu_query q;
	int ret;

	ret = p2phub_copy_args(&q, sizeof(q), uarg, 0);
	if (ret)
		return ret;
	if (memchr_inv(q.reserved, 0, sizeof(q.reserved)))
		return -EINVAL;

	memset(&q, 0, sizeof(q));
	q.argsz = sizeof(q);
	q.bar_size = fg.bar_size;
	q.bar_addr = fg.bar_addr;
	q.va_base = P2PHUB_FAKEGPU_VA_BASE;
	q.bufs = atomic_read(&fg.nbufs);
	q.bufs_revoked = atomic_read(&fg.nrevoked);
	q.attachments = atomic_read(&fg.nattach);
	q.mappings = atomic_read(&fg.nmaps);
	q.pins = atomic_read(&fg.npins);
	q.attach_refused = atomic_read(&fg.nrefused);
	mutex_lock(&fakegpu_lock);
	q.page_tables = fg.ntables;
	q.dma_mappings = fg.ndma_maps;
	q.callbacks = fg.ncallbacks;
	q.callbacks_unacked = fg.nunacked;
	q.late_calls = fg.nlate;
	q.misuse = fg.nmisuse;
	mutex_unlock(&fakegpu_lock);

	if (copy_to_user(uarg, &q, sizeof(q)))
		return -EFAULT;
	return 0;
}

static long fakegpu_ioctl_export(void __user *uarg)
{
	DEFINE_DMA_BUF_EXPORT_INFO(exp);
	struct p2phub_fakegpu_export args;
	struct fakegpu_buf *buf;
	struct dma_buf *dmabuf;
	u64 end;
	int ret, fd;

	ret = p2phub_copy_args(&args, sizeof(args), uarg, 0);
	if (ret)
		return ret;
	if (args.reserved)
		return -EINVAL;
	if (!args.length ||
	    !IS_ALIGNED(args.offset, P2PHUB_FAKEGPU_EXPORT_ALIGN) ||
	    !IS_ALIGNED(args.length, P2PHUB_FAKEGPU_EXPORT_ALIGN))
		return -EINVAL;
	if (check_add_overflow(args.offset, args.length, &end) ||
	    end > fg.bar_size)
		return -ERANGE;

	buf = kzalloc(sizeof(*buf), GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	buf->offset = args.offset;
	buf->length = args.length;
	atomic_set(&buf->attachments, 0);

	exp.ops = &fakegpu_dmabuf_ops;
	exp.size = args.length;
	exp.flags = O_RDWR;
	exp.priv = buf;
	dmabuf = dma_buf_export(&exp);
	if (IS_ERR(dmabuf)) {
		ret = PTR_ERR(dmabuf);
		goto err_free_buf;
	}
	buf->dmabuf = dmabuf;
	mutex_lock(&fakegpu_lock);
	list_add_tail(&buf->node, &fg.bufs);
	mutex_unlock(&fakegpu_lock);
	atomic_inc(&fg.nbufs);

	/* From here on dma_buf_put() frees buf through the release op. */
	fd = dma_buf_fd(dmabuf, O_CLOEXEC);
	if (fd < 0) {
		ret = fd;
		goto err_put_dmabuf;
	}
	args.fd = fd;
	if (copy_to_user(uarg, &args, sizeof(args))) {
		/* The fd is installed: user space owns it now, as with any leak of its own. */
		return -EFAULT;
	}
	return 0;

err_put_dmabuf:
	dma_buf_put(dmabuf);
	return ret;
err_free_buf:
	kfree(buf);
	return ret;
}

static long fakegpu_ioctl_revoke(void __user *uarg)
{
	struct p2phub_fakegpu_revoke args;
	struct fakegpu_buf *buf;
	struct dma_buf *dmabuf;
	int ret;

	ret = p2phub_copy_args(&args, sizeof(args), uarg, 0);
	if (ret)
		return ret;
	if (args.reserved || args.mappings_left || args.pins_left)
		return -EINVAL;

	dmabuf = dma_buf_get(args.fd);
	if (IS_ERR(dmabuf))
		return PTR_ERR(dmabuf);
	if (dmabuf->ops != &fakegpu_dmabuf_ops) {
		ret = -EINVAL;
		goto out_put;
	}
	buf = dmabuf->priv;

	ret = dma_resv_lock_interruptible(dmabuf->resv, NULL);
	if (ret)
		goto out_put;
	if (!buf->revoked) {
		WRITE_ONCE(buf->revoked, true);
		atomic_inc(&fg.nrevoked);
		/* Reaches every dynamic importer, CONFIG_DMABUF_MOVE_NOTIFY or not. */
		fakegpu_dma_buf_invalidate(dmabuf);
	}
	dma_resv_unlock(dmabuf->resv);

	/*
	 * As an exporter does before it moves memory: wait for the fences the
	 * importers added (work still using the old mapping).
	 */
	if (dma_resv_wait_timeout(dmabuf->resv, DMA_RESV_USAGE_BOOKKEEP, true,
				  MAX_SCHEDULE_TIMEOUT) < 0) {
		ret = -EINTR;
		goto out_put;
	}
	dma_resv_lock(dmabuf->resv, NULL);
	args.mappings_left = buf->mappings;
	args.pins_left = buf->pins;
	dma_resv_unlock(dmabuf->resv);

	if (copy_to_user(uarg, &args, sizeof(args)))
		ret = -EFAULT;
out_put:
	dma_buf_put(dmabuf);
	return ret;
}

static long fakegpu_ioctl_free(void __user *uarg)
{
	struct p2phub_fakegpu_free args;
	u64 end;
	int ret;

	ret = p2phub_copy_args(&args, sizeof(args), uarg, 0);
	if (ret)
		return ret;
	if (args.reserved || args.callbacks || !args.length)
		return -EINVAL;
	if (check_add_overflow(args.va, args.length, &end))
		return -ERANGE;

	mutex_lock(&fakegpu_free_lock);
	args.callbacks = fakegpu_nv_revoke(args.va, end);
	mutex_unlock(&fakegpu_free_lock);
	if (!args.callbacks)
		return -ENOENT;
	if (copy_to_user(uarg, &args, sizeof(args)))
		return -EFAULT;
	return 0;
}

static long fakegpu_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	void __user *uarg = (void __user *)arg;

	switch (cmd) {
	case P2PHUB_FAKEGPU_QUERY:
		return fakegpu_ioctl_query(uarg);
	case P2PHUB_FAKEGPU_EXPORT_DMABUF:
		return fakegpu_ioctl_export(uarg);
	case P2PHUB_FAKEGPU_REVOKE:
		return fakegpu_ioctl_revoke(uarg);
	case P2PHUB_FAKEGPU_FREE:
		return fakegpu_ioctl_free(uarg);
	default:
		return -ENOTTY;
	}
}

/* The GPU's own view of its memory: BAR2, uncached, shared mappings only. */
static int fakegpu_mmap(struct file *file, struct vm_area_struct *vma)
{
	u64 off = (u64)vma->vm_pgoff << PAGE_SHIFT;
	u64 len = vma->vm_end - vma->vm_start;
	u64 end;

	if (!(vma->vm_flags & VM_SHARED))
		return -EINVAL;
	if (check_add_overflow(off, len, &end) || end > fg.bar_size)
		return -EINVAL;
	vma->vm_page_prot = pgprot_noncached(vma->vm_page_prot);
	return io_remap_pfn_range(vma, vma->vm_start,
				  (fg.bar_addr + off) >> PAGE_SHIFT, len,
				  vma->vm_page_prot);
}

static const struct file_operations fakegpu_fops = {
	.owner		= THIS_MODULE,
	.unlocked_ioctl	= fakegpu_ioctl,
	.compat_ioctl	= compat_ptr_ioctl,
	.mmap		= fakegpu_mmap,
	.llseek		= noop_llseek,
};

/* ------------------------------------------------------------------ debugfs */

static int fakegpu_state_show(struct seq_file *m, void *unused)
{
	struct fakegpu_buf *buf;

	seq_printf(m, "bar2 %#llx size %#llx va_base %#llx\n", (u64)fg.bar_addr,
		   fg.bar_size, P2PHUB_FAKEGPU_VA_BASE);
	seq_printf(m, "dmabufs %d revoked %d attachments %d mappings %d pins %d refused %d\n",
		   atomic_read(&fg.nbufs), atomic_read(&fg.nrevoked),
		   atomic_read(&fg.nattach), atomic_read(&fg.nmaps),
		   atomic_read(&fg.npins), atomic_read(&fg.nrefused));
	mutex_lock(&fakegpu_lock);
	list_for_each_entry(buf, &fg.bufs, node)
		seq_printf(m, "dmabuf ino %llu offset %#llx length %#llx attachments %d%s\n",
			   (unsigned long long)file_inode(buf->dmabuf->file)->i_ino,
			   buf->offset,
			   buf->length, atomic_read(&buf->attachments),
			   READ_ONCE(buf->revoked) ? " revoked" : "");
	seq_printf(m, "nv page_tables %u dma_mappings %u callbacks %u unacked %u late %u misuse %u\n",
		   fg.ntables, fg.ndma_maps, fg.ncallbacks, fg.nunacked,
		   fg.nlate, fg.nmisuse);
	/* FREE holds the API lock and has not run these callbacks yet. */
	seq_printf(m, "nv waiting_callbacks %u\n", READ_ONCE(fg.nrevoking));
#ifdef P2PHUB_FAKEGPU_NV_P2P
	{
		struct fakegpu_pt *fpt;

		list_for_each_entry(fpt, &fg.tables, node)
			seq_printf(m, "nv table va %#llx length %#llx%s\n",
				   fpt->va, fpt->length,
				   fpt->persistent ? " persistent" : "");
	}
#endif
	mutex_unlock(&fakegpu_lock);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(fakegpu_state);

/* ------------------------------------------------------------------ PCI driver */

static int fakegpu_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	int ret;

	mutex_lock(&fakegpu_lock);
	if (fg.pdev) {
		mutex_unlock(&fakegpu_lock);
		dev_info(&pdev->dev, "another stand-in GPU is bound already (%s)\n",
			 pci_name(fg.pdev));
		return -EBUSY;
	}
	mutex_unlock(&fakegpu_lock);

	if (!(pci_resource_flags(pdev, FAKEGPU_BAR) & IORESOURCE_MEM) ||
	    pci_resource_len(pdev, FAKEGPU_BAR) < P2PHUB_FAKEGPU_GPU_PAGE_SIZE) {
		dev_err(&pdev->dev, "BAR%d is not a memory BAR of 64 KiB or more\n",
			FAKEGPU_BAR);
		return -ENODEV;
	}
	ret = pci_enable_device_mem(pdev);
	if (ret)
		return ret;
	/* As a GPU driver does (amdgpu: UINT_MAX): exporters' long segments are in its claim. */
	dma_set_max_seg_size(&pdev->dev, UINT_MAX);
	ret = pci_request_region(pdev, FAKEGPU_BAR, KBUILD_MODNAME);
	if (ret)
		goto err_disable;

	mutex_lock(&fakegpu_lock);
	fg.pdev = pdev;
	fg.bar_addr = pci_resource_start(pdev, FAKEGPU_BAR);
	fg.bar_size = pci_resource_len(pdev, FAKEGPU_BAR);
	mutex_unlock(&fakegpu_lock);

	fg.misc.minor = MISC_DYNAMIC_MINOR;
	fg.misc.name = P2PHUB_FAKEGPU_DEVICE_NAME;
	fg.misc.fops = &fakegpu_fops;
	fg.misc.mode = 0660;
	fg.misc.parent = &pdev->dev;
	ret = misc_register(&fg.misc);
	if (ret)
		goto err_unpublish;

	fg.debugfs = debugfs_create_dir(KBUILD_MODNAME, NULL);
	debugfs_create_file("state", 0444, fg.debugfs, NULL, &fakegpu_state_fops);
	debugfs_create_u32("callback_delay_ms", 0644, fg.debugfs,
			   &fg.callback_delay_ms);

	dev_info(&pdev->dev, "stand-in GPU: BAR%d %pR, fake GPU VA %#llx%s\n",
		 FAKEGPU_BAR, &pdev->resource[FAKEGPU_BAR], P2PHUB_FAKEGPU_VA_BASE,
		 IS_ENABLED(P2PHUB_FAKEGPU_NV_P2P) ? ", NVIDIA P2P API" : "");
	return 0;

err_unpublish:
	mutex_lock(&fakegpu_lock);
	fg.pdev = NULL;
	mutex_unlock(&fakegpu_lock);
	pci_release_region(pdev, FAKEGPU_BAR);
err_disable:
	pci_disable_device(pdev);
	return ret;
}

static void fakegpu_remove(struct pci_dev *pdev)
{
	debugfs_remove_recursive(fg.debugfs);
	fg.debugfs = NULL;
	misc_deregister(&fg.misc);

	mutex_lock(&fakegpu_free_lock);
	fakegpu_nv_teardown();
	mutex_unlock(&fakegpu_free_lock);

	mutex_lock(&fakegpu_lock);
	fg.pdev = NULL;
	mutex_unlock(&fakegpu_lock);
	pci_release_region(pdev, FAKEGPU_BAR);
	pci_disable_device(pdev);
}

static const struct pci_device_id fakegpu_ids[] = {
	{ PCI_DEVICE(0x1af4, 0x1110) },	/* QEMU ivshmem-plain */
	{ }
};

static struct pci_driver fakegpu_driver = {
	.name		= KBUILD_MODNAME,
	.id_table	= fakegpu_ids,
	.probe		= fakegpu_probe,
	.remove		= fakegpu_remove,
	.driver		= {
		.suppress_bind_attrs = true,
	},
};

/*
 * The lab's spare function (QEMU pci-testdev) gets a driver that does
 * nothing but claim it, as a NIC or NVMe driver would claim theirs: p2phub
 * maps only for devices some driver drives. Like those drivers it accepts
 * segments of any length (the PCI default of 64 KiB is not a claim a real
 * device of this kind makes).
 */
static int lab_spare_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	dma_set_max_seg_size(&pdev->dev, UINT_MAX);
	return dma_set_mask_and_coherent(&pdev->dev, DMA_BIT_MASK(64));
}

static void lab_spare_remove(struct pci_dev *pdev)
{
}

static const struct pci_device_id lab_spare_ids[] = {
	{ PCI_DEVICE(0x1b36, 0x0005) },	/* QEMU pci-testdev */
	{ }
};

static struct pci_driver lab_spare_driver = {
	.name		= "p2phub_lab_spare",
	.id_table	= lab_spare_ids,
	.probe		= lab_spare_probe,
	.remove		= lab_spare_remove,
};

static int __init fakegpu_init(void)
{
	int ret;

	ret = pci_register_driver(&fakegpu_driver);
	if (ret)
		return ret;
	ret = pci_register_driver(&lab_spare_driver);
	if (ret)
		pci_unregister_driver(&fakegpu_driver);
	return ret;
}
module_init(fakegpu_init);

static void __exit fakegpu_exit(void)
{
	pci_unregister_driver(&lab_spare_driver);
	pci_unregister_driver(&fakegpu_driver);
}
module_exit(fakegpu_exit);

MODULE_DESCRIPTION("p2phub lab stand-in GPU: dma-buf exporter and NVIDIA P2P API over ivshmem BAR2");
MODULE_LICENSE("GPL");
#ifdef P2PHUB_HAVE_MODULE_IMPORT_NS_IDENTIFIER
MODULE_IMPORT_NS(DMA_BUF);
#else
MODULE_IMPORT_NS("DMA_BUF");
#endif
