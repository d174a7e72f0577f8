/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Between a registration's lifetime (p2phub_reg.c) and its per-device maps
 * (p2phub_regmap.c): the maps code keeps every live registration on one
 * list, so that a device's loss of its driver, or its removal, finds every
 * map made for it.
 */
#ifndef _P2PHUB_REGMAP_H
#define _P2PHUB_REGMAP_H

struct p2phub_reg;

/* On the list from allocation until the last reference goes. */
void p2phub_regmap_track(struct p2phub_reg *reg);
void p2phub_regmap_untrack(struct p2phub_reg *reg);
/* The PCI bus notifier. */
int p2phub_regmap_init(void);
void p2phub_regmap_exit(void);

#endif /* _P2PHUB_REGMAP_H */
