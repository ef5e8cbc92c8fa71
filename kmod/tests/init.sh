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

if ! rmmod bunshin_share; then
	echo "== rmmod failed"
	rc=1
fi
dmesg > /tmp/dmesg
echo "== kernel messages after insmod:"
cat /tmp/dmesg
if grep -E -q "WARNING:|BUG:|Oops|general protection|Call Trace|Bad page|bad page|list_del corruption|list_add corruption|refcount_t:|Bad rss|rss-counter|kernel BUG|Poison overwritten|Redzone|Object padding|slab_out_of_bounds|use-after-free" /tmp/dmesg; then
	echo "== kernel warning/bug logged after insmod"
	rc=1
fi
[ "$rc" = 0 ] && result=PASS
finish
