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

/* Whether an IOMMU paging domain translates @dev's DMA. */
bool p2phub_dev_translated(struct device *dev);
/*
 * Make what was just unmapped for @dev unreachable now: a lazily flushing
 * domain (DMA-FQ) clears the page tables at unmap but flushes the IOTLB later.
 */
void p2phub_flush_iotlb(struct device *dev);

#endif /* _P2PHUB_IOMMU_H */
