#!/bin/bash
# Build bunshin_share.ko against Debian bookworm's 6.1 kernel headers and test
# it in a qemu VM booting that kernel (the host kernel cannot load modules).
#
#   vmtest.sh build    install what is missing, build module + test program
#   vmtest.sh test     build, boot, run the functional tests (exit 1 on failure)
#   vmtest.sh bench    build, boot, time sharing vs copying (BUNSHIN_KMOD_MIB, default 1024)
#   vmtest.sh e2e      build, boot with the host's root file system (virtio-9p, read-only,
#                      overlay) and run the workspace "kmod" memory mode for real: real module,
#                      real CRIU, real workspaces (tests/workspace/test_kmod_e2e.py + a kmod/copy
#                      memory comparison written to build/e2e.json)
#
# Idempotent and cached: packages are installed once, the kernel image is
# fetched once into $BUNSHIN_KMOD_CACHE, builds are incremental.
set -euo pipefail

MODE=${1:-test}
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD=${BUNSHIN_KMOD_BUILD:-$HERE/build}
CACHE=${BUNSHIN_KMOD_CACHE:-/var/cache/bunshin-kmod}
MIB=${BUNSHIN_KMOD_MIB:-1024}
MEM=${BUNSHIN_KMOD_VM_MEM:-3584M}
NICE="nice -n 10"

log() { echo "[kmod] $*" >&2; }
die() { echo "[kmod] ERROR: $*" >&2; exit 1; }

apt_updated=0
apt_update_once() {
	if [ "$apt_updated" = 0 ]; then
		log "apt-get update"
		apt-get update -qq >/dev/null
		apt_updated=1
	fi
}

