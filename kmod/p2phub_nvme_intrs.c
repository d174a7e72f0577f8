// SPDX-License-Identifier: GPL-2.0-only
/*
 * NVMe controller ownership: the owner's eventfds.
 *
 * Each MSI-X vector the owner asks for is relayed to an eventfd of its
 * choosing; the request eventfd, beside the status page, tells it what the
 * kernel wants (a revocation, a reset, removal).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/eventfd.h>
#include <linux/interrupt.h>
#include <linux/pci.h>
#include <linux/spinlock.h>
#include <linux/uaccess.h>

#include "compat.h"
#include "p2phub_priv.h"
#include "p2phub_nvme.h"

/*
 * Tell the owner something through the status page and its request
 * eventfd; with @stop, turn bus mastering off first, which leaves the
 * controller unable to DMA once the (non-posted) config write completes.
 * Atomic context is fine.
 */
void p2phub_nvme_signal(struct p2phub_nvme_handle *h, u32 bits,
			bool stop)
{
	unsigned long flags;

	spin_lock_irqsave(&h->status_lock, flags);
	if (stop)
		pci_clear_master(h->pdev);
	WRITE_ONCE(h->status->state, h->status->state | bits);
	WRITE_ONCE(h->status->events, h->status->events + 1);
	if (h->req_trigger)
		p2phub_eventfd_signal(h->req_trigger);
	spin_unlock_irqrestore(&h->status_lock, flags);
}

/* Tell the controller's owner, if any; stop its DMA either way if asked. */
void p2phub_nvme_request(struct p2phub_nvme_ctrl *ctrl, u32 bits,
			 bool stop)
{
	mutex_lock(&ctrl->lock);
	if (ctrl->owner)
		p2phub_nvme_signal(ctrl->owner, bits, stop);
	else if (stop)
		pci_clear_master(ctrl->pdev);
	mutex_unlock(&ctrl->lock);
}

static irqreturn_t p2phub_nvme_irq_handler(int irq, void *data)
{
	struct p2phub_nvme_irq *v = data;

	p2phub_eventfd_signal(v->trigger);
	return IRQ_HANDLED;
}

/* Caller holds h->lock. */
void p2phub_nvme_irq_detach(struct p2phub_nvme_handle *h,
			    struct p2phub_nvme_irq *v)
{
	lockdep_assert_held(&h->lock);
	if (!v->trigger)
		return;
	free_irq(pci_irq_vector(h->pdev, v->vector), v);
	eventfd_ctx_put(v->trigger);
	v->trigger = NULL;
}

long p2phub_nvme_ioctl_irq_set(struct p2phub_nvme_handle *h,
			       void __user *uarg)
{
	struct p2phub_nvme_ctrl *ctrl = h->ctrl;
	struct p2phub_nvme_irq_set arg;
	struct eventfd_ctx *trigger;
	struct p2phub_nvme_irq *v;
	int ret;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (!p2phub_all_zero(arg.reserved, sizeof(arg.reserved)))
		return -EINVAL;
	if (arg.vector >= ctrl->nr_irqs)
		return -EINVAL;
	if (arg.eventfd < -1)
		return -EBADF;

	v = &ctrl->irqs[arg.vector];
	ret = p2phub_nvme_lock_live(h);
	if (ret)
		return ret;
	p2phub_nvme_irq_detach(h, v);
	if (arg.eventfd == -1) {
		ret = 0;
		goto out_unlock;
	}
	trigger = eventfd_ctx_fdget(arg.eventfd);
	if (IS_ERR(trigger)) {
		ret = PTR_ERR(trigger);
		goto out_unlock;
	}
	v->trigger = trigger;	/* the handler reads it; published before request_irq */
	ret = request_irq(pci_irq_vector(h->pdev, v->vector),
			  p2phub_nvme_irq_handler, 0, v->name, v);
	if (ret)
		goto err_put_trigger;
	mutex_unlock(&h->lock);
	return 0;

err_put_trigger:
	v->trigger = NULL;
	eventfd_ctx_put(trigger);
out_unlock:
	mutex_unlock(&h->lock);
	return ret;
}

long p2phub_nvme_ioctl_req_set(struct p2phub_nvme_handle *h,
			       void __user *uarg)
{
	struct eventfd_ctx *trigger = NULL, *old;
	struct p2phub_nvme_req_set arg;
	unsigned long flags;
	int ret;

	ret = p2phub_copy_args(&arg, sizeof(arg), uarg, 0);
	if (ret)
		return ret;
	if (arg.__reserved || !p2phub_all_zero(arg.reserved, sizeof(arg.reserved)))
		return -EINVAL;
	if (arg.eventfd != -1) {
		if (arg.eventfd < 0)
			return -EBADF;
		trigger = eventfd_ctx_fdget(arg.eventfd);
		if (IS_ERR(trigger))
			return PTR_ERR(trigger) == -EINVAL ? -EBADF :
			       PTR_ERR(trigger);
	}
	spin_lock_irqsave(&h->status_lock, flags);
	old = h->req_trigger;
	h->req_trigger = trigger;
	/* Something may already be asked: say so at once. */
	if (trigger && h->status->state)
		p2phub_eventfd_signal(trigger);
	spin_unlock_irqrestore(&h->status_lock, flags);
	if (old)
		eventfd_ctx_put(old);
	return 0;
}
