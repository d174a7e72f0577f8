// SPDX-License-Identifier: GPL-2.0-only
/*
 * IOMMU facts about a device, shared by the registration providers and NVMe
 * ownership (see p2phub_iommu.h).
 */
#include <linux/device.h>
#include <linux/iommu.h>

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
