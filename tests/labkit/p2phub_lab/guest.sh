#!/bin/bash
# Runs inside the lab VM (started by tools/lab): set the lab up, load
# p2phub.ko, run the command, unload, save the kernel log and the status.
#   guest.sh RUN_DIR
set -u
run=$1
status=125
guestlog=$run/guest.log
exec 3>&1 4>&2 >"$guestlog" 2>&1

finish() {
	dmesg >"$run/dmesg.txt" 2>&1
	echo "$status" >"$run/status"
	sync
}
trap finish EXIT
fail() { echo "lab setup failed: $*"; exit 125; }

env_file=$run/lab.env
cp "$run/lab.args" "$env_file"
{
	echo "run_dir=$run"
	echo "gpu_file=$run/gpu.mem"
	echo "kernel_release=$(uname -r)"
	# QEMU's monitor, for the commands the runner relays (PCIe error injection).
	if [ -d "$run/monitor" ]; then echo "monitor_dir=$run/monitor"; fi
} >>"$env_file"

mountpoint -q /sys/kernel/debug || mount -t debugfs none /sys/kernel/debug
mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config 2>/dev/null

# PCI addresses of the lab devices, found by identity, never by slot.
for ctrl in /sys/class/nvme/nvme*; do
	[ -e "$ctrl/serial" ] || continue
	serial=$(tr -d ' ' <"$ctrl/serial")
	bdf=$(basename "$(readlink -f "$ctrl/device")")
	case "$serial" in
	p2phub-target) echo "nvme_target=$bdf"; echo "nvme_target_ctrl=$(basename "$ctrl")" ;;
	p2phub-baseline) echo "nvme_baseline=$bdf"; echo "nvme_baseline_ctrl=$(basename "$ctrl")" ;;
	p2phub-pair-a) echo "nvme_pair_a=$bdf" ;;
	p2phub-pair-b) echo "nvme_pair_b=$bdf" ;;
	esac
done >>"$env_file"
for dev in /sys/bus/pci/devices/*; do
	if [ "$(cat "$dev/vendor")" = 0x1af4 ] && [ "$(cat "$dev/device")" = 0x1110 ]; then
		echo "gpu=$(basename "$dev")" >>"$env_file"
	fi
	if [ "$(cat "$dev/vendor")" = 0x1b36 ] && [ "$(cat "$dev/device")" = 0x0005 ]; then
		echo "spare=$(basename "$dev")" >>"$env_file"
	fi
done
grep -q '^nvme_target=' "$env_file" || fail "the target NVMe controller did not appear"
grep -q '^gpu=' "$env_file" || fail "the ivshmem stand-in GPU did not appear"
if [ -e /sys/kernel/iommu_groups/0 ]; then echo "iommu_groups=1"; else echo "iommu_groups=0"; fi >>"$env_file"

modprobe vgem || fail "modprobe vgem"

# Two nodes: the two ends of a veth pair, each with an rxe device. rxe's UDP
# socket lives in the initial network namespace, so both ends stay there and
# policy routing sends locally generated traffic between the two addresses
# over the wire instead of through the loopback shortcut.
# The debug lab kernel is built without rdma_rxe (tests/labkit/debug-kernel.config): the veth
# pair is set up, the rxe devices are not, and lab.env says rdma=0.
rdma=1
if grep -q '^debug_kernel=1' "$env_file" && ! modprobe -q rdma_rxe 2>/dev/null; then
	rdma=0
else
	modprobe rdma_rxe || fail "modprobe rdma_rxe"
fi
echo "rdma=$rdma" >>"$env_file"
ip link set lo up
ip link add veth-a type veth peer name veth-b || fail "veth pair"
sysctl -qw net.ipv4.conf.all.rp_filter=0
for n in a b; do
	sysctl -qw "net.ipv4.conf.veth-$n.accept_local=1" "net.ipv4.conf.veth-$n.rp_filter=0" \
		"net.ipv4.conf.veth-$n.arp_ignore=1" "net.ipv4.conf.veth-$n.arp_announce=2" \
		"net.ipv4.conf.veth-$n.arp_filter=1"
done
ip addr add 169.254.77.1/32 dev veth-a
ip addr add 169.254.77.2/32 dev veth-b
ip link set veth-a up
ip link set veth-b up
ip rule add pref 10 to 169.254.77.2 iif lo lookup 10
ip rule add pref 11 to 169.254.77.1 iif lo lookup 11
ip route add 169.254.77.2 dev veth-a src 169.254.77.1 table 10
ip route add 169.254.77.1 dev veth-b src 169.254.77.2 table 11
ip rule del pref 0 lookup local
ip rule add pref 100 lookup local
if [ $rdma = 1 ]; then
	for n in a b; do
		rdma link add "rxe-$n" type rxe netdev "veth-$n" || fail "rxe-$n"
	done
	echo "node_a_rdma=rxe-a"; echo "node_b_rdma=rxe-b"
fi >>"$env_file"
{
	echo "node_a_addr=169.254.77.1"; echo "node_a_netdev=veth-a"
	echo "node_b_addr=169.254.77.2"; echo "node_b_netdev=veth-b"
} >>"$env_file"

# Without an IOMMU nothing confines an owned NVMe controller: p2phub.ko
# refuses to hand one out unless told otherwise, which taints the kernel.
# The lab says so in its env file; its IOMMU runs use the safe default.
if [ -e /sys/kernel/iommu_groups/0 ]; then
	insmod "$run/ko/p2phub.ko" || fail "insmod p2phub.ko"
else
	insmod "$run/ko/p2phub.ko" allow_unsafe_noiommu=1 || fail "insmod p2phub.ko"
	echo "nvme_unconfined=1" >>"$env_file"
fi
[ -c /dev/p2phub ] || fail "/dev/p2phub did not appear"
echo "modules_dir=$run/ko" >>"$env_file"
echo "--- lab ready"; cat "$env_file"

export P2PHUB_LAB_ENV=$env_file P2PHUB_LAB_MODULES=$run/ko
# The benchmarks take their devices from the caller; in the lab, the lab's.
P2PHUB_BENCH_DEVICE=$(sed -n 's/^nvme_target=//p' "$env_file")
P2PHUB_BENCH_BASELINE=$(sed -n 's/^nvme_baseline=//p' "$env_file")
export P2PHUB_BENCH_DEVICE P2PHUB_BENCH_BASELINE
[ $rdma = 1 ] && export P2PHUB_BENCH_RDMA_DEV=rxe-a
export PATH=$(cd "$(dirname "$0")/../../.." && pwd)/.venv/bin:$PATH
cmd=$(cat "$run/command")
echo "--- running: $cmd"
exec 1>&3 2>&4
bash -c "$cmd"
status=$?
exec >>"$guestlog" 2>&1
echo "--- command exit $status"

# Everything the command did must be released: a module still in use leaked.
for m in $(lsmod | awk 'NR > 1 && $1 ~ /^p2phub/ {print $1}'); do
	[ "$m" = p2phub ] && continue
	rmmod "$m" || echo "p2phub: leak: test module $m still in use after the command"
done
if ! rmmod p2phub; then
	echo "p2phub: leak: p2phub.ko still in use after the command" | tee /dev/kmsg
fi
