// SPDX-License-Identifier: GPL-2.0-only
/*
 * The registration ioctls of /dev/p2phub: REGISTER, UNREGISTER, REG_INFO,
 * DMA_PAGES and EXPORT.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/build_bug.h>
#include <linux/capability.h>
#include <linux/log2.h>
#include <linux/overflow.h>
#include <linux/pci.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

#include "p2phub_reg.h"

static_assert(sizeof(struct p2phub_register) == 80);
static_assert(offsetof(struct p2phub_register, va) == 24);
static_assert(offsetof(struct p2phub_register, out_handle) == 48);
static_assert(sizeof(struct p2phub_unregister) == 24);
static_assert(sizeof(struct p2phub_reg_info) == 80);
static_assert(offsetof(struct p2phub_reg_info, out_generation) == 24);
static_assert(sizeof(struct p2phub_dma_pages) == 80);
static_assert(offsetof(struct p2phub_dma_pages, first) == 32);
static_assert(offsetof(struct p2phub_dma_pages, out_total) == 48);
static_assert(sizeof(struct p2phub_export) == 32);
static_assert(sizeof(dma_addr_t) <= sizeof(u64));

#define P2PHUB_COPY_CHUNK	512	/* addresses per bounce buffer */

static struct pci_dev *p2phub_pci_get(u32 domain, u8 bus, u8 devfn)
{
	if (domain > 0xffff)
		return NULL;
	return pci_get_domain_bus_and_slot(domain, bus, devfn);
}

static int p2phub_reg_validate_register(const struct p2phub_register *a)
{
	u32 kind = a->flags & (P2PHUB_REGISTER_F_DMABUF |
			       P2PHUB_REGISTER_F_NVIDIA);
	u64 end;

	if (a->__reserved0 || a->__reserved1 ||
	    !p2phub_all_zero(a->reserved, sizeof(a->reserved)) ||
	    a->out_handle || a->out_page_size || a->out_provider)
		return -EINVAL;
	if (!(a->flags & P2PHUB_REGISTER_F_DEVICE) &&
	    (a->domain || a->bus || a->devfn))
		return -EINVAL;
	if (!a->length)
		return -EINVAL;
	if (kind == P2PHUB_REGISTER_F_DMABUF) {
		if (a->va || a->fd < 0)
			return a->fd < 0 ? -EBADF : -EINVAL;
		if (!PAGE_ALIGNED(a->offset) || !PAGE_ALIGNED(a->length))
			return -EINVAL;
		if (check_add_overflow(a->offset, a->length, &end))
			return -EOVERFLOW;
		return 0;
	}
	if (kind == P2PHUB_REGISTER_F_NVIDIA) {
		if (a->fd != -1 || a->offset)
			return -EINVAL;
		if (!IS_ALIGNED(a->va, SZ_64K) || !IS_ALIGNED(a->length, SZ_64K))
			return -EINVAL;
		if (check_add_overflow(a->va, a->length, &end))
			return -EOVERFLOW;
		return 0;
	}
	return -EINVAL;		/* neither or both */
}


static long p2phub_ioctl_register(struct p2phub_file *pf, void __user *uarg)
{
	struct p2phub_register a;
	struct pci_dev *pdev = NULL;
	struct p2phub_reg *reg;
	struct p2phub_reg_map *map;
	u32 handle;
	int ret;

	ret = p2phub_copy_args(&a, sizeof(a), uarg, P2PHUB_REGISTER_F_DMABUF |
			       P2PHUB_REGISTER_F_NVIDIA |
			       P2PHUB_REGISTER_F_DEVICE);
	if (ret)
		return ret;
	ret = p2phub_reg_validate_register(&a);
	if (ret)
		return ret;
	if (a.flags & P2PHUB_REGISTER_F_DEVICE) {
		if (!capable(CAP_SYS_ADMIN))	/* as for P2PHUB_DMA_PAGES */
			return -EPERM;
		pdev = p2phub_pci_get(a.domain, a.bus, a.devfn);
		if (!pdev)
			return -ENODEV;
	}

	reg = p2phub_reg_alloc();
	if (!reg) {
		ret = -ENOMEM;
		goto err_put_pdev;
	}
	reg->length = a.length;
	ret = p2phub_reg_charge(reg, pf);
	if (ret)
		goto err_put_reg;
	if (a.flags & P2PHUB_REGISTER_F_DMABUF) {
		ret = p2phub_dmabuf_setup(reg, a.fd, a.offset, a.length);
	} else {
#ifdef P2PHUB_HAVE_NV_P2P
		ret = p2phub_nv_setup(reg, a.va, a.length);
#else
		ret = -EOPNOTSUPP;
#endif
	}
	if (ret)
		goto err_put_reg;

	if (pdev) {
		map = p2phub_reg_map_get(reg, pdev);
		if (IS_ERR(map)) {
			ret = PTR_ERR(map);
			goto err_put_reg;
		}
		p2phub_reg_map_put(reg, map, false);	/* cached until teardown */
	}

	/* Publish: the handle becomes visible to the file's other users. */
	mutex_lock(&pf->lock);
	if (reg->length > p2phub_max_reg_bytes() - min(pf->reg_bytes,
						       p2phub_max_reg_bytes()))
		ret = -ENOSPC;
	else
		ret = xa_alloc(&pf->regs, &handle, reg,
			       XA_LIMIT(1, P2PHUB_MAX_REGS_PER_FILE),
			       GFP_KERNEL_ACCOUNT);
	if (!ret) {
		reg->handle = handle;
		pf->reg_bytes += reg->length;
	}
	mutex_unlock(&pf->lock);
	if (ret) {
		ret = ret == -EBUSY ? -ENOSPC : ret;
		goto err_put_reg;
	}

	a.out_handle = handle;
	a.out_page_size = p2phub_reg_page_size(reg);
	a.out_provider = reg->provider->id;
	if (copy_to_user(uarg, &a, sizeof(a))) {
		/* Take the handle back, unless a racing UNREGISTER did. */
		mutex_lock(&pf->lock);
		if (xa_load(&pf->regs, handle) == reg &&
		    p2phub_reg_kill(reg, false)) {
			xa_erase(&pf->regs, handle);
			pf->reg_bytes -= reg->length;
		} else
			reg = NULL;
		mutex_unlock(&pf->lock);
		ret = -EFAULT;
		if (!reg)
			goto err_put_pdev;
		goto err_put_reg;
	}
	pci_dev_put(pdev);
	return 0;

err_put_reg:
	p2phub_reg_put(reg);		/* releases whatever was set up */
err_put_pdev:
	pci_dev_put(pdev);
	return ret;
}

