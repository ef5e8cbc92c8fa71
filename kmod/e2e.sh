# Sourced by vmtest.sh for `vmtest.sh e2e` (HERE, BUILD, KVER, KCACHE, NICE, MEM, log, die set).
#
# The workspace "kmod" memory mode for real: the VM boots Debian's 6.1 kernel with the host's
# root file system exported read-only over virtio-9p; kmod/tests/e2e-init.sh lays an overlay
# with a tmpfs upper on it and switch_roots into it; kmod/tests/e2e-stage2.sh gives the
# workspace layer a btrfs pool of its own on a virtio disk (a sparse file here) holding the base
# image (a `btrfs send` stream of the host's read-only image subvolume; the host's pool itself is
# never mounted or written), loads bunshin_share.ko and runs the tests and the measurement.
REPO=$(cd "$HERE/.." && pwd)
E2E_TIMEOUT=${BUNSHIN_KMOD_TIMEOUT:-3600}
E2E_MEM=${BUNSHIN_KMOD_VM_MEM:-6144M}
E2E_PYTEST=${BUNSHIN_KMOD_E2E_PYTEST:-tests/workspace/test_kmod_e2e.py}
E2E_MEMORY=${BUNSHIN_KMOD_E2E_MEMORY:-1}
POOL_IMG=$BUILD/vm-pool.img
POOL_SIZE=${BUNSHIN_KMOD_E2E_POOL:-8G}
need_pkgs btrfs-progs kmod

