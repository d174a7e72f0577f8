// SPDX-License-Identifier: GPL-2.0-only
/*
 * NVMe controller ownership: the PCI driver "p2phub-nvme".
 *
 * Probe claims BAR0 and the MSI-X vectors and nothing else; remove() asks
 * the owner to let go and, after remove_grace_ms, takes the controller back.
 * PCI errors and function resets stop the controller's DMA and hold the
 * owner's BAR0 mapping until the device is back. The function is reset
 * whenever the controller changes hands.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/io.h>
#include <linux/io-64-nonatomic-lo-hi.h>
#include <linux/jiffies.h>
#include <linux/kref.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/slab.h>

#include "compat.h"
#include "p2phub_priv.h"
#include "p2phub_nvme.h"


static unsigned int remove_grace_ms = 10000;
module_param(remove_grace_ms, uint, 0644);
MODULE_PARM_DESC(remove_grace_ms,
		 "How long unbind or removal of an owned NVMe controller waits for its owner to close the controller fd before the kernel takes the controller back (ms, default 10000)");


/* debugfs counters, under /sys/kernel/debug/p2phub/nvme. */
static struct dentry *p2phub_nvme_debugfs;
atomic_t p2phub_nvme_live_bufs = ATOMIC_INIT(0);
atomic_t p2phub_nvme_live_handles = ATOMIC_INIT(0);
atomic_t p2phub_nvme_function_resets = ATOMIC_INIT(0);
atomic_t p2phub_nvme_taken_back = ATOMIC_INIT(0);

static void p2phub_nvme_ctrl_free(struct kref *ref)
{
	struct p2phub_nvme_ctrl *ctrl =
		container_of(ref, struct p2phub_nvme_ctrl, ref);

	if (ctrl->group)
		iommu_group_put(ctrl->group);
	kfree(ctrl->irqs);
	mutex_destroy(&ctrl->lock);
	kfree(ctrl);
}

void p2phub_nvme_ctrl_put(struct p2phub_nvme_ctrl *ctrl)
{
	kref_put(&ctrl->ref, p2phub_nvme_ctrl_free);
}

/*
 * Stop the controller from touching memory: clear CC.EN, wait for CSTS.RDY
 * to fall (bounded by CAP.TO), then turn bus mastering off, which stops DMA
 * even from a controller that ignored the disable.
 */
void p2phub_nvme_quiesce(struct p2phub_nvme_ctrl *ctrl)
{
	struct pci_dev *pdev = ctrl->pdev;
	unsigned long deadline;
	u32 cc, csts, timeout_ms;
	u64 cap;

	cap = lo_hi_readq(ctrl->regs + NVME_REG_CAP);
	timeout_ms = min_t(u32, ((cap >> 24) & 0xff) * 500,
			   P2PHUB_NVME_DISABLE_MAX_MS);
	cc = readl(ctrl->regs + NVME_REG_CC);
	if (cc != U32_MAX && (cc & NVME_CC_EN)) {
		writel(cc & ~NVME_CC_EN, ctrl->regs + NVME_REG_CC);
		deadline = jiffies + msecs_to_jiffies(timeout_ms);
		for (;;) {
			csts = readl(ctrl->regs + NVME_REG_CSTS);
			if (csts == U32_MAX || !(csts & NVME_CSTS_RDY))
				break;
			if (time_after(jiffies, deadline)) {
				dev_warn_ratelimited(&pdev->dev,
						     "controller still ready %u ms after CC.EN=0; stopping its DMA by clearing bus master\n",
						     timeout_ms);
				break;
			}
			msleep(1);
		}
	}
	pci_clear_master(pdev);
}

/*
 * Reset the function before the controller changes hands, as VFIO does: what
 * an owner left in it (features, host memory buffer settings, a security
 * state such as an unlocked Opal range) must not reach the next owner or the
 * kernel's nvme driver. Only a trylock of the device: remove() holds the
 * device lock while it waits for this release, and must not wait for us
 * (it resets the function itself once released, see reset_due). Under that
 * lock the controller is still p2phub's and still @h's, or the reset is not
 * ours to do. True when the function was reset.
 */
bool p2phub_nvme_reset_function(struct p2phub_nvme_ctrl *ctrl,
				struct p2phub_nvme_handle *h)
{
	struct pci_dev *pdev = ctrl->pdev;
	bool ours;
	int ret;

	if (!device_trylock(&pdev->dev)) {
		pci_info_ratelimited(pdev, "no function reset at release (device busy): done when the controller is handed back or opened again\n");
		return false;
	}
	mutex_lock(&ctrl->lock);
	ours = pdev->dev.driver == &p2phub_nvme_driver.driver &&
	       pci_get_drvdata(pdev) == ctrl && ctrl->owner == h;
	mutex_unlock(&ctrl->lock);
	ret = ours ? pci_reset_function_locked(pdev) : 0;
	device_unlock(&pdev->dev);
	if (!ours)
		return false;
	if (ret) {
		pci_info_ratelimited(pdev, "no function reset before the next owner (%d): controller state carries over\n",
				     ret);
		return false;
	}
	atomic_inc(&p2phub_nvme_function_resets);
	return true;
}

