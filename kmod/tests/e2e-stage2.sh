#!/bin/bash
# PID 1 of the bunshin_share end-to-end VM after switch_root (kmod/tests/e2e-init.sh): the root
# is the host's root file system (virtio-9p, read-only) under an overlay with a tmpfs upper, so
# everything written here stays in the VM. Sets up what the workspace layer needs as the host
# has it (cgroup v1 hierarchies, /run, a btrfs pool of its own on a virtio disk holding the base
# image received from a `btrfs send` stream), loads bunshin_share.ko, runs the kmod fork tests
# with the real /dev/bunshin_share and measures kmod vs copy clones; prints
# BUNSHIN_KMOD_RESULT: PASS|FAIL on the serial console and powers off.
set -u
# shellcheck disable=SC1091
. /etc/bunshin-e2e.env
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 TERM=dumb
T0=$(date +%s)
result=FAIL
step() { echo "== e2e [$(($(date +%s) - T0))s] $*"; }
finish() {
	echo "BUNSHIN_KMOD_RESULT: $result"
	sync
	/bin/busybox poweroff -f
	sleep 10
}
die() { step "FAILED: $*"; dmesg | tail -n 40; finish; }

# --- the system mounts the workspace layer expects (the host: cgroup v1, /run on its own) ---
mkdir -p /dev/pts /dev/shm
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts /dev/pts || die devpts
mount -t tmpfs -o mode=1777 shm /dev/shm || die shm
mount -t tmpfs -o mode=755 run /run || die /run
mount -t tmpfs -o mode=1777 tmp /tmp || die /tmp
mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup || die cgroup-tmpfs
for c in cpu cpuacct cpuset memory devices freezer blkio pids; do
	mkdir -p "/sys/fs/cgroup/$c" && mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c" || die "cgroup $c"
done
mkdir -p /sys/fs/cgroup/systemd /sys/fs/cgroup/unified
mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd || die "cgroup name=systemd"
mount -t cgroup2 cgroup2 /sys/fs/cgroup/unified || die cgroup2

# the guest kernel's modules (unpacked from Debian's package on the host, depmod'ed there)
mkdir -p "/lib/modules/$E2E_KVER"
mount --bind "$E2E_MODROOT/lib/modules/$E2E_KVER" "/lib/modules/$E2E_KVER" || die "modules bind"
echo /sbin/modprobe > /proc/sys/kernel/modprobe
for m in virtio_blk btrfs loop; do modprobe "$m" || die "modprobe $m"; done
# What CRIU probes or uses that the host's kernel has built in: tun makes /dev/net/tun (CRIU's
# kernel-feature probe opens it; without it every dump fails), the sock_diag modules read
# sockets, nf_tables is the network lock of dumps with TCP connections. Loaded up front rather
# than left to autoloading, so that a missing one is named here.
for m in tun unix_diag inet_diag tcp_diag udp_diag raw_diag af_packet_diag netlink_diag nf_tables; do
	modprobe "$m" || die "modprobe $m"
done
# loopback up, as on any booted host (CRIU's kernel-feature probe connects a TCP socket on it)
ip link set lo up || die "lo up"

# never touch the host's pool from here: hide it (it is mounted read-write on the host)
mount -t tmpfs -o ro,size=4k,mode=000 hidden /var/lib/bunshin/pool || die "hiding the host pool"
[ -e /var/lib/bunshin/pool.img ] && { mount --bind /dev/null /var/lib/bunshin/pool.img || die "hiding pool.img"; }

# --- bunshin's state: its own home, run dir and btrfs pool; the host's CRIU build (read-only) ---
export BUNSHIN_HOME=/vm/bunshin BUNSHIN_RUN=/run/bunshin BUNSHIN_POOL=/vm/bunshin/pool
export BUNSHIN_POOL_FILE=/dev/vda BUNSHIN_CRIU_PREFIX=/var/lib/bunshin/criu
mkdir -p /vm && mount -t tmpfs -o mode=755 vm /vm || die /vm
mkdir -p "$BUNSHIN_POOL" "$BUNSHIN_HOME/runtime"
# the runtime layers the host built (its init is a static binary); a missing one is built here
cp -a /var/lib/bunshin/runtime/. "$BUNSHIN_HOME/runtime/" 2>/dev/null || true
step "pool: mkfs.btrfs on /dev/vda ($(($(blockdev --getsize64 /dev/vda) >> 30)) GiB sparse file on the host)"
mkfs.btrfs -q -f -L bunshin-vm-pool /dev/vda || die mkfs.btrfs
mount -o noatime,user_subvol_rm_allowed /dev/vda "$BUNSHIN_POOL" || die "mount pool"
mkdir -p "$BUNSHIN_POOL/images" "$BUNSHIN_POOL/workspaces" "$BUNSHIN_POOL/snapshots"
step "receiving image $E2E_IMAGE"
btrfs receive -q -f "$E2E_BUILD/e2e/$E2E_IMAGE.send" "$BUNSHIN_POOL/images" || die "btrfs receive"
cp "$E2E_BUILD/e2e/$E2E_IMAGE.json" "$BUNSHIN_POOL/images/" || die "image metadata"

# --- the module under test ---
dmesg -c >/dev/null	# judge only what the kernel logs from here on
insmod "$E2E_BUILD/mod/bunshin_share.ko" || die "insmod bunshin_share.ko"
[ -c /dev/bunshin_share ] || die "/dev/bunshin_share missing"
step "bunshin_share loaded; $(grep MemAvailable /proc/meminfo)"

cd "$E2E_REPO" || die "cd $E2E_REPO"
unset BUNSHIN_KMOD_DOUBLE
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
rc=0
# what every kmod clone pays besides the sharing: CRIU's pre-resume action starts this interpreter
t=$(date +%s%N)
.venv/bin/python -c "from bunshin_gym.workspace.kmod import main" || die "importing bunshin_gym.workspace.kmod"
step "the kmod action script's python start + import: $((($(date +%s%N) - t) / 1000000)) ms"
step "pytest $E2E_PYTEST"
eval "set -- $E2E_PYTEST"	# shell words: BUNSHIN_KMOD_E2E_PYTEST="tests/x.py -k 'a or b'"
.venv/bin/python -m pytest -p no:cacheprovider -v -rA "$@"
prc=$?
step "pytest exit $prc"
[ "$prc" = 0 ] || rc=1

if [ "${E2E_MEMORY:-1}" = 1 ]; then
	step "memory: kmod vs copy clones"
	.venv/bin/python kmod/tests/e2e_memory.py || rc=1
fi

step "leftovers: $(ls "$BUNSHIN_POOL/workspaces" | wc -l) workspace subvolumes, $(ls "$BUNSHIN_POOL/snapshots" | wc -l) snapshots"
# shellcheck disable=SC1091
. "$E2E_REPO/kmod/tests/kernel-log.sh"
rmmod_and_check_kernel_log
step "done"
[ "$rc" = 0 ] && result=PASS
finish
