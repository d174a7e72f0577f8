/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * p2phub_uargs.h: copying in ioctl arguments led by { __u32 argsz; __u32 flags; }.
 *
 * Header-only, so that every driver speaking p2phub's UAPI conventions (the
 * lab's stand-in GPU among them) applies the very same rules without linking
 * against p2phub.ko.
 */
#ifndef _P2PHUB_UARGS_H
#define _P2PHUB_UARGS_H

#include <linux/mm.h>
#include <linux/string.h>
#include <linux/types.h>
#include <linux/uaccess.h>

/* Reserved fields must be 0: true when all @len bytes at @p are. */
static inline bool p2phub_all_zero(const void *p, size_t len)
{
	return !memchr_inv(p, 0, len);
}

/*
 * Copy in the @ksize-byte argument at @uarg. A caller built against an
 * older, shorter struct is refused (no field may be silently zero-filled); a
 * newer, longer one (at most a page) must have zeroed the tail this kernel
 * does not know. Flags outside @known_flags are refused.
 */
static inline int p2phub_copy_args(void *karg, size_t ksize,
				   const void __user *uarg, u32 known_flags)
{
	u32 hdr[2], hdr2[2];
	int ret;

	if (copy_from_user(hdr, uarg, sizeof(hdr)))
		return -EFAULT;
	if (hdr[0] < ksize)
		return -EINVAL;
	/* Room to grow, not a 4 GiB scan of user memory. */
	if (hdr[0] > PAGE_SIZE)
		return -E2BIG;
	if (hdr[1] & ~known_flags)
		return -EINVAL;
	if (hdr[0] > ksize) {
		ret = check_zeroed_user(uarg + ksize, hdr[0] - ksize);
		if (ret < 0)
			return ret;
		if (!ret)
			return -E2BIG;
	}
	if (copy_from_user(karg, uarg, ksize))
		return -EFAULT;
	/*
	 * The header was read twice: user space may have changed it between
	 * the reads. What the caller acts on is the full copy: check that.
	 */
	memcpy(hdr2, karg, sizeof(hdr2));
	if (hdr2[0] != hdr[0] || (hdr2[1] & ~known_flags))
		return -EINVAL;
	return 0;
}

#endif /* _P2PHUB_UARGS_H */
