// SPDX-License-Identifier: GPL-2.0-only
/*
 * p2phub_fakegpu_consumer.ko: a minimal in-kernel consumer of the stand-in
 * GPU, so the lab can check p2phub_fakegpu from the importer's side (the
 * sg tables it hands out, move_notify on revoke, the NVIDIA P2P free
 * callback) without p2phub.ko. Test-only, driven through debugfs:
 *
 *   echo "dmabuf FD BDF" > cmd   dynamic peer-to-peer attach of dma-buf FD
 *                                (of the writing process) for PCI device
 *                                BDF, then map it
 *   echo "dmabuf FD BDF pin" > cmd   the same, pinning before the map, as
 *                                a pinned importer (e.g. an EFA MR) does
 *   echo "hold" > cmd            on the next move_notify, add a fence to the
 *                                buffer's resv (work still in flight)
 *   echo "signal" > cmd          signal that fence
 *   echo "nv VA LEN BDF" > cmd   nvidia_p2p_get_pages + dma_map_pages for BDF
 *   echo "release" > cmd         drop whatever is held (unmap, detach, put)
 *   cat state                    one "key value" per line
 *
 * One dma-buf and one page table at a time. Command state is under
 * con.lock, what move_notify touches under the buffer's resv, and the
 * NVIDIA page table under con.nv_lock, which is never held across an
 * nvidia_p2p_* call that takes the driver's API lock (the free callback
 * takes it, under that API lock).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/debugfs.h>
#include <linux/dma-buf.h>
#include <linux/dma-fence.h>
#include <linux/dma-resv.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/seq_file.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

#include "nv-p2p.h"

/* The dma-buf API's spelling on this kernel (conftest.sh). */
#include "conftest.h"

struct consumer {
	struct mutex lock;
	struct dentry *dir;
	/* dma-buf side */
	struct pci_dev *buf_dev;
	struct dma_buf *dmabuf;
	struct dma_buf_attachment *attach;
	struct sg_table *sgt;		/* under dmabuf->resv */
	unsigned int sg_nents;
	u64 sg_first, sg_total;
	bool sg_contiguous;
	unsigned int move_notifies;	/* under dmabuf->resv */
	int last_map_err;
	int last_pin_err;
	bool pinned;
	bool hold;			/* fence on the next move_notify */
	struct dma_fence *fence;	/* added there, not yet signalled */
	spinlock_t fence_lock;
	/* NVIDIA P2P side */
	struct mutex nv_lock;		/* pt, map */
	struct pci_dev *nv_dev;
	struct nvidia_p2p_page_table *pt;
	struct nvidia_p2p_dma_mapping *map;
	u64 nv_va;
	u32 nv_entries;
	u64 nv_first_phys, nv_first_dma;
	unsigned int free_callbacks;
};

static struct consumer con = {
	.lock = __MUTEX_INITIALIZER(con.lock),
	.nv_lock = __MUTEX_INITIALIZER(con.nv_lock),
	.fence_lock = __SPIN_LOCK_UNLOCKED(con.fence_lock),
};

static const char *consumer_fence_name(struct dma_fence *f)
{
	return KBUILD_MODNAME;
}

static const struct dma_fence_ops consumer_fence_ops = {
	.get_driver_name = consumer_fence_name,
	.get_timeline_name = consumer_fence_name,
};

static void consumer_signal(void)
{
	struct dma_fence *f = xchg(&con.fence, NULL);

	if (f) {
		dma_fence_signal(f);
		dma_fence_put(f);
	}
}

static void consumer_unmap_locked(void)
{
	dma_resv_assert_held(con.dmabuf->resv);
	if (con.sgt) {
		dma_buf_unmap_attachment(con.attach, con.sgt, DMA_BIDIRECTIONAL);
		con.sgt = NULL;
	}
}

/*
 * The exporter revokes: stop using the addresses, drop the mapping; when
 * told to, leave a fence for work still in flight.
 */
