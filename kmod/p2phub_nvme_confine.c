// SPDX-License-Identifier: GPL-2.0-only
/*
 * NVMe controller ownership: who may own a controller.
 *
 * P2PHUB_NVME_OPEN hands a controller to user space only when an IOMMU
 * confines its DMA to what p2phub maps for it, as VFIO requires: a paging
 * domain, no device of its IOMMU group on a driver that makes DMA mappings
 * of its own, isolated MSIs, no other owner in the group. A bus notifier
 * takes the controller back when a device of the group gets such a driver.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/anon_inodes.h>
#include <linux/capability.h>
#include <linux/file.h>
#include <linux/iommu.h>
#include <linux/list.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/security.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/version.h>
#include <linux/xarray.h>

#include "compat.h"
#include "p2phub_iommu.h"
#include "p2phub_priv.h"
#include "p2phub_nvme.h"


static bool allow_unsafe_noiommu;
module_param(allow_unsafe_noiommu, bool, 0644);
MODULE_PARM_DESC(allow_unsafe_noiommu,
		 "Let user space own NVMe controllers whose DMA no IOMMU translates (their owner can then DMA to any memory); taints the kernel when used. A translated controller whose IOMMU group holds a DMA API driver, or whose MSIs are not isolated, is refused whatever this says");

/* Every bound controller: IOMMU group siblings of owned ones are watched. */
DEFINE_MUTEX(p2phub_nvme_ctrls_lock);
LIST_HEAD(p2phub_nvme_ctrls);

/*
 * Drivers that may hold a device of an owned controller's IOMMU group: PCI
 * drivers that make no DMA API mappings of their own (driver_managed_dma:
 * vfio-pci and its variants, pci-stub, pcieport, p2phub-nvme itself). The
 * kernel lets them probe while p2phub holds the group's DMA ownership; a
 * VFIO user of one still cannot claim the group, and a p2phub-nvme sibling
 * cannot be owned meanwhile (p2phub_nvme_group_owned()).
 */
static bool p2phub_nvme_driver_allowed(struct device_driver *drv)
{
	if (!drv)
		return true;
	return drv->bus == &pci_bus_type && to_pci_driver(drv)->driver_managed_dma;
}

/*
 * Make the kernel itself keep every other DMA user out of the controller's
 * IOMMU group while it is owned, as VFIO does: take the group's DMA
 * ownership (p2phub-nvme is driver_managed_dma, so it may). The kernel then
 * refuses the probe of any DMA API driver in the group (PCI or not) and
 * VFIO's and iommufd's claims. Taking it puts the group in the blocking
 * domain; the DMA API domain the controller's buffers and page lists are
 * mapped in is attached again at once, for the owner. Caller holds the
 * device lock (before OPEN's reset and bus mastering) and ctrl->lock.
 */
static int p2phub_nvme_group_claim(struct p2phub_nvme_ctrl *ctrl)
{
	struct device *dev = &ctrl->pdev->dev;
	struct iommu_domain *domain = iommu_get_domain_for_dev(dev);
	int ret;

	device_lock_assert(dev);
	lockdep_assert_held(&ctrl->lock);
	ret = p2phub_iommu_claim_dma(dev, ctrl->group, ctrl);
	if (ret) {
		pci_info_ratelimited(ctrl->pdev, "not handed to user space: the DMA ownership of its IOMMU group is taken (%d): a kernel driver, VFIO or iommufd uses the group\n",
				     ret);
		return -EXDEV;
	}
	ret = iommu_attach_group(domain, ctrl->group);
	if (ret) {
		p2phub_iommu_release_dma(dev, ctrl->group);
		pci_warn(ctrl->pdev, "not handed to user space: the kernel refused to attach its DMA API domain again under p2phub's DMA ownership of the group (%d)\n",
			 ret);
		return -EXDEV;
	}
	ctrl->dma_domain = domain;
	return 0;
}

/*
 * Give the group's DMA ownership back, once the controller is stopped and
 * nothing of its owner is mapped: the group returns to its DMA API domain
 * and other drivers may probe in it again. Caller holds ctrl->lock.
 */
void p2phub_nvme_group_unclaim(struct p2phub_nvme_ctrl *ctrl)
{
	struct device *dev = &ctrl->pdev->dev;

	lockdep_assert_held(&ctrl->lock);
	if (!ctrl->dma_domain)
		return;
	iommu_detach_group(ctrl->dma_domain, ctrl->group);
	p2phub_iommu_release_dma(dev, ctrl->group);
	ctrl->dma_domain = NULL;
}

static int p2phub_nvme_group_dev_ok(struct device *dev, void *owned)
{
	if (dev == owned)
		return 0;
	return p2phub_nvme_driver_allowed(READ_ONCE(dev->driver)) ? 0 : -EBUSY;
}

