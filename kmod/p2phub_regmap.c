// SPDX-License-Identifier: GPL-2.0-only
/*
 * A registration's per-device DMA maps: made on first ask, held by their
 * users, undone when their device loses its driver or leaves (the PCI bus
 * notifier), or when their last user asks for it.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/iommu.h>
#include <linux/pci.h>
#include <linux/slab.h>

#include "p2phub_reg.h"
#include "p2phub_regmap.h"

/*
 * Every registration, so that a device's removal can find its maps.
 * Lock order: p2phub_all_regs_lock -> p2phub_reg.lock -> the source's
 * dma_resv (see p2phub_reg_pci_notify()).
 */
static DEFINE_MUTEX(p2phub_all_regs_lock);
static LIST_HEAD(p2phub_all_regs);

void p2phub_regmap_track(struct p2phub_reg *reg)
{
	mutex_lock(&p2phub_all_regs_lock);
	list_add_tail(&reg->all_node, &p2phub_all_regs);
	mutex_unlock(&p2phub_all_regs_lock);
}

void p2phub_regmap_untrack(struct p2phub_reg *reg)
{
	mutex_lock(&p2phub_all_regs_lock);
	list_del(&reg->all_node);
	mutex_unlock(&p2phub_all_regs_lock);
}

static void p2phub_reg_map_free(struct p2phub_reg_map *map)
{
	pci_dev_put(map->pdev);
	kvfree(map->addrs);
	kfree(map);
	atomic_dec(&p2phub_stats.dev_maps);
}

/* Unmap, flush, then give the memory back (see p2phub_provider.unmap). */
static void p2phub_regmap_unmap(struct p2phub_reg *reg,
				struct p2phub_reg_map *map)
{
	lockdep_assert_held(&reg->lock);
	reg->provider->unmap(reg, map);
	p2phub_flush_iotlb(&map->pdev->dev);
	if (reg->provider->unpin)
		reg->provider->unpin(reg, map);
}

/* ------------------------------------------------------- device removal */

/*
 * PCI devices between BUS_NOTIFY_DEL_DEVICE and BUS_NOTIFY_REMOVED_DEVICE:
 * no new map is made for them. Their IOMMU state goes at REMOVED_DEVICE,
 * so every map of theirs is undone at DEL_DEVICE, while it still exists.
 */
static DEFINE_SPINLOCK(p2phub_removing_lock);
static struct pci_dev *p2phub_removing[8];

static bool p2phub_dev_removing(struct pci_dev *pdev)
{
	bool found = false;
	int i;

	spin_lock(&p2phub_removing_lock);
	for (i = 0; i < ARRAY_SIZE(p2phub_removing); i++)
		found |= p2phub_removing[i] == pdev;
	spin_unlock(&p2phub_removing_lock);
	return found;
}

/* Returns false when the table is full: the caller then scans only. */
static bool p2phub_dev_removing_set(struct pci_dev *pdev, bool on)
{
	bool done = false;
	int i;

	spin_lock(&p2phub_removing_lock);
	for (i = 0; i < ARRAY_SIZE(p2phub_removing) && !done; i++) {
		if (on && !p2phub_removing[i]) {
			p2phub_removing[i] = pdev;
			done = true;
		} else if (!on && p2phub_removing[i] == pdev) {
			p2phub_removing[i] = NULL;
			done = true;
		}
	}
	spin_unlock(&p2phub_removing_lock);
	return done;
}

/*
 * Undo every map for @pdev, or with @group for any device in that IOMMU
 * group; returns how many there were. A map nobody holds is freed; a held
 * one stays on the list, marked removed, until its holder lets go (its
 * registration's teardown frees it).
 */
static unsigned int p2phub_reg_unmap_matching(struct pci_dev *pdev,
					      struct iommu_group *group)
{
	struct p2phub_reg_map *map, *tmp;
	struct p2phub_reg *reg;
	unsigned int n = 0;
	bool held;

	mutex_lock(&p2phub_all_regs_lock);
	list_for_each_entry(reg, &p2phub_all_regs, all_node) {
		mutex_lock(&reg->lock);
		list_for_each_entry_safe(map, tmp, &reg->maps, node) {
			if (map->removed || (map->pdev != pdev &&
			    (!group || map->pdev->dev.iommu_group != group)))
				continue;
			p2phub_regmap_unmap(reg, map);
			reg->nr_maps--;
			n++;
			spin_lock(&reg->state_lock);
			held = map->holds;
			map->removed = true;
			spin_unlock(&reg->state_lock);
			if (!held) {
				list_del(&map->node);
				p2phub_reg_map_free(map);
			}
		}
		mutex_unlock(&reg->lock);
	}
	mutex_unlock(&p2phub_all_regs_lock);
	return n;
}

static unsigned int p2phub_reg_unmap_device(struct pci_dev *pdev)
{
	return p2phub_reg_unmap_matching(pdev, NULL);
}