/*
 * remove() hands the controller back to the PCI core, and so to the next
 * driver: reset what the last owner left, unless its release did. remove()
 * holds the device lock; the reset's reset_prepare and reset_done find no
 * owner.
 */
static void p2phub_nvme_reset_handback(struct p2phub_nvme_ctrl *ctrl)
{
	struct pci_dev *pdev = ctrl->pdev;
	bool due;
	int ret;

	device_lock_assert(&pdev->dev);
	mutex_lock(&ctrl->lock);
	due = ctrl->reset_due;
	ctrl->reset_due = false;
	mutex_unlock(&ctrl->lock);
	/* A device that is gone (surprise removal) answers no reset. */
	if (!due || pci_channel_offline(pdev))
		return;
	ret = pci_reset_function_locked(pdev);
	if (ret) {
		pci_info_ratelimited(pdev, "no function reset before the controller is handed back (%d): controller state carries over\n",
				     ret);
		return;
	}
	atomic_inc(&p2phub_nvme_function_resets);
}

/*
 * The same with the device lock already held (OPEN). No reset_prepare or
 * reset_done runs: the controller has no owner-visible state yet.
 */
void p2phub_nvme_reset_locked(struct p2phub_nvme_ctrl *ctrl)
{
	struct pci_dev *pdev = ctrl->pdev;
	int ret;

	device_lock_assert(&pdev->dev);
	pci_save_state(pdev);
	ret = __pci_reset_function_locked(pdev);
	pci_restore_state(pdev);
	if (ret) {
		pci_info_ratelimited(pdev, "no function reset for the new owner (%d): controller state carries over\n",
				     ret);
		return;
	}
	atomic_inc(&p2phub_nvme_function_resets);
}

/*
 * BAR0 up to the first page that holds the MSI-X table or PBA, rounded
 * down to whole pages: no page of it reaches past the BAR.
 */
static resource_size_t p2phub_nvme_bar0_mmap_len(struct pci_dev *pdev,
						 resource_size_t bar0_len)
{
	resource_size_t len = round_down(bar0_len, PAGE_SIZE);
	static const int regs[] = { PCI_MSIX_TABLE, PCI_MSIX_PBA };
	u32 val;
	int i;

	if (!pdev->msix_cap)
		return len;
	for (i = 0; i < ARRAY_SIZE(regs); i++) {
		pci_read_config_dword(pdev, pdev->msix_cap + regs[i], &val);
		if ((val & PCI_MSIX_TABLE_BIR) == 0)
			len = min_t(resource_size_t, len,
				    round_down(val & PCI_MSIX_TABLE_OFFSET,
					       PAGE_SIZE));
	}
	return len;
}

static int p2phub_nvme_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct p2phub_nvme_ctrl *ctrl;
	int ret, i, want;

	if (pdev->class != PCI_CLASS_STORAGE_EXPRESS) {
		dev_info(&pdev->dev, "not an NVMe controller (class 0x%06x)\n",
			 pdev->class);
		return -ENODEV;
	}
	ctrl = kzalloc(sizeof(*ctrl), GFP_KERNEL);
	if (!ctrl)
		return -ENOMEM;
	kref_init(&ctrl->ref);
	ctrl->pdev = pdev;
	INIT_LIST_HEAD(&ctrl->node);
	mutex_init(&ctrl->lock);
	init_completion(&ctrl->released);
	complete_all(&ctrl->released);		/* nobody owns it yet */

	ret = pci_enable_device_mem(pdev);
	if (ret)
		goto err_free_ctrl;
	ret = pci_request_mem_regions(pdev, P2PHUB_NVME_DRV_NAME);
	if (ret)
		goto err_disable_device;
	ret = dma_set_mask_and_coherent(&pdev->dev, DMA_BIT_MASK(64));
	if (ret)
		goto err_release_regions;
	/*
	 * The engine builds PRPs page by page from flattened address lists;
	 * it never hands the controller a segment, so any length will do
	 * (an exporter's table of long segments is then within the claim).
	 */
	dma_set_max_seg_size(&pdev->dev, UINT_MAX);
	ctrl->bar0_len = pci_resource_len(pdev, 0);
	if (ctrl->bar0_len < 0x2000) {
		ret = -ENODEV;
		goto err_release_regions;
	}
	ctrl->regs = pci_ioremap_bar(pdev, 0);
	if (!ctrl->regs) {
		ret = -ENOMEM;
		goto err_release_regions;
	}
	ctrl->bar0_mmap_len = p2phub_nvme_bar0_mmap_len(pdev, ctrl->bar0_len);

	want = pci_msix_vec_count(pdev);
	if (want > 0) {
		want = min(want, P2PHUB_NVME_MAX_IRQS);
		ret = pci_alloc_irq_vectors(pdev, 1, want, PCI_IRQ_MSIX);
		if (ret < 0)
			goto err_unmap_regs;
		ctrl->nr_irqs = ret;
	}
	ctrl->irqs = kcalloc(max(ctrl->nr_irqs, 1), sizeof(*ctrl->irqs),
			     GFP_KERNEL);
	if (!ctrl->irqs) {
		ret = -ENOMEM;
		goto err_free_vectors;
	}
	for (i = 0; i < ctrl->nr_irqs; i++) {
		ctrl->irqs[i].ctrl = ctrl;
		ctrl->irqs[i].vector = i;
		snprintf(ctrl->irqs[i].name, sizeof(ctrl->irqs[i].name),
			 "p2phub-nvme%d@%s", i, pci_name(pdev));
	}
	pci_save_state(pdev);
	pci_set_drvdata(pdev, ctrl);
	ctrl->group = iommu_group_get(&pdev->dev);
	mutex_lock(&p2phub_nvme_ctrls_lock);
	list_add(&ctrl->node, &p2phub_nvme_ctrls);
	mutex_unlock(&p2phub_nvme_ctrls_lock);
	dev_info(&pdev->dev, "owned by p2phub: BAR0 %pa bytes (%pa mappable), %d MSI-X vectors\n",
		 &ctrl->bar0_len, &ctrl->bar0_mmap_len, ctrl->nr_irqs);
	return 0;

