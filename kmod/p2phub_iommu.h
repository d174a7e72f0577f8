/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * IOMMU facts about a device, for both sides of p2phub.ko: the registration
 * providers (which DMA addresses a device gets) and NVMe ownership (whether
 * a controller's DMA is confined, and flushing what was unmapped for it).
 */
#ifndef _P2PHUB_IOMMU_H
#define _P2PHUB_IOMMU_H

#include <linux/types.h>

struct device;
struct iommu_group;

/* Whether an IOMMU paging domain translates @dev's DMA. */
bool p2phub_dev_translated(struct device *dev);
/*
 * Make what was just unmapped for @dev unreachable now: a lazily flushing
 * domain (DMA-FQ) clears the page tables at unmap but flushes the IOTLB later.
 */
void p2phub_flush_iotlb(struct device *dev);
/*
 * DMA ownership of @dev's IOMMU group (@group) for @owner, as VFIO takes it:
 * while held, the kernel refuses the probe of every driver in the group that
 * uses the DMA API, and VFIO's and iommufd's claims. The group sits in the
 * blocking domain until the owner attaches one.
 */
int p2phub_iommu_claim_dma(struct device *dev, struct iommu_group *group,
			   void *owner);
void p2phub_iommu_release_dma(struct device *dev, struct iommu_group *group);

#endif /* _P2PHUB_IOMMU_H */
