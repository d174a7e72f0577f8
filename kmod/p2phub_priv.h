/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * p2phub.ko internals.
 *
 * Objects:
 *   struct p2phub_file  one per open of /dev/p2phub: the ledger of everything
 *                       that open holds; release of the file releases it all.
 *
 * Accounting: every object a user can make is allocated GFP_KERNEL_ACCOUNT
 * (its memory cgroup); a registration's bytes are charged to the
 * registering mm's pinned_vm against RLIMIT_MEMLOCK (p2phub_reg.c); the
 * opens per effective uid are capped by max_files_per_user (p2phub_main.c,
 * under p2phub_users_lock, which nests in nothing and takes nothing).
 *
 * Lock order (outer first):
 *   p2phub_file.lock
 */
#ifndef _P2PHUB_PRIV_H
#define _P2PHUB_PRIV_H

#include <linux/mutex.h>
#include <linux/types.h>
#include <linux/uidgid.h>
#include <linux/xarray.h>

#include "p2phub_iommu.h"
#include "p2phub_uargs.h"
#include "uapi/p2phub.h"

#define P2PHUB_VERSION		"0.1.0"
#define P2PHUB_MAX_REGS_PER_FILE	4096

struct p2phub_file {
	kuid_t uid;		/* the opener: charged one open (max_files_per_user)
			 * and the pages registered through it */
	struct mutex lock;	/* protects everything below */
	struct xarray regs;	/* handle -> struct p2phub_reg (one ref each) */
	u64 reg_bytes;		/* sum of the lengths in regs */
};

/* Per-file cap on registered bytes (module parameter max_reg_gib). */
u64 p2phub_max_reg_bytes(void);

/*
 * The UAPI's one rule for outputs: they must come in as 0 (a later ABI may
 * give them an input meaning). True when fields @first..@last of *@p are 0.
 */
#define p2phub_outputs_zero(p, first, last)				\
	p2phub_all_zero(&(p)->first,					\
			offsetofend(typeof(*(p)), last) -		\
			offsetof(typeof(*(p)), first))

/*
 * NVMe controller ownership (p2phub_nvme_*.c, see p2phub_nvme.h). A
 * controller fd owns one struct p2phub_nvme_ctrl. Lock order there (outer first):
 *   device_lock(any pci_dev) -> p2phub_nvme_ctrls_lock -> p2phub_nvme_ctrl.lock
 *     -> p2phub_nvme_handle.lock -> p2phub_nvme_handle.mmio_lock -> i_mmap_rwsem
 *   p2phub_nvme_ctrl.lock -> p2phub_nvme_handle.status_lock
 *   p2phub_nvme_ctrl.lock -> the IOMMU group's mutex (DMA ownership, OPEN
 *     and give-back)
 *   mmap_lock -> p2phub_nvme_handle.lock, p2phub_nvme_handle.mmio_lock (mmap, faults)
 *   p2phub_nvme_handle.lock -> p2phub_file.lock, p2phub_reg.lock (MAP_REG)
 *   p2phub_nvme_handle.lock -> p2phub_nvme_handle.status_lock (DMA_FREE,
 *     which keeps bus mastering off across the free and the IOTLB flush)
 *   p2phub_reg.state_lock -> p2phub_nvme_handle.status_lock (stop_dma)
 *   device_lock(controller) -> p2phub_all_regs_lock (OPEN, the PCI
 *     notifiers: p2phub_reg_unmap_group())
 * device_lock of the controller is taken (not tried) only by RESUME, before
 * p2phub_nvme_handle.lock; release only tries it.
 * The controller fd holds a reference on the /dev/p2phub file it was
 * opened from, so that file's registrations outlive the controller's DMA.
 */
int p2phub_nvme_init(void);
void p2phub_nvme_exit(void);
long p2phub_nvme_ioctl_open(struct file *pfile, void __user *uarg);

