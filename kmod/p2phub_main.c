// SPDX-License-Identifier: GPL-2.0-only
/*
 * p2phub.ko: the /dev/p2phub character device and its ioctl dispatch.
 *
 * Each ioctl runs in four stages: copy the arguments in, validate them,
 * allocate, publish. Anything that creates a file descriptor is done last,
 * because an installed fd cannot be taken back.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/build_bug.h>
#include <linux/dma-mapping.h>
#include <linux/cred.h>
#include <linux/fs.h>
#include <linux/miscdevice.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/slab.h>
#include <linux/string.h>
#include <linux/uaccess.h>
#include <linux/xarray.h>

#include "p2phub_priv.h"

static_assert(sizeof(struct p2phub_info) == 88);
static_assert(offsetof(struct p2phub_info, caps) == 16);
static_assert(offsetof(struct p2phub_info, version) == 24);
static_assert(offsetof(struct p2phub_info, reserved) == 56);

static u64 p2phub_caps(void)
{
	return P2PHUB_CAP_NVME | p2phub_reg_caps();
}

static long p2phub_ioctl_get_info(struct p2phub_file *pf, void __user *uarg)
{
	struct p2phub_info info;
	int ret;

	ret = p2phub_copy_args(&info, sizeof(info), uarg, 0);
	if (ret)
		return ret;
	if (!p2phub_all_zero(info.reserved, sizeof(info.reserved)) ||
	    !p2phub_outputs_zero(&info, abi_version, version))
		return -EINVAL;

	info.argsz = sizeof(info);
	info.abi_version = P2PHUB_ABI_VERSION;
	info.max_regs_per_file = P2PHUB_MAX_REGS_PER_FILE;
	info.caps = p2phub_caps();
	memset(info.version, 0, sizeof(info.version));
	strscpy(info.version, P2PHUB_VERSION, sizeof(info.version));

	if (copy_to_user(uarg, &info, sizeof(info)))
		return -EFAULT;
	return 0;
}

static long p2phub_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct p2phub_file *pf = file->private_data;
	void __user *uarg = (void __user *)arg;

	switch (cmd) {
	case P2PHUB_GET_INFO:
		return p2phub_ioctl_get_info(pf, uarg);
	case P2PHUB_NVME_OPEN:
		return p2phub_nvme_ioctl_open(file, uarg);
	case P2PHUB_REGISTER:
	case P2PHUB_UNREGISTER:
	case P2PHUB_REG_INFO:
	case P2PHUB_DMA_PAGES:
	case P2PHUB_EXPORT:
		return p2phub_reg_ioctl(pf, cmd, uarg);
	default:
		return -ENOTTY;
	}
}

static unsigned int max_files_per_user = 1024;
module_param(max_files_per_user, uint, 0644);
MODULE_PARM_DESC(max_files_per_user,
		 "Opens of /dev/p2phub one user (effective uid) may hold at once; 0: no limit (default 1024)");

/* Open files per effective uid (an xa value), for max_files_per_user. */
static DEFINE_MUTEX(p2phub_users_lock);
static DEFINE_XARRAY(p2phub_users);

static int p2phub_user_get(kuid_t uid)
{
	unsigned int limit = READ_ONCE(max_files_per_user);
	unsigned long n;
	void *entry;
	int ret;

	mutex_lock(&p2phub_users_lock);
	entry = xa_load(&p2phub_users, __kuid_val(uid));
	n = entry ? xa_to_value(entry) : 0;
	if (limit && n >= limit) {
		ret = -EMFILE;
		pr_info_ratelimited("pid %d (%s): open of /dev/%s refused: uid %u has %lu open already, the limit max_files_per_user (module parameter)\n",
				    task_pid_nr(current), current->comm,
				    P2PHUB_DEVICE_NAME,
				    from_kuid_munged(&init_user_ns, uid), n);
	} else {
		ret = xa_err(xa_store(&p2phub_users, __kuid_val(uid),
				      xa_mk_value(n + 1), GFP_KERNEL_ACCOUNT));
	}
	mutex_unlock(&p2phub_users_lock);
	return ret;
}