static void consumer_move_notify(struct dma_buf_attachment *attach)
{
	struct dma_fence *f;

	con.move_notifies++;
	if (con.hold && !con.fence &&
	    !dma_resv_reserve_fences(attach->dmabuf->resv, 1)) {
		f = kzalloc(sizeof(*f), GFP_KERNEL);
		if (f) {
			dma_fence_init(f, &consumer_fence_ops, &con.fence_lock,
				       dma_fence_context_alloc(1), 1);
			dma_resv_add_fence(attach->dmabuf->resv, f,
					   DMA_RESV_USAGE_BOOKKEEP);
			con.fence = f;	/* our reference */
			con.hold = false;
		}
	}
	consumer_unmap_locked();
}

static const struct dma_buf_attach_ops consumer_importer_ops = {
	.allow_peer2peer = true,
#ifdef P2PHUB_HAVE_DMA_BUF_ATTACH_OPS_INVALIDATE_MAPPINGS
	.invalidate_mappings = consumer_move_notify,
#else
	.move_notify = consumer_move_notify,
#endif
};

static struct pci_dev *consumer_pci_get(const char *bdf)
{
	unsigned int dom, bus, dev, fn;

	if (sscanf(bdf, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) != 4)
		return NULL;
	return pci_get_domain_bus_and_slot(dom, bus, PCI_DEVFN(dev, fn));
}

static void consumer_dmabuf_release(void)
{
	if (!con.dmabuf)
		return;
	dma_resv_lock(con.dmabuf->resv, NULL);
	consumer_unmap_locked();
	if (con.pinned)
		dma_buf_unpin(con.attach);
	con.pinned = false;
	dma_resv_unlock(con.dmabuf->resv);
	dma_buf_detach(con.dmabuf, con.attach);
	dma_buf_put(con.dmabuf);
	pci_dev_put(con.buf_dev);
	con.dmabuf = NULL;
	con.attach = NULL;
	con.buf_dev = NULL;
}

static int consumer_dmabuf(int fd, const char *bdf, bool pin)
{
	struct scatterlist *sg;
	struct sg_table *sgt;
	unsigned int i;
	u64 next;
	int ret;

	if (con.dmabuf)
		return -EBUSY;
	con.buf_dev = consumer_pci_get(bdf);
	if (!con.buf_dev)
		return -ENODEV;
	con.dmabuf = dma_buf_get(fd);
	if (IS_ERR(con.dmabuf)) {
		ret = PTR_ERR(con.dmabuf);
		goto err_put_dev;
	}
	con.attach = dma_buf_dynamic_attach(con.dmabuf, &con.buf_dev->dev,
					    &consumer_importer_ops, NULL);
	if (IS_ERR(con.attach)) {
		ret = PTR_ERR(con.attach);
		goto err_put_buf;
	}
	con.move_notifies = 0;
	dma_resv_lock(con.dmabuf->resv, NULL);
	con.last_pin_err = 0;
	if (pin) {
		con.last_pin_err = dma_buf_pin(con.attach);
		if (con.last_pin_err) {
			dma_resv_unlock(con.dmabuf->resv);
			return 0;	/* attached, not pinned: state says why */
		}
		con.pinned = true;
	}
	sgt = dma_buf_map_attachment(con.attach, DMA_BIDIRECTIONAL);
	if (IS_ERR(sgt)) {
		con.last_map_err = PTR_ERR(sgt);
		dma_resv_unlock(con.dmabuf->resv);
		return 0;	/* attached, not mapped: state says why */
	}
	con.last_map_err = 0;
	con.sgt = sgt;
	con.sg_nents = sgt->nents;
	con.sg_first = sg_dma_address(sgt->sgl);
	con.sg_total = 0;
	con.sg_contiguous = true;
	next = con.sg_first;
	for_each_sgtable_dma_sg(sgt, sg, i) {
		if (sg_dma_address(sg) != next || sg_page(sg))
			con.sg_contiguous = false;
		next = sg_dma_address(sg) + sg_dma_len(sg);
		con.sg_total += sg_dma_len(sg);
	}
	dma_resv_unlock(con.dmabuf->resv);
	return 0;

err_put_buf:
	dma_buf_put(con.dmabuf);
	con.dmabuf = NULL;
err_put_dev:
	pci_dev_put(con.buf_dev);
	con.buf_dev = NULL;
	return ret;
}