/*
 * Registrations (p2phub_reg.c, p2phub_regmap.c, p2phub_reg_ioctl.c,
 * p2phub_dmabuf.c, p2phub_nvp2p.c, p2phub_export.c).
 *
 * A struct p2phub_reg is made by P2PHUB_REGISTER and lives in its file's
 * p2phub_file.regs (one reference). Every exported dma-buf holds another,
 * and so does every in-kernel user between p2phub_reg_get() and
 * p2phub_reg_put(). The pin (provider resources, per-device mappings) is
 * released once, by p2phub_reg_teardown(): at UNREGISTER, at file close when
 * nobody else uses it, or else when the last reference goes.
 *
 * Lock order (outer first), in addition to p2phub_file.lock above:
 *   p2phub_file.lock -> p2phub_reg.lock -> dma_resv of the source dma-buf
 *   p2phub_reg.lock of a registration whose source is one of p2phub's
 *     exports (lockdep class "derived") -> p2phub_reg.lock of the exporting
 *     registration (plain class). Never deeper: REGISTER resolves an export
 *     of a derived registration to what that one imports.
 *   p2phub_reg.state_lock (spinlock) is innermost and may be taken anywhere;
 *     reg->exports is walked under it (a file reference taken on each
 *     export, files already at count zero skipped).
 * The dma_resv of an exported dma-buf is never taken under p2phub_reg.lock:
 * its importers are told (move_notify, then a wait for their fences) with
 * no p2phub lock held, by p2phub_export_revoke_sync()/_notify().
 * mmap of an exported dma-buf (under the mm's mmap_lock, and on 6.2-6.4 the
 * export's dma_resv) and its page faults take p2phub_reg.lock; the first
 * mmap then vmaps the source (its dma_resv): mmap_lock -> p2phub_reg.lock
 * -> source dma_resv. Zapping those mappings (unmap_mapping_range,
 * i_mmap_rwsem) happens under p2phub_reg.lock.
 * Callbacks: the source's move_notify runs under the source's dma_resv: it
 * takes state_lock, calls p2phub_reg_revoke() (spinlocks only), unmaps its
 * attachment when no export importer uses that map, else adds a revocation
 * fence to that resv and queues work. That work takes p2phub_reg.lock, the
 * resv and the resvs of the registration's exports only by trylock before
 * the fence signals (an exporter may wait for the fence holding its resv,
 * which p2phub_reg.lock holders may wait for; so may an importer of an
 * export, holding that export's resv), and allocates nothing.
 * p2phub_reg_map_put() (UNMAP_REG, controller release, export detach)
 * takes p2phub_reg.lock -> the source's dma_resv; RESUME takes
 * p2phub_nvme_handle.lock -> p2phub_all_regs_lock -> p2phub_reg.lock.
 * The exported dma-buf's map/unmap/pin/unpin run under its dma_resv and
 * take nothing of ours; its attach takes p2phub_reg.lock (through
 * p2phub_reg_map_get()); its detach (outside its dma_resv) takes
 * p2phub_reg.lock -> the source's dma_resv (p2phub_reg_map_put_importer(),
 * which unmaps and flushes the map when the importer's hold was the last),
 * then state_lock; its release p2phub_reg.lock then state_lock. A derived
 * registration's unmap detaches under its own p2phub_reg.lock: derived ->
 * plain, as above.
 * NVIDIA: the free callback runs under the driver's API lock and takes
 * p2phub_reg.lock (and, without it, export dma_resvs, waiting for their
 * importers' fences). So p2phub_reg.lock is never held across
 * nvidia_p2p_get_pages(), _dma_map_pages() or _put_pages(), which take the
 * API lock; _dma_unmap_pages() takes only the table's own lock and is called
 * under p2phub_reg.lock. The callback runs in an SRCU read section that
 * release waits for.
 *
 * In-kernel users that make a device DMA into a registration (an owned
 * NVMe controller) hold it through a struct p2phub_reg_user:
 *
 *	reg = p2phub_reg_get(pf, handle);		// -ENOENT
 *	ret = p2phub_reg_dma_pages(reg, pdev, &list);	// maps on first ask
 *	ret = p2phub_reg_user_add(reg, &u, list.generation); // -ESTALE if revoked
 *	... the device DMAs to list.addrs[i] + off ...
 *	p2phub_reg_user_del(reg, &u);	// only once the device has stopped
 *	p2phub_reg_put(reg);
 *
 * While a user is added, UNREGISTER fails with -EBUSY and the pin and the
 * device's mapping stay. A revocation cannot wait for the user: it calls
 * u->stop_dma() synchronously, under p2phub_reg.state_lock (atomic
 * context), before the revocation completes and before any mapping is
 * torn down; stop_dma must leave the device unable to DMA when it returns
 * (bus mastering off). list.addrs stays allocated until the user is
 * deleted. p2phub_reg_put() may sleep (it can release the pin).
 */