static long p2phub_ioctl_unregister(struct p2phub_file *pf, void __user *uarg)
{
	struct p2phub_unregister a;
	struct p2phub_reg *reg;
	int ret;

	ret = p2phub_copy_args(&a, sizeof(a), uarg, 0);
	if (ret)
		return ret;
	if (!p2phub_all_zero(a.reserved, sizeof(a.reserved)))
		return -EINVAL;
	if (!a.handle || a.handle > U32_MAX)
		return -ENOENT;

	mutex_lock(&pf->lock);
	reg = xa_load(&pf->regs, a.handle);
	if (!reg) {
		ret = -ENOENT;
	} else if (!p2phub_reg_kill(reg, false)) {
		ret = -EBUSY;
	} else {
		xa_erase(&pf->regs, a.handle);	/* its reference is ours now */
		pf->reg_bytes -= reg->length;
		ret = 0;
	}
	mutex_unlock(&pf->lock);
	if (ret)
		return ret;

	p2phub_reg_teardown(reg);
	p2phub_reg_put(reg);
	return 0;
}

static long p2phub_ioctl_reg_info(struct p2phub_file *pf, void __user *uarg)
{
	struct p2phub_reg_info a;
	struct p2phub_reg *reg;
	int ret;

	ret = p2phub_copy_args(&a, sizeof(a), uarg, 0);
	if (ret)
		return ret;
	if (!p2phub_outputs_zero(&a, out_state, out_flags) ||
	    !p2phub_all_zero(a.reserved, sizeof(a.reserved)))
		return -EINVAL;
	reg = p2phub_reg_get(pf, a.handle);
	if (IS_ERR(reg))
		return PTR_ERR(reg);

	a.out_flags = (reg->read_only ? P2PHUB_REG_INFO_F_READ_ONLY : 0) |
		      (reg->revocable ? P2PHUB_REG_INFO_F_REVOCABLE : 0);
	mutex_lock(&reg->lock);
	a.out_nr_devices = reg->nr_maps;
	a.out_nr_exports = reg->nr_exports;
	mutex_unlock(&reg->lock);
	spin_lock(&reg->state_lock);
	a.out_state = reg->state;
	a.out_generation = reg->generation;
	a.out_nr_attached = reg->export_attached;
	a.out_io_holds = reg->io_holds;
	spin_unlock(&reg->state_lock);
	a.out_provider = reg->provider->id;
	a.out_length = reg->length;
	a.out_page_size = p2phub_reg_page_size(reg);
	p2phub_reg_put(reg);

	if (copy_to_user(uarg, &a, sizeof(a)))
		return -EFAULT;
	return 0;
}

/*
 * Copy entries [first, first + n) of the list, in units of 1 << shift
 * (no larger than the registration's pages), to user space.
 */