/* The GPU memory is going away: as nvidia-peermem does, ack and forget. */
static void consumer_nv_free_callback(void *data)
{
	mutex_lock(&con.nv_lock);
	con.free_callbacks++;
	if (con.pt) {
		if (con.map)
			nvidia_p2p_free_dma_mapping(con.map);
		nvidia_p2p_free_page_table(con.pt);
		con.map = NULL;
		con.pt = NULL;
	}
	mutex_unlock(&con.nv_lock);
}

/* con.lock held. */
static void consumer_nv_release(void)
{
	struct nvidia_p2p_page_table *pt;

	mutex_lock(&con.nv_lock);
	pt = con.pt;
	/* Unmap under nv_lock: a callback cannot let the table go meanwhile. */
	if (pt && con.map)
		nvidia_p2p_dma_unmap_pages(con.nv_dev, pt, con.map);
	con.map = NULL;
	con.pt = NULL;
	mutex_unlock(&con.nv_lock);
	if (pt)		/* 0 also when a callback ran meanwhile */
		nvidia_p2p_put_pages(0, 0, con.nv_va, pt);
}

/* con.lock held. */
static int consumer_nv(u64 va, u64 len, const char *bdf)
{
	struct nvidia_p2p_dma_mapping *map = NULL;
	struct nvidia_p2p_page_table *pt;
	int ret;

	if (con.pt)
		return -EBUSY;
	pci_dev_put(con.nv_dev);
	con.nv_dev = consumer_pci_get(bdf);
	if (!con.nv_dev)
		return -ENODEV;
	ret = nvidia_p2p_get_pages(0, 0, va, len, &pt,
				   consumer_nv_free_callback, &con);
	if (ret)
		return ret;
	mutex_lock(&con.nv_lock);
	if (!NVIDIA_P2P_PAGE_TABLE_VERSION_COMPATIBLE(pt) ||
	    pt->page_size != NVIDIA_P2P_PAGE_SIZE_64KB) {
		mutex_unlock(&con.nv_lock);
		ret = -EPROTO;
		goto err_put_pages;
	}
	con.pt = pt;
	con.nv_va = va;
	con.nv_entries = pt->entries;
	con.nv_first_phys = pt->pages[0]->physical_address;
	mutex_unlock(&con.nv_lock);

	/* Not under nv_lock: dma_map_pages takes the driver's API lock. */
	ret = nvidia_p2p_dma_map_pages(con.nv_dev, pt, &map);
	mutex_lock(&con.nv_lock);
	if (con.pt != pt) {	/* freed meanwhile: the driver drops the map */
		mutex_unlock(&con.nv_lock);
		return -ESTALE;
	}
	if (!ret && !NVIDIA_P2P_DMA_MAPPING_VERSION_COMPATIBLE(map)) {
		nvidia_p2p_dma_unmap_pages(con.nv_dev, pt, map);
		ret = -EPROTO;
	}
	if (ret) {
		con.pt = NULL;
		mutex_unlock(&con.nv_lock);
		goto err_put_pages;
	}
	con.map = map;
	con.nv_first_dma = map->dma_addresses[0];
	mutex_unlock(&con.nv_lock);
	return 0;

err_put_pages:
	nvidia_p2p_put_pages(0, 0, va, pt);
	return ret;
}