/*
 * Whether another controller of @ctrl's IOMMU group is owned: two owners in
 * one domain could reach each other's mappings. Caller holds
 * p2phub_nvme_ctrls_lock.
 */
static bool p2phub_nvme_group_owned(struct p2phub_nvme_ctrl *ctrl)
{
	struct p2phub_nvme_ctrl *other;

	lockdep_assert_held(&p2phub_nvme_ctrls_lock);
	if (!ctrl->group)
		return false;
	list_for_each_entry(other, &p2phub_nvme_ctrls, node)
		if (other != ctrl && other->group == ctrl->group &&
		    READ_ONCE(other->owner))
			return true;
	return false;
}

/*
 * Why the IOMMU does not confine @pdev's DMA to what p2phub mapped for it,
 * as VFIO requires: NULL when it does. *@noiommu is set when the reason is
 * that nothing translates the device's DMA at all, the one case
 * allow_unsafe_noiommu may override (as VFIO's no-IOMMU mode does): a
 * translated device whose group holds a DMA API driver, or whose MSIs are
 * not isolated, is refused whatever the parameter says, since p2phub could
 * claim nothing for it. Caller holds p2phub_nvme_ctrls_lock, which the bus
 * notifier takes after a driver is set on a device and before it probes: a
 * sibling bound after this check sees the owner and takes the controller
 * back.
 */
static const char *p2phub_nvme_unconfined(struct pci_dev *pdev, bool *noiommu)
{
	struct iommu_group *group;
	const char *why = NULL;

	lockdep_assert_held(&p2phub_nvme_ctrls_lock);
	*noiommu = false;
	if (!p2phub_dev_translated(&pdev->dev)) {
		*noiommu = true;
		return device_iommu_mapped(&pdev->dev) ?
		       "its IOMMU domain is identity (passthrough)" :
		       "no IOMMU translates its DMA";
	}
	group = iommu_group_get(&pdev->dev);
	if (!group)
		return "it has no IOMMU group";
	if (iommu_group_for_each_dev(group, &pdev->dev, p2phub_nvme_group_dev_ok))
		why = "its IOMMU group holds a device bound to another driver";
	else if (!p2phub_isolated_msi(group, &pdev->dev))
		why = "its MSIs are not isolated (no interrupt remapping)";
	iommu_group_put(group);
	return why;
}

/*
 * A controller fd whose inode is its own, so that unmap_mapping_range() on
 * its mapping reaches only this owner's VMAs (anon_inode_getfd() shares one
 * inode among all anonymous files).
 */
static int p2phub_nvme_getfd(struct p2phub_nvme_handle *h)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 8, 0)
	struct file *file;
	int fd;

	fd = get_unused_fd_flags(O_CLOEXEC);
	if (fd < 0)
		return fd;
	file = anon_inode_create_getfile("[p2phub-nvme]", &p2phub_nvme_handle_fops,
					 h, O_RDWR | O_CLOEXEC, NULL);
	if (IS_ERR(file)) {
		put_unused_fd(fd);
		return PTR_ERR(file);
	}
	fd_install(fd, file);
	return fd;
#else
	/* Renamed anon_inode_create_getfd() in v6.8, and no longer exported. */
	return anon_inode_getfd_secure("[p2phub-nvme]", &p2phub_nvme_handle_fops,
				       h, O_RDWR | O_CLOEXEC, NULL);
#endif
}

