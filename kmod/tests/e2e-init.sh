#!/bin/busybox sh
# /init of the bunshin_share end-to-end VM (`vmtest.sh e2e`): load the modules of Debian's 6.1
# kernel that reach the host's root file system (virtio-9p, exported read-only by qemu), lay a
# writable overlay (tmpfs upper) over it and switch_root into it; the second stage,
# kmod/tests/e2e-stage2.sh, then runs with the host's own userland (python, CRIU, btrfs-progs).
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev

fail() {
	echo "== e2e init: $*"
	echo "BUNSHIN_KMOD_RESULT: FAIL"
	poweroff -f
	sleep 5
}

. /e2e.env
echo "== bunshin kmod e2e VM: kernel $(uname -r), $(grep MemTotal /proc/meminfo), $(nproc) cpus"
# /modules.list: the .ko files (dependencies first) that 9p, virtio-pci and overlayfs need
while read -r ko; do
	insmod "/modules/$ko" || fail "insmod $ko"
done < /modules.list

mkdir -p /host /rw /newroot
# cache=loose: the export is read-only and nothing in the VM changes it
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /host ||
	fail "mounting the host root (9p) failed"
mount -t tmpfs -o mode=755 rw /rw || fail "tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay -o "lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work" overlay /newroot ||
	fail "overlay over the 9p root failed"
[ -x "/newroot$E2E_REPO/kmod/tests/e2e-stage2.sh" ] || fail "$E2E_REPO/kmod/tests/e2e-stage2.sh not visible"
cp /e2e.env /newroot/etc/bunshin-e2e.env
for m in proc sys dev; do
	mount --move "/$m" "/newroot/$m" || fail "move /$m"
done
echo "== e2e init: switching to the host root (9p + overlay)"
exec switch_root /newroot /bin/bash "$E2E_REPO/kmod/tests/e2e-stage2.sh"