unsigned int p2phub_reg_unmap_group(struct pci_dev *pdev)
{
	struct iommu_group *group = iommu_group_get(&pdev->dev);
	unsigned int n;

	n = p2phub_reg_unmap_matching(pdev, group);
	iommu_group_put(group);
	if (n)
		pci_info(pdev, "p2phub: unmapped %u registration map(s) made for it or its IOMMU group before it changes hands\n",
			 n);
	return n;
}

static int p2phub_reg_pci_notify(struct notifier_block *nb,
				 unsigned long action, void *data)
{
	struct pci_dev *pdev = to_pci_dev(data);
	unsigned int n;

	switch (action) {
	case BUS_NOTIFY_DRIVER_NOT_BOUND:	/* a probe failed: the same */
	case BUS_NOTIFY_UNBOUND_DRIVER:
		/*
		 * Its driver has stopped it and let it go: nothing drives it
		 * now, so nothing may keep addresses mapped for it (the
		 * DMA-API debug check of this same event counts them as that
		 * driver's leak). A driver bound later gets fresh maps.
		 */
		n = p2phub_reg_unmap_device(pdev);
		if (n)
			pci_info(pdev, "p2phub: driver %s: unmapped %u registration(s) for it\n",
				 action == BUS_NOTIFY_UNBOUND_DRIVER ? "unbound" :
				 "not bound", n);
		break;
	case BUS_NOTIFY_DEL_DEVICE:
		if (!p2phub_dev_removing_set(pdev, true))
			pci_warn(pdev, "p2phub: too many devices leaving at once; a map made during this removal may outlive it\n");
		n = p2phub_reg_unmap_device(pdev);
		if (n)
			pci_info(pdev, "p2phub: device removed: unmapped %u registration(s) for it\n",
				 n);
		break;
	case BUS_NOTIFY_REMOVED_DEVICE:
		p2phub_dev_removing_set(pdev, false);
		break;
	}
	return NOTIFY_DONE;
}

static struct notifier_block p2phub_reg_pci_nb = {
	.notifier_call = p2phub_reg_pci_notify,
	.priority = 1,	/* before DMA-API debug's UNBOUND_DRIVER check (0) */
};

/*
 * The mapping of @reg for @pdev, made on first ask and cached until
 * teardown, with a hold taken. Returns ERR_PTR(-ESTALE) once the
 * registration is not live. Caller holds reg->lock, which the provider's
 * map() may drop and take again; the map may be read until it is dropped
 * (a teardown after that frees it: holds do not keep it).
 */
static struct p2phub_reg_map *__p2phub_reg_map_get(struct p2phub_reg *reg,
						   struct pci_dev *pdev)
{
	struct p2phub_reg_map *map;
	int ret;

	lockdep_assert_held(&reg->lock);
	if (reg->torn_down || READ_ONCE(reg->state) != P2PHUB_REG_LIVE) {
		ret = -ESTALE;
		goto err_out;
	}
	list_for_each_entry(map, &reg->maps, node) {
		/* A removed map's device left or was let go of: see below. */
		if (map->pdev == pdev && !map->removed)
			goto out_hold;
	}
	if (p2phub_dev_removing(pdev)) {
		ret = -ENODEV;
		goto err_out;
	}
	/*
	 * A function no driver drives cannot use the addresses, and its DMA
	 * parameters are only the PCI core's defaults (64 KiB segments),
	 * which exporters do not honour when they build their tables.
	 */
	if (!READ_ONCE(pdev->dev.driver)) {
		dev_info_ratelimited(&pdev->dev,
				     "p2phub: registration %u: refusing a map for a device no driver is bound to\n",
				     reg->handle);
		ret = -ENODEV;
		goto err_out;
	}

	map = kzalloc(sizeof(*map), GFP_KERNEL_ACCOUNT);
	if (!map) {
		ret = -ENOMEM;
		goto err_out;
	}
	atomic_inc(&p2phub_stats.dev_maps);
	map->reg = reg;
	map->pdev = pci_dev_get(pdev);
	map->addrs = kvmalloc_array(reg->npages, sizeof(*map->addrs),
				    GFP_KERNEL_ACCOUNT);
	if (!map->addrs) {
		ret = -ENOMEM;
		goto err_free_map;
	}
	ret = reg->provider->map(reg, map);
	if (ret)
		goto err_free_map;
	/*
	 * A provider may drop reg->lock in map(): the device may be going, or
	 * its driver (whose UNBOUND_DRIVER unmap may have passed this one).
	 */
	if (p2phub_dev_removing(pdev) || !READ_ONCE(pdev->dev.driver)) {
		p2phub_regmap_unmap(reg, map);
		ret = -ENODEV;
		goto err_free_map;
	}
	list_add_tail(&map->node, &reg->maps);
	reg->nr_maps++;
out_hold:
	spin_lock(&reg->state_lock);
	map->holds++;
	spin_unlock(&reg->state_lock);
	return map;

err_free_map:
	p2phub_reg_map_free(map);
err_out:
	return ERR_PTR(ret);
}