/* P2PHUB_NVME_OPEN on /dev/p2phub: become the owner of a bound controller. */
long p2phub_nvme_ioctl_open(struct file *pfile, void __user *uarg)
{
	struct p2phub_nvme_open arg;
	struct p2phub_nvme_handle *h;
	struct p2phub_nvme_ctrl *ctrl;
	struct pci_dev *pdev;
	const char *why;
	bool noiommu;
	int ret, fd;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (arg.__reserved0 || arg.__reserved1 || arg.out_nr_irqs ||
	    arg.out_bar0_size || arg.out_bar0_mmap_size ||
	    !p2phub_all_zero(arg.reserved, sizeof(arg.reserved)))
		return -EINVAL;
	/* Raw DMA by a device the caller programs: the privilege of /dev/mem. */
	if (!capable(CAP_SYS_RAWIO))
		return -EPERM;
	/* Lockdown keeps root out of PCI BARs; so must p2phub. */
	ret = security_locked_down(LOCKDOWN_PCI_ACCESS);
	if (ret)
		return ret;

	pdev = pci_get_domain_bus_and_slot(arg.domain, arg.bus, arg.devfn);
	if (!pdev)
		return -ENODEV;

	h = kzalloc(sizeof(*h), GFP_KERNEL_ACCOUNT);
	if (!h) {
		ret = -ENOMEM;
		goto err_put_pdev;
	}
	h->pdev = pdev;
	mutex_init(&h->lock);
	mutex_init(&h->mmio_lock);
	init_waitqueue_head(&h->mmio_wq);
	spin_lock_init(&h->status_lock);
	xa_init_flags(&h->bufs, XA_FLAGS_ALLOC);
	xa_init(&h->regmaps);
	h->gone = -ENODEV;
	h->status = (void *)get_zeroed_page(GFP_KERNEL_ACCOUNT);
	if (!h->status) {
		ret = -ENOMEM;
		goto err_free_handle;
	}
	h->status->abi = P2PHUB_NVME_STATUS_ABI;

	/*
	 * The device lock keeps the driver binding stable while we look; an
	 * unbind in progress holds it, and then the answer is "busy", not a
	 * wait behind it.
	 */
	if (!device_trylock(&pdev->dev)) {
		ret = -EBUSY;
		goto err_free_handle;
	}
	if (pdev->dev.driver != &p2phub_nvme_driver.driver) {
		device_unlock(&pdev->dev);
		ret = -ENXIO;	/* not bound to p2phub-nvme */
		goto err_free_handle;
	}
	ctrl = pci_get_drvdata(pdev);
	/*
	 * A PCI error recovery that never reached resume() (a device of the
	 * hierarchy could not recover) must not hold every later owner's
	 * RESUME for good. One still under way keeps the channel offline.
	 */
	if (ctrl->in_recovery) {
		if (pci_channel_offline(pdev)) {
			device_unlock(&pdev->dev);
			ret = -EIO;
			goto err_free_handle;
		}
		ctrl->in_recovery = false;
	}
	mutex_lock(&p2phub_nvme_ctrls_lock);
	why = p2phub_nvme_unconfined(pdev, &noiommu);
	if (why && !(noiommu && allow_unsafe_noiommu)) {
		pci_info_ratelimited(pdev, "not handed to user space: %s%s\n",
				     why, noiommu ?
				     " (allow_unsafe_noiommu=1 overrides, tainting the kernel)" :
				     "; no module parameter overrides this");
		ret = -EXDEV;
		goto err_unlock_list;
	}
	mutex_lock(&ctrl->lock);
	if (ctrl->owner || ctrl->dying || p2phub_nvme_group_owned(ctrl)) {
		ret = -EBUSY;
		goto err_unlock_ctrl;
	}
	/* Confined (a translated domain, so a group): claim the group. */
	if (!why) {
		ret = p2phub_nvme_group_claim(ctrl);
		if (ret)
			goto err_unlock_ctrl;
	}
	ctrl->owner = h;
	ctrl->reset_due = true;
	kref_get(&ctrl->ref);
	reinit_completion(&ctrl->released);
	h->ctrl = ctrl;
	h->bar0_pfn = pci_resource_start(pdev, 0) >> PAGE_SHIFT;
	h->bar0_mmap_len = ctrl->bar0_mmap_len;
	mutex_unlock(&ctrl->lock);
	mutex_unlock(&p2phub_nvme_ctrls_lock);
	/*
	 * A clean controller for the new owner, as VFIO resets at open too:
	 * whatever happened since the last release (a reset that could not
	 * be done then) does not carry over. Under the device lock, which
	 * the reset paths (and so reset_prepare) take: bus mastering goes
	 * on only after that, under the same lock, after an IOTLB flush (a
	 * lazily flushing domain may still translate what the previous
	 * driver or owner unmapped), and only if the controller was not
	 * taken back meanwhile (a sibling bound to a driver).
	 */
	p2phub_nvme_reset_locked(ctrl);
	/* maps made for the group outside MAP_REG (DMA_PAGES, F_DEVICE) */
	p2phub_reg_unmap_group(pdev);
	p2phub_flush_iotlb(&pdev->dev);
	mutex_lock(&ctrl->lock);
	if (ctrl->owner == h)
		pci_set_master(pdev);
	mutex_unlock(&ctrl->lock);
	device_unlock(&pdev->dev);

	if (why) {
		pci_warn(pdev, "owned by user space without IOMMU confinement (%s): its owner can DMA to any memory\n",
			 why);
		add_taint(TAINT_USER, LOCKDEP_STILL_OK);
	}
	atomic_inc(&p2phub_nvme_live_handles);

	arg.argsz = sizeof(arg);
	arg.out_nr_irqs = ctrl->nr_irqs;
	arg.out_bar0_size = ctrl->bar0_len;
	arg.out_bar0_mmap_size = ctrl->bar0_mmap_len;
	if (copy_to_user(uarg, &arg, sizeof(arg))) {
		ret = -EFAULT;
		goto err_disown;
	}

	/* Last: an installed fd cannot be taken back. It owns pdev's reference. */
	h->pfile = get_file(pfile);
	fd = p2phub_nvme_getfd(h);
	if (fd < 0) {
		fput(h->pfile);
		ret = fd;
		goto err_disown;
	}
	/* The fd number reaches the caller as the return value. */
	return fd;

err_disown:
	atomic_dec(&p2phub_nvme_live_handles);
	mutex_lock(&ctrl->lock);
	if (ctrl->owner == h) {
		pci_clear_master(pdev);
		p2phub_nvme_group_unclaim(ctrl);
		ctrl->owner = NULL;
		complete_all(&ctrl->released);
	}
	mutex_unlock(&ctrl->lock);
	p2phub_nvme_ctrl_put(ctrl);
	goto err_free_handle;

err_unlock_ctrl:
	mutex_unlock(&ctrl->lock);
err_unlock_list:
	mutex_unlock(&p2phub_nvme_ctrls_lock);
	device_unlock(&pdev->dev);
err_free_handle:
	p2phub_nvme_handle_free(h);
err_put_pdev:
	pci_dev_put(pdev);
	return ret;
}