struct p2phub_reg_user {
	struct list_head node;		/* on p2phub_reg.users, under state_lock */
	void (*stop_dma)(struct p2phub_reg_user *u);
};

struct p2phub_reg;
struct pci_dev;
struct device;

struct p2phub_dma_list {
	const dma_addr_t *addrs;	/* npages entries, one per page */
	u64 npages;
	u32 page_shift;			/* log2 of bytes per page */
	u64 generation;			/* the addresses belong to this one */
	struct p2phub_reg_map *map;	/* held; p2phub_reg_dma_pages_put() */
};

struct p2phub_reg *p2phub_reg_get(struct p2phub_file *pf, u64 handle);
void p2phub_reg_put(struct p2phub_reg *reg);
int p2phub_reg_dma_pages(struct p2phub_reg *reg, struct pci_dev *pdev,
			 struct p2phub_dma_list *list);
/*
 * Let go of what p2phub_reg_dma_pages() gave. With @unmap, and nobody else
 * using the device's mapping, the device's mapping goes now rather than at
 * teardown.
 */
void p2phub_reg_dma_pages_put(struct p2phub_reg *reg,
			      struct p2phub_dma_list *list, bool unmap);
/* Another hold on what @list holds (the caller keeps one meanwhile). */
void p2phub_reg_dma_pages_hold(struct p2phub_reg *reg,
			       const struct p2phub_dma_list *list);
/*
 * Whether some registration is revoked but still mapped for @pdev (its
 * export importers not yet done): the device must not DMA again until not.
 */
bool p2phub_reg_dev_revoked_mapped(struct pci_dev *pdev);
/*
 * Unmap (and flush) every registration map made for @pdev or for another
 * device of its IOMMU group (DMA_PAGES, REGISTER's F_DEVICE): called when
 * the controller is handed to a new owner, which must reach none of them.
 * Takes p2phub_all_regs_lock -> p2phub_reg.lock; callable under the
 * device lock. Returns how many there were.
 */
unsigned int p2phub_reg_unmap_group(struct pci_dev *pdev);
int p2phub_reg_user_add(struct p2phub_reg *reg, struct p2phub_reg_user *u,
			u64 generation);
void p2phub_reg_user_del(struct p2phub_reg *reg, struct p2phub_reg_user *u);
bool p2phub_reg_live(struct p2phub_reg *reg, u64 generation);
/*
 * Copy entries [first, first + count) of @reg's DMA addresses for @pdev, in
 * units of page_size (0: the registration's), to @uaddrs. The caller keeps
 * the mapping alive (a user added, or an I/O hold).
 */
void p2phub_reg_get_ref(struct p2phub_reg *reg);
/* An I/O hold: the registration's maps stay while it is held (-ESTALE if not live). */
int p2phub_reg_io_begin(struct p2phub_reg *reg, u64 generation);
void p2phub_reg_io_end(struct p2phub_reg *reg);
int p2phub_reg_copy_dma_pages(struct p2phub_reg *reg,
			      const struct p2phub_dma_list *list,
			      u32 page_size, u64 first, u32 count,
			      u64 __user *uaddrs, u64 *total);

/*
 * /dev/p2phub's struct device, given a 64-bit DMA mask at load: the
 * importing device of the CPU attachment through which mmap of an export
 * finds the source's struct pages. NULL when that setup failed.
 */
extern struct device *p2phub_device;

/* Hooks for p2phub_main.c. */
extern struct dentry *p2phub_debugfs_dir;	/* /sys/kernel/debug/p2phub */
int p2phub_reg_init(void);
void p2phub_reg_exit(void);
void p2phub_reg_file_init(struct p2phub_file *pf);
void p2phub_reg_file_release(struct p2phub_file *pf);
long p2phub_reg_ioctl(struct p2phub_file *pf, unsigned int cmd,
		      void __user *uarg);
u64 p2phub_reg_caps(void);

#endif /* _P2PHUB_PRIV_H */