need_pkgs() {
	local missing=()
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
	done
	if [ ${#missing[@]} -gt 0 ]; then
		apt_update_once
		log "installing ${missing[*]}"
		DEBIAN_FRONTEND=noninteractive $NICE apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
	fi
}

# Kernel flavour: BUNSHIN_KMOD_KVER, else the newest installed bookworm 6.1
# amd64 headers, else the newest such headers package apt knows.
pick_kver() {
	if [ -n "${BUNSHIN_KMOD_KVER:-}" ]; then echo "$BUNSHIN_KMOD_KVER"; return; fi
	local k
	k=$(ls -d /usr/src/linux-headers-6.1.0-*-amd64 2>/dev/null | sed 's|.*/linux-headers-||' | sort -V | tail -1)
	if [ -z "$k" ]; then
		k=$(apt-cache search --names-only '^linux-headers-6\.1\.0-[0-9]+-amd64$' 2>/dev/null | awk '{print $1}' | sed 's/^linux-headers-//' | sort -V | tail -1)
		if [ -z "$k" ]; then
			apt_update_once
			k=$(apt-cache search --names-only '^linux-headers-6\.1\.0-[0-9]+-amd64$' | awk '{print $1}' | sed 's/^linux-headers-//' | sort -V | tail -1)
		fi
	fi
	[ -n "$k" ] || die "no linux-headers-6.1.0-*-amd64 package found (Debian bookworm apt source needed)"
	echo "$k"
}

need_pkgs make gcc libc6-dev qemu-system-x86 busybox-static cpio gzip
KVER=$(pick_kver)
need_pkgs "linux-headers-$KVER"
KDIR=/usr/src/linux-headers-$KVER
[ -f "$KDIR/Makefile" ] || die "$KDIR missing"
log "kernel $KVER"

# The kernel image: downloaded and unpacked, never installed (installing it
# would pull initramfs-tools and touch the host's boot setup).
KCACHE=$CACHE/$KVER
# kernel_deb NOTE: download linux-image-$KVER-unsigned of exactly the headers' version into
# $KCACHE/dl and print its path; NOTE ends the log line (the caller removes $KCACHE/dl).
kernel_deb() {
	local ver deb
	mkdir -p "$KCACHE/dl"
	ver=$(dpkg-query -W -f='${Version}' "linux-headers-$KVER")
	log "fetching linux-image-$KVER-unsigned=$ver$1"
	apt_update_once
	( cd "$KCACHE/dl" && rm -f ./*.deb &&
	  apt-get download "linux-image-$KVER-unsigned=$ver" 2>&1 | grep -v "unsandboxed" >&2 || true )
	deb=$(ls "$KCACHE"/dl/linux-image-*.deb 2>/dev/null | head -1)
	[ -n "$deb" ] || die "download of linux-image-$KVER-unsigned failed"
	echo "$deb"
}

if [ ! -f "$KCACHE/vmlinuz" ] || [ ! -f "$KCACHE/zram.ko" ]; then
	deb=$(kernel_deb "")
	rm -rf "$KCACHE/x" && mkdir -p "$KCACHE/x"
	dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$KCACHE/x" "./boot/vmlinuz-$KVER" \
		"./lib/modules/$KVER/kernel/drivers/block/zram/zram.ko" \
		"./lib/modules/$KVER/kernel/mm/zsmalloc.ko" "./boot/config-$KVER"
	cp "$KCACHE/x/boot/config-$KVER" "$KCACHE/config"
	cp "$KCACHE/x/lib/modules/$KVER/kernel/drivers/block/zram/zram.ko" "$KCACHE/zram.ko"
	cp "$KCACHE/x/lib/modules/$KVER/kernel/mm/zsmalloc.ko" "$KCACHE/zsmalloc.ko"
	cp "$KCACHE/x/boot/vmlinuz-$KVER" "$KCACHE/vmlinuz"
	rm -rf "$KCACHE/x" "$KCACHE/dl"
fi

# Module: built out of tree in build/mod (sources copied with their mtimes,
# so make stays incremental).
mkdir -p "$BUILD/mod"
cp -p "$HERE/bunshin_share.c" "$HERE/bunshin_share.h" "$HERE/Kbuild" "$BUILD/mod/"
log "building module"
$NICE make -s -C "$KDIR" M="$BUILD/mod" modules >"$BUILD/module-build.log" 2>&1 ||
	{ cat "$BUILD/module-build.log" >&2; die "module build failed"; }
if grep -E "warning:" "$BUILD/module-build.log" >&2; then die "module build warnings"; fi

if [ ! -x "$BUILD/kmodtest" ] || [ "$HERE/tests/kmodtest.c" -nt "$BUILD/kmodtest" ] ||
   [ "$HERE/bunshin_share.h" -nt "$BUILD/kmodtest" ]; then
	log "building static test program"
	$NICE gcc -static -O2 -Wall -Wextra -Werror -Wno-unused-parameter -I"$HERE" \
		-o "$BUILD/kmodtest" "$HERE/tests/kmodtest.c"
fi
[ "$MODE" = build ] && { log "built $BUILD/mod/bunshin_share.ko"; exit 0; }
[ "$MODE" = e2e ] && { . "$HERE/e2e.sh"; exit $?; }

# initramfs: busybox, /init, the modules, the test program.
R=$BUILD/initramfs
rm -rf "$R" && mkdir -p "$R"/{bin,dev,proc,sys,tmp}
cp /bin/busybox "$R/bin/busybox"
cp "$HERE/tests/init.sh" "$R/init"
cp "$HERE/tests/kernel-log.sh" "$R/kernel-log.sh"
chmod 755 "$R/init"
cp "$BUILD/mod/bunshin_share.ko" "$KCACHE/zram.ko" "$KCACHE/zsmalloc.ko" "$BUILD/kmodtest" "$R/"
( cd "$R" && find . | cpio -o -H newc --quiet ) | gzip -1 > "$BUILD/initramfs.cpio.gz"

case "$MODE" in
test) TIMEOUT=${BUNSHIN_KMOD_TIMEOUT:-900}; EXTRA="slub_debug=FZPU" ;;
bench) TIMEOUT=${BUNSHIN_KMOD_TIMEOUT:-1500}; EXTRA="bunshin.mib=$MIB" ;;
*) die "unknown mode $MODE (build|test|bench)" ;;
esac
LOG=$BUILD/serial-$MODE.log
# TCG, not KVM: /dev/kvm on the development host hangs.  No `quiet` (it hides
# WARN_ON); any oops panics and -no-reboot ends qemu; the host-side timeout
# catches hangs; a missing result marker is a failure.
log "booting ($MODE, timeout ${TIMEOUT}s, serial log $LOG)"
set +e
# Two NUMA nodes, so that the tests can migrate shared pages (the rmap must
# find every mapping of a page to move it).
# The benchmark runs on one node (1 GiB of THP must fit in one node).
MEMMB=$(( ${MEM%M} / 2 ))
NUMA=(-object "memory-backend-ram,id=m0,size=${MEMMB}M" -object "memory-backend-ram,id=m1,size=${MEMMB}M"
      -numa node,nodeid=0,cpus=0,memdev=m0 -numa node,nodeid=1,cpus=1,memdev=m1)
[ "$MODE" = bench ] && NUMA=()
$NICE timeout --kill-after=10 "$TIMEOUT" qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m "$MEM" "${NUMA[@]}" \
	-display none -monitor none -serial stdio -no-reboot \
	-kernel "$KCACHE/vmlinuz" -initrd "$BUILD/initramfs.cpio.gz" \
	-append "console=ttyS0 oops=panic panic=-1 transparent_hugepage=madvise $EXTRA bunshin.mode=$MODE" \
	</dev/null >"$LOG" 2>&1
qrc=$?
set -e
tr -d '\r' <"$LOG" >"$LOG.txt" && mv "$LOG.txt" "$LOG"

if [ "$MODE" = test ]; then
	grep -E "^(TEST|  check failed|  D smaps|  S AnonHuge|  D AnonHuge|  KSM|  [0-9]+ of|  pages_mapped|  [a-zA-Z].* -> |summary:|== )" "$LOG" || true
else
	sed -n '/^BENCH /,/^BENCH_JSON/p' "$LOG"
	grep '^BENCH_JSON ' "$LOG" | sed 's/^BENCH_JSON //' > "$BUILD/bench.json" || true
fi
if grep -q "BUNSHIN_KMOD_RESULT: PASS" "$LOG"; then
	log "$MODE: PASS (qemu exit $qrc)"
	exit 0
fi
if grep -q "BUNSHIN_KMOD_RESULT: FAIL" "$LOG"; then
	log "$MODE: FAIL; kernel log tail:"
else
	log "$MODE: FAIL: no result marker (qemu exit $qrc: timeout, panic or hang); serial tail:"
fi
tail -n 60 "$LOG" >&2
exit 1