static int p2phub_copy_addrs(const struct p2phub_dma_list *list, u32 shift,
			     u64 first, u32 n, u64 __user *uaddrs)
{
	u32 per_page = 1U << (list->page_shift - shift);
	u64 *buf;
	u32 done = 0;
	int ret = 0;

	buf = kmalloc_array(P2PHUB_COPY_CHUNK, sizeof(*buf), GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	while (done < n) {
		u32 i, chunk = min_t(u32, n - done, P2PHUB_COPY_CHUNK);

		for (i = 0; i < chunk; i++) {
			u64 idx = first + done + i;

			buf[i] = list->addrs[idx / per_page] +
				 ((idx % per_page) << shift);
		}
		if (copy_to_user(uaddrs + done, buf, chunk * sizeof(*buf))) {
			ret = -EFAULT;
			break;
		}
		done += chunk;
		cond_resched();
	}
	kfree(buf);
	return ret;
}

int p2phub_reg_copy_dma_pages(struct p2phub_reg *reg,
			      const struct p2phub_dma_list *list,
			      u32 page_size, u64 first, u32 count,
			      u64 __user *uaddrs, u64 *total)
{
	u32 shift, n;

	if (page_size && (!is_power_of_2(page_size) || page_size < SZ_4K))
		return -EINVAL;
	if (count > P2PHUB_DMA_PAGES_MAX)
		return -E2BIG;
	if (count && !uaddrs)
		return -EINVAL;
	shift = page_size ? ilog2(page_size) : list->page_shift;
	if (shift > list->page_shift)
		return -EINVAL;
	*total = reg->length >> shift;
	if (count && first >= *total)
		return -ERANGE;
	n = count ? min_t(u64, count, *total - first) : 0;
	return p2phub_copy_addrs(list, shift, first, n, uaddrs);
}

static long p2phub_ioctl_dma_pages(struct p2phub_file *pf, void __user *uarg)
{
	struct p2phub_dma_pages a;
	struct p2phub_dma_list list;
	struct p2phub_reg *reg;
	struct pci_dev *pdev;
	u64 total;
	int ret;

	ret = p2phub_copy_args(&a, sizeof(a), uarg, 0);
	if (ret)
		return ret;
	if (a.__reserved0 || !p2phub_all_zero(a.reserved, sizeof(a.reserved)) ||
	    a.out_total || a.out_generation)
		return -EINVAL;
	/*
	 * Mapping memory for a device of another driver and reading back bus
	 * addresses is an administrator's business; an NVMe controller's
	 * owner gets its addresses through P2PHUB_NVME_MAP_REG.
	 */
	if (!capable(CAP_SYS_ADMIN))
		return -EPERM;

	reg = p2phub_reg_get(pf, a.handle);
	if (IS_ERR(reg))
		return PTR_ERR(reg);
	pdev = p2phub_pci_get(a.domain, a.bus, a.devfn);
	if (!pdev) {
		ret = -ENODEV;
		goto out_put_reg;
	}

	ret = p2phub_reg_dma_pages(reg, pdev, &list);
	if (ret)
		goto out_put_pdev;
	/* Keep the map's address array from a racing UNREGISTER. */
	ret = p2phub_reg_io_begin(reg, list.generation);
	if (ret) {
		p2phub_reg_dma_pages_put(reg, &list, false);
		goto out_put_pdev;
	}
	ret = p2phub_reg_copy_dma_pages(reg, &list, a.page_size, a.first,
					a.count, u64_to_user_ptr(a.addrs),
					&total);
	p2phub_reg_io_end(reg);
	p2phub_reg_dma_pages_put(reg, &list, false);	/* cached until teardown */
	if (ret)
		goto out_put_pdev;
	/* Revoked while copying: what user space holds is already stale. */
	if (!p2phub_reg_live(reg, list.generation)) {
		ret = -ESTALE;
		goto out_put_pdev;
	}

	a.count = a.count ? min_t(u64, a.count, total - a.first) : 0;
	a.out_total = total;
	a.out_generation = list.generation;
	if (copy_to_user(uarg, &a, sizeof(a)))
		ret = -EFAULT;
out_put_pdev:
	pci_dev_put(pdev);
out_put_reg:
	p2phub_reg_put(reg);
	return ret;
}

static long p2phub_ioctl_export(struct p2phub_file *pf, void __user *uarg)
{
	struct p2phub_export a;
	struct p2phub_reg *reg;
	int ret;

	ret = p2phub_copy_args(&a, sizeof(a), uarg, P2PHUB_EXPORT_F_CLOEXEC);
	if (ret)
		return ret;
	if (!p2phub_all_zero(a.reserved, sizeof(a.reserved)))
		return -EINVAL;
	reg = p2phub_reg_get(pf, a.handle);
	if (IS_ERR(reg))
		return PTR_ERR(reg);
	ret = p2phub_export_create(reg, a.flags);	/* the fd, last */
	p2phub_reg_put(reg);
	return ret;
}

long p2phub_reg_ioctl(struct p2phub_file *pf, unsigned int cmd,
		      void __user *uarg)
{
	switch (cmd) {
	case P2PHUB_REGISTER:
		return p2phub_ioctl_register(pf, uarg);
	case P2PHUB_UNREGISTER:
		return p2phub_ioctl_unregister(pf, uarg);
	case P2PHUB_REG_INFO:
		return p2phub_ioctl_reg_info(pf, uarg);
	case P2PHUB_DMA_PAGES:
		return p2phub_ioctl_dma_pages(pf, uarg);
	case P2PHUB_EXPORT:
		return p2phub_ioctl_export(pf, uarg);
	default:
		return -ENOTTY;
	}
}
