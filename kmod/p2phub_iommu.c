// SPDX-License-Identifier: GPL-2.0-only
/*
 * IOMMU facts about a device, shared by the registration providers and NVMe
 * ownership (see p2phub_iommu.h).
 */
#include <linux/device.h>
#include <linux/iommu.h>
#include <linux/version.h>

#include "p2phub_iommu.h"

bool p2phub_dev_translated(struct device *dev)
{
	struct iommu_domain *domain;

	if (!device_iommu_mapped(dev))
		return false;
	domain = iommu_get_domain_for_dev(dev);
	return domain && (domain->type & __IOMMU_DOMAIN_PAGING);
}

void p2phub_flush_iotlb(struct device *dev)
{
	struct iommu_domain *domain = iommu_get_domain_for_dev(dev);

	if (domain && (domain->type & __IOMMU_DOMAIN_PAGING))
		iommu_flush_iotlb_all(domain);
}

/*
 * iommu_device_claim_dma_owner() came with iommufd in v6.2; before it, the
 * group variant (VFIO's) is the one there is. Both fail while a driver that
 * uses the DMA API is bound in the group, or another owner holds it.
 */
int p2phub_iommu_claim_dma(struct device *dev, struct iommu_group *group,
			   void *owner)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 2, 0)
	return iommu_device_claim_dma_owner(dev, owner);
#else
	return iommu_group_claim_dma_owner(group, owner);
#endif
}

void p2phub_iommu_release_dma(struct device *dev, struct iommu_group *group)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 2, 0)
	iommu_device_release_dma_owner(dev);
#else
	iommu_group_release_dma_owner(group);
#endif
}