/*
 * A driver is about to probe @dev (BUS_NOTIFY_BIND_DRIVER: dev->driver is
 * set, probe has not run). If @dev shares the IOMMU group of an owned
 * controller, that driver's DMA mappings would go into the domain the
 * controller's owner programs DMA in: take the controller back first.
 * A second line only: while the controller is owned, p2phub holds the
 * group's DMA ownership and the kernel refuses such a driver before this
 * (its dma_configure fails with -EBUSY); this still covers a controller
 * owned without that claim (allow_unsafe_noiommu).
 */
static int p2phub_nvme_bus_notify(struct notifier_block *nb,
				  unsigned long action, void *data)
{
	struct device *dev = data;
	struct p2phub_nvme_ctrl *ctrl;
	struct iommu_group *group;

	if (action != BUS_NOTIFY_BIND_DRIVER ||
	    p2phub_nvme_driver_allowed(dev->driver))
		return NOTIFY_DONE;
	group = iommu_group_get(dev);
	if (!group)
		return NOTIFY_DONE;
	mutex_lock(&p2phub_nvme_ctrls_lock);
	list_for_each_entry(ctrl, &p2phub_nvme_ctrls, node) {
		if (ctrl->group != group || &ctrl->pdev->dev == dev)
			continue;
		mutex_lock(&ctrl->lock);
		if (ctrl->owner) {
			pci_warn(ctrl->pdev, "%s in this controller's IOMMU group is being bound to %s: taking the controller back from its owner\n",
				 dev_name(dev), dev->driver->name);
			p2phub_nvme_take_back(ctrl, -EXDEV);
		}
		mutex_unlock(&ctrl->lock);
	}
	mutex_unlock(&p2phub_nvme_ctrls_lock);
	iommu_group_put(group);
	return NOTIFY_OK;
}

static struct notifier_block p2phub_nvme_bus_nb = {
	.notifier_call = p2phub_nvme_bus_notify,
};

int p2phub_nvme_confine_init(void)
{
	return bus_register_notifier(&pci_bus_type, &p2phub_nvme_bus_nb);
}

void p2phub_nvme_confine_exit(void)
{
	bus_unregister_notifier(&pci_bus_type, &p2phub_nvme_bus_nb);
}

/*
 * The kernel takes the controller back from its live owner (@err: -ENODEV
 * the device is going away, -EXDEV its IOMMU group lost its confinement).
 * The fd stays open: its status page says REVOKED, its other mappings are
 * gone, its ioctls return @err. Caller holds ctrl->lock and ctrl->owner.
 */
void p2phub_nvme_take_back(struct p2phub_nvme_ctrl *ctrl, int err)
{
	struct p2phub_nvme_handle *h = ctrl->owner;

	lockdep_assert_held(&ctrl->lock);
	/* DMA stops here (a non-posted config write), then the owner hears it. */
	p2phub_nvme_signal(h, P2PHUB_NVME_ST_REVOKED | P2PHUB_NVME_ST_REMOVING,
			   true);
	mutex_lock(&h->lock);
	if (!h->detached) {
		h->gone = err;
		p2phub_nvme_drop_all(h);
	}
	mutex_unlock(&h->lock);
	/* Stopped, nothing of the owner's mapped: the group may go back. */
	p2phub_nvme_group_unclaim(ctrl);
	ctrl->owner = NULL;
	complete_all(&ctrl->released);
	atomic_inc(&p2phub_nvme_taken_back);
}

