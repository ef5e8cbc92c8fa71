// Attacks on the workspace's seccomp filter, run inside a workspace; prints NAME=RESULT lines
// (RESULT: ok, or the errno name). Built static on the host by the test.
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void report(const char *name, long ret)
{
	printf("%s=%s\n", name, ret < 0 ? strerrorname_np(errno) : "ok");
}

int main(void)
{
	long ret;

	/* i386 io_uring_setup (425) through int 0x80: another architecture's numbers */
	__asm__ volatile("int $0x80" : "=a"(ret) : "a"(425), "b"(1), "c"(0) : "memory");
	printf("i386_io_uring_setup=%s\n", ret == -ENOSYS ? "ENOSYS" : ret == -EFAULT ? "EFAULT" : "other");
	/* i386 getpid (20): any syscall of another architecture is refused */
	__asm__ volatile("int $0x80" : "=a"(ret) : "a"(20) : "memory");
	printf("i386_getpid=%s\n", ret == -ENOSYS ? "ENOSYS" : ret > 0 ? "ok" : "other");
	/* the x32 ABI: getpid with __X32_SYSCALL_BIT */
	report("x32_getpid", syscall(0x40000000 | SYS_getpid));
	report("io_uring_setup", syscall(SYS_io_uring_setup, 1, NULL));
	report("init_module", syscall(SYS_init_module, NULL, 0, ""));
	report("finit_module", syscall(SYS_finit_module, -1, "", 0));
	report("kexec_load", syscall(SYS_kexec_load, 0, 0, NULL, 0));
	report("open_by_handle_at", syscall(SYS_open_by_handle_at, -1, NULL, 0));
	report("keyctl", syscall(SYS_keyctl, 0, 0, 0, 0, 0));
	report("add_key", syscall(SYS_add_key, "user", "x", "y", 1, -1));
	report("bpf", syscall(SYS_bpf, 0, NULL, 0));
	report("userfaultfd", syscall(SYS_userfaultfd, 0));
	report("unshare_user", syscall(SYS_unshare, CLONE_NEWUSER));
	report("unshare_mnt", syscall(SYS_unshare, CLONE_NEWNS));
	report("mount", syscall(SYS_mount, "none", "/tmp", "tmpfs", 0, NULL));
	report("fsopen", syscall(SYS_fsopen, "tmpfs", 0));
	report("pkey_alloc", syscall(SYS_pkey_alloc, 0, 0));
	report("inotify_init1", syscall(SYS_inotify_init1, 0));
	report("getpid", syscall(SYS_getpid));
	return 0;
}