static void p2phub_user_put(kuid_t uid)
{
	unsigned long n;
	void *entry;

	mutex_lock(&p2phub_users_lock);
	entry = xa_load(&p2phub_users, __kuid_val(uid));
	n = entry ? xa_to_value(entry) : 0;
	if (WARN_ON_ONCE(!n) || n == 1)
		xa_erase(&p2phub_users, __kuid_val(uid));
	else	/* replaces a present entry: allocates nothing, cannot fail */
		xa_store(&p2phub_users, __kuid_val(uid), xa_mk_value(n - 1),
			 GFP_KERNEL);
	mutex_unlock(&p2phub_users_lock);
}

static int p2phub_open(struct inode *inode, struct file *file)
{
	struct p2phub_file *pf;
	int ret;

	pf = kzalloc(sizeof(*pf), GFP_KERNEL_ACCOUNT);
	if (!pf)
		return -ENOMEM;
	pf->uid = current_euid();
	ret = p2phub_user_get(pf->uid);
	if (ret) {
		kfree(pf);
		return ret;
	}
	mutex_init(&pf->lock);
	p2phub_reg_file_init(pf);
	file->private_data = pf;
	return 0;
}

static int p2phub_release(struct inode *inode, struct file *file)
{
	struct p2phub_file *pf = file->private_data;

	p2phub_reg_file_release(pf);
	p2phub_user_put(pf->uid);
	mutex_destroy(&pf->lock);
	kfree(pf);
	return 0;
}

static const struct file_operations p2phub_fops = {
	.owner		= THIS_MODULE,
	.open		= p2phub_open,
	.release	= p2phub_release,
	.unlocked_ioctl	= p2phub_ioctl,
	.compat_ioctl	= compat_ptr_ioctl,
	.llseek		= noop_llseek,
};

static struct miscdevice p2phub_misc = {
	.minor	= MISC_DYNAMIC_MINOR,
	.name	= P2PHUB_DEVICE_NAME,
	.fops	= &p2phub_fops,
	.mode	= 0660,
};

struct device *p2phub_device;

/*
 * Give /dev/p2phub's device a DMA mask, as any importer needs one: it
 * attaches to the sources of mmapped exports, only to learn their pages
 * (see p2phub_export.c). Without it those mmaps fail with -ENODEV.
 */
static void p2phub_device_setup(struct device *dev)
{
	int ret = dma_coerce_mask_and_coherent(dev, DMA_BIT_MASK(64));

	if (ret) {
		pr_warn("no DMA mask for /dev/%s (%d): exports cannot be mmapped\n",
			P2PHUB_DEVICE_NAME, ret);
		return;
	}
	p2phub_device = dev;
}

static int __init p2phub_init(void)
{
	int ret;

	ret = p2phub_reg_init();
	if (ret)
		return ret;
	ret = misc_register(&p2phub_misc);
	if (ret) {
		pr_err("cannot register /dev/%s: %d\n", P2PHUB_DEVICE_NAME, ret);
		p2phub_reg_exit();
		return ret;
	}
	p2phub_device_setup(p2phub_misc.this_device);
	ret = p2phub_nvme_init();
	if (ret) {
		pr_err("cannot register the p2phub-nvme PCI driver: %d\n", ret);
		misc_deregister(&p2phub_misc);
		p2phub_reg_exit();
		return ret;
	}
	pr_info("version %s, ABI %d, caps 0x%llx\n", P2PHUB_VERSION,
		P2PHUB_ABI_VERSION, p2phub_caps());
	return 0;
}

static void __exit p2phub_exit(void)
{
	p2phub_nvme_exit();
	p2phub_device = NULL;
	misc_deregister(&p2phub_misc);
	p2phub_reg_exit();
	WARN_ON(!xa_empty(&p2phub_users));
	xa_destroy(&p2phub_users);
}

module_init(p2phub_init);
module_exit(p2phub_exit);

MODULE_DESCRIPTION("GPU peer-to-peer registration hub for NVMe and RDMA");
MODULE_AUTHOR("p2phub");
MODULE_LICENSE("GPL");
MODULE_VERSION(P2PHUB_VERSION);