struct p2phub_reg_map *p2phub_reg_map_get(struct p2phub_reg *reg,
					  struct pci_dev *pdev)
{
	struct p2phub_reg_map *map;

	mutex_lock(&reg->lock);
	map = __p2phub_reg_map_get(reg, pdev);
	mutex_unlock(&reg->lock);
	return map;
}

/*
 * Drop one hold of @map (and, for an export's importer, its importer count).
 * The last hold unmaps and flushes when @unmap, or for an importer unless the
 * map's addresses were handed out to be kept until teardown (cached).
 */
static void __p2phub_reg_map_put(struct p2phub_reg *reg,
				 struct p2phub_reg_map *map, bool unmap,
				 bool importer)
{
	bool last;

	mutex_lock(&reg->lock);
	if (reg->torn_down) {		/* the map is gone with the pin */
		mutex_unlock(&reg->lock);
		return;
	}
	spin_lock(&reg->state_lock);
	if (importer && !WARN_ON_ONCE(!map->importers))
		map->importers--;
	last = !WARN_ON_ONCE(!map->holds) && !--map->holds;
	spin_unlock(&reg->state_lock);
	if (importer)
		unmap = !map->cached;
	else if (!unmap)
		map->cached = true;	/* addresses out without a hold */
	if (unmap && last && !map->removed) {
		list_del(&map->node);
		reg->nr_maps--;
		p2phub_regmap_unmap(reg, map);
		p2phub_reg_map_free(map);
	}
	mutex_unlock(&reg->lock);
}

void p2phub_reg_map_put(struct p2phub_reg *reg, struct p2phub_reg_map *map,
			bool unmap)
{
	__p2phub_reg_map_put(reg, map, unmap, false);
}

void p2phub_reg_map_put_importer(struct p2phub_reg *reg,
				 struct p2phub_reg_map *map)
{
	__p2phub_reg_map_put(reg, map, false, true);
}

bool p2phub_reg_dev_revoked_mapped(struct pci_dev *pdev)
{
	struct p2phub_reg_map *map;
	struct p2phub_reg *reg;
	bool found = false;

	mutex_lock(&p2phub_all_regs_lock);
	list_for_each_entry(reg, &p2phub_all_regs, all_node) {
		mutex_lock(&reg->lock);
		if (!reg->torn_down && READ_ONCE(reg->revoked)) {
			list_for_each_entry(map, &reg->maps, node)
				found |= map->pdev == pdev && !map->removed &&
					 reg->provider->mapped(map);
		}
		mutex_unlock(&reg->lock);
		if (found)
			break;
	}
	mutex_unlock(&p2phub_all_regs_lock);
	return found;
}

/* Used by providers' release(): frees what p2phub_reg_map_get() made. */
void p2phub_reg_maps_free(struct list_head *maps)
{
	struct p2phub_reg_map *map, *tmp;

	list_for_each_entry_safe(map, tmp, maps, node) {
		list_del(&map->node);
		p2phub_reg_map_free(map);
	}
}

int p2phub_reg_dma_pages(struct p2phub_reg *reg, struct pci_dev *pdev,
			 struct p2phub_dma_list *list)
{
	struct p2phub_reg_map *map;
	u64 gen;

	gen = READ_ONCE(reg->generation);
	/*
	 * Read the map under reg->lock: once it is dropped, a teardown (an
	 * UNREGISTER is not refused for a bare hold) may free the map. The
	 * liveness check below then refuses what was read.
	 */
	mutex_lock(&reg->lock);
	map = __p2phub_reg_map_get(reg, pdev);
	if (IS_ERR(map)) {
		mutex_unlock(&reg->lock);
		return PTR_ERR(map);
	}
	list->addrs = map->addrs;
	list->npages = reg->npages;
	list->page_shift = reg->page_shift;
	list->generation = gen;
	list->map = map;
	mutex_unlock(&reg->lock);
	/* Revoked while mapping: the caller must not see these addresses. */
	if (!p2phub_reg_live(reg, gen)) {
		p2phub_reg_dma_pages_put(reg, list, false);
		return -ESTALE;
	}
	return 0;
}

void p2phub_reg_dma_pages_hold(struct p2phub_reg *reg,
			       const struct p2phub_dma_list *list)
{
	spin_lock(&reg->state_lock);
	list->map->holds++;
	spin_unlock(&reg->state_lock);
}

void p2phub_reg_dma_pages_put(struct p2phub_reg *reg,
			      struct p2phub_dma_list *list, bool unmap)
{
	if (!list->map)
		return;
	p2phub_reg_map_put(reg, list->map, unmap);
	list->map = NULL;
	list->addrs = NULL;
}

/* ------------------------------------------------------------------ module */

int p2phub_regmap_init(void)
{
	return bus_register_notifier(&pci_bus_type, &p2phub_reg_pci_nb);
}

void p2phub_regmap_exit(void)
{
	bus_unregister_notifier(&pci_bus_type, &p2phub_reg_pci_nb);
}