# 1. the guest kernel's whole module tree, unpacked from the same package as vmlinuz (never
#    installed) and indexed by depmod, so that modprobe and the kernel's module autoloading
#    (nf_tables for CRIU's network lock, the sock_diag modules CRIU reads sockets with) work
case "$KCACHE" in /tmp/* | /run/* | /dev/*)
	die "BUNSHIN_KMOD_CACHE=$CACHE is under /tmp, /run or /dev, which the VM mounts afresh: the VM would not see the kernel modules" ;;
esac
MODROOT=$KCACHE/modroot
MODDIR=$MODROOT/lib/modules/$KVER
if [ ! -f "$MODDIR/modules.dep" ]; then
	deb=$(kernel_deb " for its modules")
	rm -rf "$MODROOT" && mkdir -p "$MODROOT"
	dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$MODROOT" "./lib/modules/$KVER"
	depmod -b "$MODROOT" "$KVER" || die "depmod failed"
	rm -rf "$KCACHE/dl"
fi

# 2. the base image as a btrfs send stream (read-only subvolume; sending does not change it)
IMG_PATH=$(cd "$REPO" && .venv/bin/python -c \
	'from bunshin_gym.workspace.images import ImageStore; print(ImageStore().get("base"))') ||
	die "the host has no built base image (bunshin image build base)"
IMAGE=$(basename "$IMG_PATH")
mkdir -p "$BUILD/e2e"
if [ ! -s "$BUILD/e2e/$IMAGE.send" ]; then
	log "btrfs send $IMG_PATH -> $BUILD/e2e/$IMAGE.send"
	rm -f "$BUILD"/e2e/*.send "$BUILD"/e2e/*.json
	btrfs send -q -f "$BUILD/e2e/$IMAGE.send.tmp" "$IMG_PATH" || die "btrfs send failed"
	mv "$BUILD/e2e/$IMAGE.send.tmp" "$BUILD/e2e/$IMAGE.send"
fi
cp "$IMG_PATH.json" "$BUILD/e2e/$IMAGE.json"

# 3. initramfs: busybox, /init, what it needs to reach the 9p root (dependencies first)
R=$BUILD/initramfs-e2e
rm -rf "$R" && mkdir -p "$R"/{bin,dev,proc,sys,modules}
cp /bin/busybox "$R/bin/busybox"
cp "$HERE/tests/e2e-init.sh" "$R/init"
chmod 755 "$R/init"
declare -A seen=()
order=()
add_mod() {  # $1: path relative to $MODDIR, as in modules.dep
	[ -n "${seen[$1]:-}" ] && return
	local d
	for d in $(grep "^$1:" "$MODDIR/modules.dep" | cut -d: -f2); do add_mod "$d"; done
	seen[$1]=1
	order+=("$1")
}
for m in virtio_pci 9pnet_virtio 9p overlay; do
	rel=$(grep -E "/$m\.ko:" "$MODDIR/modules.dep" | cut -d: -f1)
	[ -n "$rel" ] || die "module $m not in $MODDIR/modules.dep"
	add_mod "$rel"
done
: > "$R/modules.list"
for rel in "${order[@]}"; do
	cp "$MODDIR/$rel" "$R/modules/"
	basename "$rel" >> "$R/modules.list"
done
cat > "$R/e2e.env" <<EOF
E2E_REPO=$REPO
E2E_KVER=$KVER
E2E_MODROOT=$MODROOT
E2E_BUILD=$BUILD
E2E_IMAGE=$IMAGE
E2E_PYTEST="$E2E_PYTEST"
E2E_MEMORY=$E2E_MEMORY
EOF
( cd "$R" && find . | cpio -o -H newc --quiet ) | gzip -1 > "$BUILD/initramfs-e2e.cpio.gz"

# 4. the VM's pool disk: a fresh sparse file (the VM runs mkfs.btrfs on it)
rm -f "$POOL_IMG"
truncate -s "$POOL_SIZE" "$POOL_IMG"

LOG=$BUILD/serial-e2e.log
log "booting (e2e, $E2E_MEM, timeout ${E2E_TIMEOUT}s, serial log $LOG); pytest $E2E_PYTEST"
set +e
start=$(date +%s)
# tee: progress on the terminal while the log is written (tr line-buffered)
$NICE timeout --kill-after=10 "$E2E_TIMEOUT" qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m "$E2E_MEM" \
	-display none -monitor none -serial stdio -no-reboot \
	-kernel "$KCACHE/vmlinuz" -initrd "$BUILD/initramfs-e2e.cpio.gz" \
	-virtfs "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap" \
	-drive "file=$POOL_IMG,if=virtio,format=raw,cache=unsafe,discard=unmap" \
	-append "console=ttyS0 oops=panic panic=-1 transparent_hugepage=madvise" \
	</dev/null 2>&1 | stdbuf -oL tr -d '\r' | tee "$LOG" | grep --line-buffered -E "^(== |BUNSHIN_KMOD_RESULT|E2E_)|::.* (PASSED|FAILED|ERROR|SKIPPED)" >&2
qrc=${PIPESTATUS[0]}
set -e
log "VM ran $(($(date +%s) - start)) s (qemu exit $qrc)"
[ "${BUNSHIN_KMOD_KEEP_POOL:-0}" = 1 ] || rm -f "$POOL_IMG"

grep -E "^E2E_MEMORY_JSON " "$LOG" | tail -1 | sed 's/^E2E_MEMORY_JSON //' > "$BUILD/e2e.json" || true
[ -s "$BUILD/e2e.json" ] || rm -f "$BUILD/e2e.json"
sed -n '/^E2E_MEMORY_TABLE/,/^E2E_MEMORY_END/p' "$LOG" >&2
grep -E "^(PASSED|FAILED|ERROR|SKIPPED) |^=+ .*(passed|failed|error).* =+$" "$LOG" >&2 || true
if grep -q "BUNSHIN_KMOD_RESULT: PASS" "$LOG"; then
	log "e2e: PASS"
	return 0
fi
if grep -q "BUNSHIN_KMOD_RESULT: FAIL" "$LOG"; then
	log "e2e: FAIL; serial tail:"
else
	log "e2e: FAIL: no result marker (qemu exit $qrc: timeout, panic or hang); serial tail:"
fi
tail -n 80 "$LOG" >&2
return 1