err_free_vectors:
	pci_free_irq_vectors(pdev);
err_unmap_regs:
	iounmap(ctrl->regs);
err_release_regions:
	pci_release_mem_regions(pdev);
err_disable_device:
	pci_disable_device(pdev);
err_free_ctrl:
	p2phub_nvme_ctrl_put(ctrl);
	return ret;
}

/*
 * Wait for the owner to close its controller fd, asking again every 10 s,
 * for at most remove_grace_ms (less if the unbinding task is signalled: it
 * may be the owner itself, which can never close the fd meanwhile).
 */
static void p2phub_nvme_wait_released(struct p2phub_nvme_ctrl *ctrl)
{
	unsigned long deadline = jiffies + msecs_to_jiffies(READ_ONCE(remove_grace_ms));
	struct pci_dev *pdev = ctrl->pdev;
	long left, ret;

	for (;;) {
		left = (long)(deadline - jiffies);
		if (left <= 0)
			return;
		ret = wait_for_completion_interruptible_timeout(&ctrl->released,
								min_t(long, left, 10 * HZ));
		if (ret > 0)
			return;
		if (ret < 0) {
			dev_info(&pdev->dev, "unbinding task %s (%d) interrupted: not waiting for the owner any longer\n",
				 current->comm, task_pid_nr(current));
			return;
		}
		if (time_before(jiffies, deadline)) {
			dev_info(&pdev->dev, "unbind waits for the process owning this controller to close its fd\n");
			p2phub_nvme_request(ctrl, P2PHUB_NVME_ST_REMOVING, false);
		}
	}
}

static void p2phub_nvme_remove(struct pci_dev *pdev)
{
	struct p2phub_nvme_ctrl *ctrl = pci_get_drvdata(pdev);

	mutex_lock(&ctrl->lock);
	ctrl->dying = true;
	if (ctrl->owner)
		p2phub_nvme_signal(ctrl->owner, P2PHUB_NVME_ST_REMOVING, false);
	mutex_unlock(&ctrl->lock);
	/*
	 * The owner maps BAR0 and programs the controller: it must let go
	 * before the device can change hands. Like VFIO, ask it (the request
	 * eventfd and the status page) and wait for it; unlike VFIO, not for
	 * ever: after the grace period the kernel takes the controller back
	 * (DMA stopped, registrations unmapped, mappings zapped, memory and
	 * vectors freed), and the fd's ioctls fail with -ENODEV.
	 */
	p2phub_nvme_wait_released(ctrl);
	mutex_lock(&ctrl->lock);
	if (ctrl->owner) {
		dev_warn(&pdev->dev, "the owner did not close its controller fd within %u ms: taking the controller back\n",
			 READ_ONCE(remove_grace_ms));
		p2phub_nvme_take_back(ctrl, -ENODEV);
	}
	mutex_unlock(&ctrl->lock);
	p2phub_nvme_reset_handback(ctrl);

	mutex_lock(&p2phub_nvme_ctrls_lock);
	list_del_init(&ctrl->node);
	mutex_unlock(&p2phub_nvme_ctrls_lock);
	/* Bus mastering off under the device lock, whoever left it on. */
	pci_clear_master(pdev);
	pci_free_irq_vectors(pdev);
	iounmap(ctrl->regs);
	ctrl->regs = NULL;
	pci_release_mem_regions(pdev);
	pci_disable_device(pdev);
	pci_set_drvdata(pdev, NULL);
	p2phub_nvme_ctrl_put(ctrl);
	dev_info(&pdev->dev, "released by p2phub\n");
}