static ssize_t consumer_cmd_write(struct file *file, const char __user *ubuf,
				  size_t count, loff_t *ppos)
{
	char buf[96], bdf[32];
	unsigned long long va, len;
	int fd, ret;

	if (count >= sizeof(buf))
		return -EINVAL;
	if (copy_from_user(buf, ubuf, count))
		return -EFAULT;
	buf[count] = '\0';

	mutex_lock(&con.lock);
	if (sscanf(buf, "dmabuf %d %31s pin", &fd, bdf) == 2 &&
	    strstr(buf, " pin")) {
		ret = consumer_dmabuf(fd, bdf, true);
	} else if (sscanf(buf, "dmabuf %d %31s", &fd, bdf) == 2) {
		ret = consumer_dmabuf(fd, bdf, false);
	} else if (!strncmp(buf, "hold", 4)) {
		con.hold = true;
		ret = 0;
	} else if (!strncmp(buf, "signal", 6)) {
		consumer_signal();
		ret = 0;
	} else if (sscanf(buf, "nv %llx %llx %31s", &va, &len, bdf) == 3) {
		ret = consumer_nv(va, len, bdf);
	} else if (!strncmp(buf, "release", 7)) {
		consumer_signal();
		consumer_dmabuf_release();
		consumer_nv_release();
		ret = 0;
	} else {
		ret = -EINVAL;
	}
	mutex_unlock(&con.lock);
	return ret ? ret : count;
}

static const struct file_operations consumer_cmd_fops = {
	.owner	= THIS_MODULE,
	.write	= consumer_cmd_write,
};

static int consumer_state_show(struct seq_file *m, void *unused)
{
	mutex_lock(&con.lock);
	seq_printf(m, "attached %d\n", !!con.dmabuf);
	if (con.dmabuf) {
		dma_resv_lock(con.dmabuf->resv, NULL);
		seq_printf(m, "mapped %d\n", !!con.sgt);
		seq_printf(m, "move_notifies %u\n", con.move_notifies);
		dma_resv_unlock(con.dmabuf->resv);
	}
	seq_printf(m, "map_err %d\npin_err %d\n", con.last_map_err,
		   con.last_pin_err);
	seq_printf(m, "fence_pending %d\n", !!READ_ONCE(con.fence));
	seq_printf(m, "sg_nents %u\nsg_first %#llx\nsg_total %#llx\nsg_contiguous %d\n",
		   con.sg_nents, con.sg_first, con.sg_total, con.sg_contiguous);
	mutex_lock(&con.nv_lock);
	seq_printf(m, "nv_held %d\nnv_entries %u\nnv_first_phys %#llx\nnv_first_dma %#llx\n",
		   !!con.pt, con.nv_entries, con.nv_first_phys, con.nv_first_dma);
	seq_printf(m, "free_callbacks %u\n", con.free_callbacks);
	mutex_unlock(&con.nv_lock);
	mutex_unlock(&con.lock);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(consumer_state);

static int __init consumer_init(void)
{
	con.dir = debugfs_create_dir(KBUILD_MODNAME, NULL);
	debugfs_create_file("cmd", 0200, con.dir, NULL, &consumer_cmd_fops);
	debugfs_create_file("state", 0444, con.dir, NULL, &consumer_state_fops);
	return 0;
}

static void __exit consumer_exit(void)
{
	debugfs_remove_recursive(con.dir);
	mutex_lock(&con.lock);
	consumer_signal();
	consumer_dmabuf_release();
	consumer_nv_release();
	pci_dev_put(con.nv_dev);
	mutex_unlock(&con.lock);
}

module_init(consumer_init);
module_exit(consumer_exit);

MODULE_DESCRIPTION("p2phub lab: in-kernel consumer of the stand-in GPU");
MODULE_LICENSE("GPL");
#ifdef P2PHUB_HAVE_MODULE_IMPORT_NS_IDENTIFIER
MODULE_IMPORT_NS(DMA_BUF);
#else
MODULE_IMPORT_NS("DMA_BUF");
#endif
