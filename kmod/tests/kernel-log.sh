# Sourced by both VMs' init scripts (busybox sh and bash): unload the module and judge the
# kernel log written since insmod (the log is cleared before it). Sets rc=1 on any failure.
rmmod_and_check_kernel_log() {
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
}