/*
 * PCI errors and resets: the owner's controller state is gone or suspect.
 * Stop its DMA, tell the owner (P2PHUB_NVME_ST_ERROR), zap its BAR0 mapping
 * (its faults wait until the device is back), and keep bus mastering off
 * until it re-initialises the controller and RESUMEs, which it may only
 * once recovery is over.
 */
static pci_ers_result_t p2phub_nvme_error_detected(struct pci_dev *pdev,
						   pci_channel_state_t state)
{
	struct p2phub_nvme_ctrl *ctrl = pci_get_drvdata(pdev);
	bool gone = state == pci_channel_io_perm_failure;

	ctrl->in_recovery = true;
	p2phub_nvme_request(ctrl, P2PHUB_NVME_ST_ERROR |
			    (gone ? P2PHUB_NVME_ST_REMOVING : 0), true);
	p2phub_nvme_owner_mmio(ctrl, true);
	return gone ? PCI_ERS_RESULT_DISCONNECT : PCI_ERS_RESULT_NEED_RESET;
}

static pci_ers_result_t p2phub_nvme_slot_reset(struct pci_dev *pdev)
{
	pci_restore_state(pdev);
	pci_save_state(pdev);
	pci_clear_master(pdev);
	return PCI_ERS_RESULT_RECOVERED;
}

static void p2phub_nvme_error_resume(struct pci_dev *pdev)
{
	struct p2phub_nvme_ctrl *ctrl = pci_get_drvdata(pdev);

	ctrl->in_recovery = false;
	p2phub_nvme_owner_mmio(ctrl, false);
}

static void p2phub_nvme_reset_prepare(struct pci_dev *pdev)
{
	struct p2phub_nvme_ctrl *ctrl = pci_get_drvdata(pdev);

	p2phub_nvme_request(ctrl, P2PHUB_NVME_ST_ERROR, true);
	p2phub_nvme_owner_mmio(ctrl, true);
}

static void p2phub_nvme_reset_done(struct pci_dev *pdev)
{
	pci_clear_master(pdev);
	p2phub_nvme_owner_mmio(pci_get_drvdata(pdev), false);
}

static const struct pci_error_handlers p2phub_nvme_err_handler = {
	.error_detected	= p2phub_nvme_error_detected,
	.slot_reset	= p2phub_nvme_slot_reset,
	.resume		= p2phub_nvme_error_resume,
	.reset_prepare	= p2phub_nvme_reset_prepare,
	.reset_done	= p2phub_nvme_reset_done,
};

struct pci_driver p2phub_nvme_driver = {
	.name		= P2PHUB_NVME_DRV_NAME,
	.id_table	= NULL,		/* reached only through driver_override */
	.probe		= p2phub_nvme_probe,
	.remove		= p2phub_nvme_remove,
	.err_handler	= &p2phub_nvme_err_handler,
	/*
	 * Its DMA is the owner's, confined by p2phub's DMA ownership of the
	 * group (p2phub_nvme_group_claim()), not the DMA API's sharing of it.
	 */
	.driver_managed_dma = true,
};

int p2phub_nvme_init(void)
{
	int ret;

	ret = p2phub_nvme_confine_init();
	if (ret)
		return ret;
	ret = pci_register_driver(&p2phub_nvme_driver);
	if (ret) {
		p2phub_nvme_confine_exit();
		return ret;
	}
	/* Under the module's one debugfs root: /sys/kernel/debug/p2phub/nvme. */
	p2phub_nvme_debugfs = debugfs_create_dir("nvme", p2phub_debugfs_dir);
	debugfs_create_atomic_t("live_dma_buffers", 0444, p2phub_nvme_debugfs,
				&p2phub_nvme_live_bufs);
	debugfs_create_atomic_t("live_handles", 0444, p2phub_nvme_debugfs,
				&p2phub_nvme_live_handles);
	debugfs_create_atomic_t("function_resets", 0444, p2phub_nvme_debugfs,
				&p2phub_nvme_function_resets);
	debugfs_create_atomic_t("taken_back", 0444, p2phub_nvme_debugfs,
				&p2phub_nvme_taken_back);
	return 0;
}

void p2phub_nvme_exit(void)
{
	debugfs_remove_recursive(p2phub_nvme_debugfs);
	pci_unregister_driver(&p2phub_nvme_driver);
	p2phub_nvme_confine_exit();
}
