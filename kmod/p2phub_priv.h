/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * p2phub.ko internals.
 *
 * Objects:
 *   struct p2phub_file  one per open of /dev/p2phub: the ledger of everything
 *                       that open holds; release of the file releases it all.
 *
 * Lock order (outer first):
 *   p2phub_file.lock
 */
#ifndef _P2PHUB_PRIV_H
#define _P2PHUB_PRIV_H

#include <linux/mutex.h>
#include <linux/types.h>

#include "uapi/p2phub.h"

#define P2PHUB_VERSION		"0.1.0"
#define P2PHUB_MAX_REGS_PER_FILE	4096

struct p2phub_file {
	struct mutex lock;	/* protects everything below */
};

/* Copy an argsz-prefixed struct from user space, checking argsz and flags. */
int p2phub_copy_args(void *karg, size_t ksize, const void __user *uarg,
		     u32 known_flags);
bool p2phub_all_zero(const void *p, size_t len);

/*
 * NVMe controller ownership (p2phub_nvme.c). A controller fd owns one
 * struct p2phub_nvme_ctrl; lock order there: device_lock(pci_dev) ->
 * p2phub_nvme_ctrl.lock; p2phub_nvme_handle.lock is taken alone.
 */
int p2phub_nvme_init(void);
void p2phub_nvme_exit(void);
long p2phub_nvme_ioctl_open(struct p2phub_file *pf, void __user *uarg);

#endif /* _P2PHUB_PRIV_H */
