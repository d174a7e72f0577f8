// SPDX-License-Identifier: GPL-2.0-only
/*
 * Test-only module proving that the debug lab kernel's checkers report, and
 * that the lab's kernel-log scan fails a run on their reports. Each parameter
 * plants one known-bad sequence at load time; without parameters it does
 * nothing.
 *
 *   lockdep=1       take two mutexes in the order A, B and then B, A (one
 *                   thread, so nothing hangs): lockdep reports a possible
 *                   circular locking dependency.
 *   sleep_atomic=1  call might_sleep() under a spinlock: DEBUG_ATOMIC_SLEEP
 *                   reports a sleeping function called from invalid context.
 */
#include <linux/kernel.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/spinlock.h>

static bool lockdep;
module_param(lockdep, bool, 0444);
MODULE_PARM_DESC(lockdep, "take two mutexes in both orders at load time");

static bool sleep_atomic;
module_param(sleep_atomic, bool, 0444);
MODULE_PARM_DESC(sleep_atomic, "call might_sleep() under a spinlock at load time");

static DEFINE_MUTEX(labcheck_a);
static DEFINE_MUTEX(labcheck_b);
static DEFINE_SPINLOCK(labcheck_spin);

static void labcheck_inversion(void)
{
	mutex_lock(&labcheck_a);
	mutex_lock(&labcheck_b);
	mutex_unlock(&labcheck_b);
	mutex_unlock(&labcheck_a);

	mutex_lock(&labcheck_b);
	mutex_lock(&labcheck_a);
	mutex_unlock(&labcheck_a);
	mutex_unlock(&labcheck_b);
}

static void labcheck_sleep_in_atomic(void)
{
	spin_lock(&labcheck_spin);
	might_sleep();
	spin_unlock(&labcheck_spin);
}

static int __init p2phub_labcheck_init(void)
{
	if (lockdep)
		labcheck_inversion();
	if (sleep_atomic)
		labcheck_sleep_in_atomic();
	return 0;
}

static void __exit p2phub_labcheck_exit(void)
{
}

module_init(p2phub_labcheck_init);
module_exit(p2phub_labcheck_exit);

MODULE_DESCRIPTION("p2phub lab: plants lockdep and atomic-sleep reports on request");
MODULE_LICENSE("GPL");
