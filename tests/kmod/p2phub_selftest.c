// SPDX-License-Identifier: GPL-2.0-only
/*
 * Test-only module proving that the lab catches kernel-side faults: loaded
 * with warn=1 it fires a WARN_ON, which must fail the lab run that loaded it.
 */
#include <linux/bug.h>
#include <linux/module.h>

static bool warn;
module_param(warn, bool, 0444);
MODULE_PARM_DESC(warn, "fire a WARN_ON at load time");

static int __init p2phub_selftest_init(void)
{
	WARN_ON(warn);
	return 0;
}

static void __exit p2phub_selftest_exit(void)
{
}

module_init(p2phub_selftest_init);
module_exit(p2phub_selftest_exit);

MODULE_DESCRIPTION("p2phub lab self-test module");
MODULE_LICENSE("GPL");
