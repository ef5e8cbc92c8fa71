#!/bin/busybox sh
# /init of the bunshin_share test VM: load the module, run kmodtest, judge the
# kernel log written after insmod, print a result marker on the serial console.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp

mode=test
mib=256
for w in $(cat /proc/cmdline); do
	case "$w" in
	bunshin.mode=*) mode=${w#bunshin.mode=} ;;
	bunshin.mib=*) mib=${w#bunshin.mib=} ;;
	esac
done
echo "== bunshin kmod VM: kernel $(uname -r), mode $mode, $(grep MemTotal /proc/meminfo)"

result=FAIL
finish() {
	echo "BUNSHIN_KMOD_RESULT: $result"
	sync
	poweroff -f
	sleep 5
}

# swap on zram, for the swap-entry test (loaded before the module under test)
if insmod /zsmalloc.ko && insmod /zram.ko num_devices=1 &&
   echo 128M > /sys/block/zram0/disksize && mkswap /dev/zram0 >/dev/null &&
   swapon /dev/zram0; then
	touch /tmp/swap_on
else
	echo "== no zram swap"
fi
dd if=/dev/zero of=/testfile bs=4096 count=4 2>/dev/null

dmesg -c >/dev/null	# judge only what the kernel logs from here on
if ! insmod /bunshin_share.ko; then
	echo "== insmod failed"
	dmesg
	finish
fi
if [ ! -c /dev/bunshin_share ]; then
	echo "== /dev/bunshin_share missing"
	finish
fi

if [ "$mode" = bench ]; then
	/kmodtest bench "$mib"
else
	/kmodtest test
fi
rc=$?

. /kernel-log.sh
rmmod_and_check_kernel_log
[ "$rc" = 0 ] && result=PASS
finish
