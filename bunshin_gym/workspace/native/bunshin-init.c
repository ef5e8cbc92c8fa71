// SPDX-License-Identifier: Apache-2.0
/*
 * bunshin-init: the launcher and the PID 1 of a bunshin workspace.
 *
 *   bunshin-init launch ROOT LOWERDIRS UPPER WORK SNAPDIR HOSTNAME [CGROUP_PROCS_FILE...]
 *       Joins the given cgroups, creates new mount, pid, net, ipc and uts namespaces and
 *       forks the workspace's PID 1, which mounts overlay(LOWERDIRS, UPPER) on ROOT,
 *       sets up /proc, /sys, /dev, /tmp, /run and a read-only /.snap, pivots into ROOT,
 *       brings lo up, becomes a session leader with no host file descriptors, and execs
 *       /.bunshin/init pid1 from inside the workspace. Prints PID 1's host pid on success;
 *       on failure prints the failing step and exits 1 (nothing is left running).
 *
 *   bunshin-init restore ROOT LOWERDIRS UPPER WORK MERGE [CGROUP_PROCS_FILE...] -- CMD...
 *       Joins the cgroups, enters a private mount namespace, mounts overlay(LOWERDIRS, UPPER)
 *       on ROOT and execs CMD (criu restore --root ROOT ...). The overlay exists only in this
 *       short-lived namespace and in the one CRIU builds from it: nothing appears on the host.
 *       MERGE=1 sets PR_SET_MEMORY_MERGE first, so every restored process is KSM-mergeable.
 *
 *   /.bunshin/init pid1
 *       The workspace's init: installs the workspace seccomp filter for the whole tree,
 *       starts the in-workspace agent (restarting it if it dies) and reaps orphans.
 *
 *   /.bunshin/init runas UID GID ERRFD CMD...
 *       Becomes UID:GID and execs CMD: how the agent starts a command as a user (see runas()).
 *
 * It is C rather than Python because it runs on every workspace start (a couple of
 * milliseconds instead of an interpreter start) and because PID 1 must stay tiny: it is
 * dumped and restored with every snapshot.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <linux/securebits.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <grp.h>
#include <unistd.h>

#define AGENT_PYTHON "/usr/bin/python3"
/* tmpfs sizes: upper bounds (tmpfs allocates on write), charged to the workspace's memory cgroup */
#define SHM_SIZE "1g"
#define TMP_SIZE "2g"
#define RUN_SIZE "256m"
#define AGENT_SCRIPT "/.bunshin/agent.py"

static int err_fd = -1; /* error pipe to the launcher; close-on-exec */

static void fail(const char *fmt, ...)
{
	char buf[512];
	int n, saved = errno;
	va_list ap;

	va_start(ap, fmt);
	n = vsnprintf(buf, sizeof(buf) - 64, fmt, ap);
	va_end(ap);
	n += snprintf(buf + n, sizeof(buf) - n, ": %s", strerror(saved));
	if (err_fd >= 0 && write(err_fd, buf, n) < 0)
		_exit(2);
	if (err_fd < 0)
		fprintf(stderr, "bunshin-init: %s\n", buf);
	_exit(1);
}

static void join_cgroup(const char *procs_file)
{
	char pid[32];
	int fd = open(procs_file, O_WRONLY | O_CLOEXEC);
	int n = snprintf(pid, sizeof(pid), "%d\n", getpid());

	if (fd < 0 || write(fd, pid, n) != n)
		fail("joining cgroup %s", procs_file);
	close(fd);
}

static void mountx(const char *src, const char *dst, const char *type, unsigned long flags,
		   const char *data)
{
	if (mount(src, dst, type, flags, data))
		fail("mount %s on %s (%s)", src, dst, type ? type : "bind");
}

static void mkdirx(const char *path, mode_t mode)
{
	if (mkdir(path, mode) && errno != EEXIST)
		fail("mkdir %s", path);
}

static void mknodx(const char *path, int major, int minor)
{
	if (mknod(path, S_IFCHR | 0666, makedev(major, minor)))
		fail("mknod %s", path);
	chmod(path, 0666); /* undo the umask */
}

static void symlinkx(const char *target, const char *path)
{
	if (symlink(target, path))
		fail("symlink %s", path);
}

/*
 * What runc masks and makes read-only by default: files that expose or change the host
 * kernel (kcore, sysrq-trigger, keys, timer_list, sysctls, firmware). Masked files are
 * overmounted by an empty file, masked directories by an empty read-only directory; read-only ones
 * by a read-only bind of themselves. Workspace root holds no CAP_SYS_ADMIN, so none of these
 * mounts can be undone from inside.
 */
static const char *const masked_paths[] = {
	"/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
	"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
	"/proc/kallsyms", "/proc/kmsg", "/proc/kpagecount", "/proc/kpageflags", "/proc/kpagecgroup",
	"/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel/debug", "/sys/kernel/security",
};
static const char *const readonly_paths[] = {
	"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
};

static void mask_kernel_files(const char *root)
{
	char p[4096], empty[4096], empty_dir[4096];
	struct stat st;
	int fd;

	/* masked files are overmounted by an empty read-only file, masked directories by an empty
	 * directory, both of the workspace's own /dev tmpfs: binds CRIU dumps and restores as
	 * binds (a bind of the host's /dev/null would be one more external mount per file; a tmpfs
	 * of its own is one more tar that every dump runs frozen and every restore runs again,
	 * ~3-6 ms each). Both are made read-only where they are too, so that root inside cannot
	 * fill what they mask through /dev either. */
	snprintf(empty, sizeof(empty), "%s/dev/.masked", root);
	fd = open(empty, O_CREAT | O_WRONLY | O_CLOEXEC, 0444);
	if (fd < 0)
		fail("creating %s", empty);
	close(fd);
	snprintf(empty_dir, sizeof(empty_dir), "%s/dev/.masked-dir", root);
	mkdirx(empty_dir, 0555);
	for (const char *const *q = (const char *const[]){ empty, empty_dir, NULL }; *q; q++) {
		mountx(*q, *q, NULL, MS_BIND, NULL);
		mountx(NULL, *q, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	}
	for (size_t i = 0; i < sizeof(masked_paths) / sizeof(masked_paths[0]); i++) {
		snprintf(p, sizeof(p), "%s%s", root, masked_paths[i]);
		if (lstat(p, &st))
			continue; /* not on this kernel */
		mountx(S_ISDIR(st.st_mode) ? empty_dir : empty, p, NULL, MS_BIND, NULL);
		mountx(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	}
	for (size_t i = 0; i < sizeof(readonly_paths) / sizeof(readonly_paths[0]); i++) {
		snprintf(p, sizeof(p), "%s%s", root, readonly_paths[i]);
		if (lstat(p, &st))
			continue;
		mountx(p, p, NULL, MS_BIND | MS_REC, NULL);
		mountx(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	}
}

/* Host-privileged part, in the launcher's private mount namespace (init user namespace):
 * the overlay root and the read-only /.snap view. Mounts made here are locked once the
 * workspace's user namespace copies them: root inside can neither unmount nor remount them. */
static void setup_host_mounts(const char *root, const char *lower, const char *upper, const char *work,
			      const char *snap)
{
	char opts[4096], p[4096];

	mountx("none", "/", NULL, MS_REC | MS_PRIVATE, NULL);
	if (snprintf(opts, sizeof(opts), "lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work) >=
	    (int)sizeof(opts))
		fail("overlay options too long");
	/* nodev: device nodes work only on the workspace's own minimal /dev */
	mountx("overlay", root, "overlay", MS_NODEV, opts);
	/* the page images this workspace's restores map (empty for a fresh workspace; a clone
	 * gets its own snapshot chain's view, see snapview.py), never the store itself.
	 * Not noexec: clones map executable pages of their images from here. */
	snprintf(p, sizeof(p), "%s/.snap", root);
	mkdirx(p, 0755);
	mountx(snap, p, NULL, MS_BIND, NULL);
	mountx(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL);
}

/* Device nodes: made with mknod by host root, or, inside a user namespace (where mknod of a
 * device is refused), bind mounts of the host's own nodes (snapshot.py names these mounts
 * external for CRIU). */
static const struct { const char *name; int major, minor; } devs[] = {
	{ "null", 1, 3 }, { "zero", 1, 5 }, { "full", 1, 7 },
	{ "random", 1, 8 }, { "urandom", 1, 9 }, { "tty", 5, 0 },
};

/* Everything below runs inside the new namespaces, as PID 1, before the pivot. */
static void setup_root(const char *root, const char *hostname, int in_userns)
{
	char p[4096];

	/* the overlay as a mount of this namespace: pivot_root refuses a locked put_old, and the
	 * root the user namespace copied from the launcher's is locked (/.snap below it stays so) */
	if (in_userns)
		mountx(root, root, NULL, MS_BIND | MS_REC, NULL);
#define AT(sub) (snprintf(p, sizeof(p), "%s%s", root, sub), p)
	mkdirx(AT("/proc"), 0555);
	mountx("proc", AT("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	mkdirx(AT("/sys"), 0555);
	mountx("sysfs", AT("/sys"), "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	mkdirx(AT("/dev"), 0755);
	mountx("tmpfs", AT("/dev"), "tmpfs", MS_NOSUID, "mode=755,size=65536k");
	for (size_t i = 0; i < sizeof(devs) / sizeof(devs[0]); i++) {
		char dev[64], host[64];

		snprintf(dev, sizeof(dev), "/dev/%s", devs[i].name);
		if (!in_userns) {
			mknodx(AT(dev), devs[i].major, devs[i].minor);
			continue;
		}
		int fd = open(AT(dev), O_CREAT | O_WRONLY | O_CLOEXEC, 0666);

		if (fd < 0)
			fail("creating %s", p);
		close(fd);
		snprintf(host, sizeof(host), "/dev/%s", devs[i].name);
		mountx(host, AT(dev), NULL, MS_BIND, NULL);
	}
	symlinkx("/proc/self/fd", AT("/dev/fd"));
	symlinkx("/proc/self/fd/0", AT("/dev/stdin"));
	symlinkx("/proc/self/fd/1", AT("/dev/stdout"));
	symlinkx("/proc/self/fd/2", AT("/dev/stderr"));
	symlinkx("pts/ptmx", AT("/dev/ptmx"));
	mkdirx(AT("/dev/pts"), 0755);
	mountx("devpts", AT("/dev/pts"), "devpts", MS_NOSUID | MS_NOEXEC,
	       "newinstance,ptmxmode=0666,mode=0620,gid=5");
	/* sized: a workspace filling its tmpfs must hit ENOSPC, not the host's memory */
	mkdirx(AT("/dev/shm"), 01777);
	mountx("shm", AT("/dev/shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=" SHM_SIZE);
	mkdirx(AT("/tmp"), 01777);
	mountx("tmpfs", AT("/tmp"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=" TMP_SIZE);
	mkdirx(AT("/run"), 0755);
	mountx("tmpfs", AT("/run"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=" RUN_SIZE);
	mkdirx(AT("/run/bunshin"), 0700);
	mask_kernel_files(root);
#undef AT

	if (chdir(root))
		fail("chdir %s", root);
	if (syscall(SYS_pivot_root, ".", "."))
		fail("pivot_root %s", root);
	if (umount2(".", MNT_DETACH))
		fail("detaching the host root");
	if (chdir("/"))
		fail("chdir /");
	if (sethostname(hostname, strlen(hostname)))
		fail("sethostname");

	{ /* lo up; nothing else exists in the new network namespace */
		struct ifreq ifr = { 0 };
		int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);

		strcpy(ifr.ifr_name, "lo");
		if (s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr))
			fail("reading lo flags");
		ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
		if (ioctl(s, SIOCSIFFLAGS, &ifr))
			fail("bringing lo up");
		close(s);
	}
}

/*
 * The owner of a workspace's user namespace, outside. The kernel charges what a namespace's
 * users hold of some per-user accounts (pending signals, POSIX message-queue bytes, SHM_LOCK-ed
 * memory) to its owner too, capped by the owner's limits when it was made (kernel/ucount.c,
 * inc_rlimit_ucounts). Made by host root, every workspace shared root's account with all the
 * others: one that queued its allowance of signals left each sibling's sigqueue() failing.
 * Each namespace is therefore made under an owner uid of its own, derived from the workspace's
 * cgroup (unique among live ones; OWNER_BASE is far above the workspaces' id ranges and runs
 * nothing on the host). Only the effective uid changes, for the unshare, capabilities kept.
 */
#define OWNER_BASE 0x40000000u
#define OWNER_SPAN 0x3fffffffu

static uid_t namespace_owner(const char *procs_file)
{
	char dir[4096];
	char *slash;
	struct stat st;

	if (snprintf(dir, sizeof(dir), "%s", procs_file) >= (int)sizeof(dir) || !(slash = strrchr(dir, '/')))
		fail("cgroup procs file %s", procs_file);
	*slash = 0;
	if (stat(dir, &st))
		fail("stat %s", dir);
	return OWNER_BASE + (uid_t)(st.st_ino % OWNER_SPAN);
}

static void unshare_user_as(uid_t owner)
{
	int bits = prctl(PR_GET_SECUREBITS);

	if (bits < 0 || prctl(PR_SET_SECUREBITS, bits | SECBIT_NO_SETUID_FIXUP))
		fail("PR_SET_SECUREBITS");
	if (setresuid(-1, owner, -1))
		fail("becoming the namespace's owner %u", owner);
	if (unshare(CLONE_NEWUSER))
		fail("unshare(CLONE_NEWUSER)");
	/* inherited by every process of the workspace: back as they were (CAP_SETPCAP is ours in
	 * the new namespace) */
	if (prctl(PR_SET_SECUREBITS, bits))
		fail("PR_SET_SECUREBITS");
}

static int restore(int argc, char **argv)
{
	char opts[4096];
	int sep = 0;

	for (int i = 2; i < argc; i++)
		if (!strcmp(argv[i], "--")) {
			sep = i;
			break;
		}
	if (argc < 8 || sep < 7 || sep == argc - 1) {
		fprintf(stderr, "usage: bunshin-init restore ROOT LOWERDIRS UPPER WORK MERGE "
				"[CGROUP_PROCS_FILE...] -- CMD...\n");
		return 2;
	}
	for (int i = 7; i < sep; i++)
		join_cgroup(argv[i]);
	/* a cgroup namespace rooted at the clone's own cgroups, inherited by what CRIU restores
	 * (with --manage-cgroups=ignore CRIU makes none) */
	if (unshare(CLONE_NEWNS | CLONE_NEWCGROUP))
		fail("unshare");
	mountx("none", "/", NULL, MS_REC | MS_PRIVATE, NULL);
	if (snprintf(opts, sizeof(opts), "lowerdir=%s,upperdir=%s,workdir=%s", argv[3], argv[4],
		     argv[5]) >= (int)sizeof(opts))
		fail("overlay options too long");
	mountx("overlay", argv[2], "overlay", MS_NODEV, opts);
	if (!strcmp(argv[6], "1") && prctl(67 /* PR_SET_MEMORY_MERGE */, 1, 0, 0, 0))
		fail("PR_SET_MEMORY_MERGE");
	/* CRIU makes the clone's user namespace (criu/patches/0019): under an owner of its own */
	if (sep > 7) {
		char owner[16];

		snprintf(owner, sizeof(owner), "%u", namespace_owner(argv[7]));
		if (setenv("CRIU_USERNS_OWNER", owner, 1))
			fail("setenv");
	}
	execv(argv[sep + 1], argv + sep + 1);
	fail("exec %s", argv[sep + 1]);
	return 1;
}

/* No descriptor of the host may survive into the workspace (CRIU could not dump it). */
static void own_stdio(void)
{
	int null = open("/dev/null", O_RDWR);
	int log = open("/run/bunshin/init.log", O_WRONLY | O_CREAT | O_APPEND, 0600);

	if (null < 0 || log < 0)
		fail("opening /dev/null and /run/bunshin/init.log");
	if (dup2(null, 0) < 0 || dup2(log, 1) < 0 || dup2(log, 2) < 0)
		fail("dup2");
	if (syscall(SYS_close_range, 3, err_fd - 1, 0) ||
	    syscall(SYS_close_range, err_fd + 1, ~0U, 0))
		fail("close_range");
}

static void write_file(const char *path, const char *text)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	ssize_t n = (ssize_t)strlen(text);

	if (fd < 0 || write(fd, text, n) != n)
		fail("writing %s", path);
	close(fd);
}

static void wait_byte(int fd, const char *what)
{
	char c;

	if (read(fd, &c, 1) != 1)
		fail("waiting for %s", what);
}

/* The workspace's PID 1 before its exec: mounts inside the namespaces, then init. */
static void become_pid1(char **argv, int in_userns)
{
	char *const init_argv[] = { "init", "pid1", NULL };
	char *const envp[] = { "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", NULL };

	prctl(PR_SET_PDEATHSIG, 0);
	setup_root(argv[2], argv[7], in_userns);
	own_stdio();
	if (setsid() < 0)
		fail("setsid");
	execve("/.bunshin/init", init_argv, envp);
	fail("exec /.bunshin/init");
}

/*
 * IDMAP "-": namespaces in the host's user namespace (root inside is host root, contained by
 * capabilities, seccomp and mounts only). IDMAP "BASE:COUNT": a user namespace whose root is
 * host uid/gid BASE (the image's files are shifted by BASE, see images.py), created by a
 * helper child; the launcher writes its maps, then the helper makes the other namespaces
 * (owned by the user namespace) and forks PID 1.
 */
static int launch(int argc, char **argv)
{
	int errp[2], up[2], down[2], pidp[2];
	unsigned long base = 0, count = 0;
	int userns;
	pid_t helper, pid1 = -1;
	const int flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP;

	if (argc < 9) {
		fprintf(stderr, "usage: bunshin-init launch ROOT LOWERDIRS UPPER WORK SNAPDIR HOSTNAME IDMAP "
				"[CGROUP_PROCS_FILE...]\n");
		return 2;
	}
	userns = strcmp(argv[8], "-") != 0;
	if (userns && (sscanf(argv[8], "%lu:%lu", &base, &count) != 2 || !count)) {
		fprintf(stderr, "bunshin-init: IDMAP must be - or BASE:COUNT, not %s\n", argv[8]);
		return 2;
	}
	for (int i = 9; i < argc; i++)
		join_cgroup(argv[i]);
	if (pipe2(errp, O_CLOEXEC) || pipe2(up, O_CLOEXEC) || pipe2(down, O_CLOEXEC) || pipe2(pidp, O_CLOEXEC))
		fail("pipe2");
	if (unshare(CLONE_NEWNS))
		fail("unshare");
	setup_host_mounts(argv[2], argv[3], argv[4], argv[5], argv[6]);
	helper = fork();
	if (helper < 0)
		fail("fork");
	if (helper == 0) {
		pid_t pid;

		err_fd = errp[1];
		if (userns) {
			unshare_user_as(argc > 9 ? namespace_owner(argv[9]) : 0);
			if (write(up[1], "u", 1) != 1)
				fail("signalling the launcher");
			wait_byte(down[0], "the id maps");
			if (setresgid(0, 0, 0) || setgroups(0, NULL) || setresuid(0, 0, 0))
				fail("becoming root of the user namespace");
		}
		if (unshare(flags))
			fail("unshare");
		pid = fork();
		if (pid < 0)
			fail("fork");
		if (pid == 0)
			become_pid1(argv, userns);
		if (write(pidp[1], &pid, sizeof(pid)) != sizeof(pid))
			fail("reporting PID 1");
		_exit(0);
	}
	close(errp[1]);
	close(up[1]);
	close(down[0]);
	close(pidp[1]);
	if (userns) {
		char path[64], map[64];
		char c;

		if (read(up[0], &c, 1) != 1)
			goto failed;
		snprintf(map, sizeof(map), "0 %lu %lu\n", base, count);
		snprintf(path, sizeof(path), "/proc/%d/uid_map", helper);
		write_file(path, map);
		snprintf(path, sizeof(path), "/proc/%d/gid_map", helper);
		write_file(path, map);
		if (write(down[1], "m", 1) != 1)
			fail("signalling the helper");
	}
	if (read(pidp[0], &pid1, sizeof(pid1)) != sizeof(pid1))
		pid1 = -1;
failed:
	waitpid(helper, NULL, 0);
	{
		char msg[512];
		ssize_t n = read(errp[0], msg, sizeof(msg) - 1);

		if (n > 0 || pid1 < 0) {
			msg[n > 0 ? n : 0] = 0;
			fprintf(stderr, "bunshin-init: workspace setup failed: %s\n", n > 0 ? msg : "no PID 1");
			return 1;
		}
	}
	printf("%d\n", pid1);
	return 0;
}

/*
 * Workspace-wide seccomp filter, inherited by every process and kept by CRIU:
 * - any architecture but x86_64, and the x32 ABI, is refused (ENOSYS): an i386 `int 0x80`
 *   would otherwise reach syscalls under other numbers than the ones filtered here;
 * - io_uring_setup fails with ENOSYS: CRIU cannot dump io_uring; libuv/node fall back to epoll;
 * - pkey_alloc fails with ENOSYS, as on a CPU without protection keys: CRIU restores neither
 *   allocated keys nor the keys of mappings, so a program that set up keys before a dump
 *   (V8 in chromium's zygote does) crashes in a clone when it next uses them (every renderer
 *   forked after a restore crashed: "Target crashed"). V8 falls back to mprotect;
 * - inotify_init/inotify_init1 fail with ENOSYS: CRIU records a watch by the watched inode's
 *   file handle, and handles of the overlay root cannot be opened back, so one watch makes a
 *   workspace unsnapshottable. GLib then polls; chromium and dbus-daemon go without. (The
 *   desktop's session wrapper installed this rule itself; without CAP_SYS_ADMIN it no longer
 *   can without no_new_privs, which would break sudo, so every workspace has it.)
 * - madvise(MADV_FREE) fails with EINVAL, as the kernel answers for file mappings: a clone's
 *   anonymous memory may be served from a page image, where a lazy free would let the
 *   image's stale page reappear. Allocators (jemalloc, glibc) fall back to MADV_DONTNEED;
 * - what container runtimes deny by default fails with EPERM: module loading, kexec,
 *   handle-based opens, the kernel keyring, bpf, perf, userfaultfd, mounts (old and new API),
 *   swap, reboot, clock setting, accounting, quotas, and new user namespaces (unshare or clone
 *   with CLONE_NEWUSER; clone3 answers ENOSYS so that libc falls back to clone, whose flags
 *   a filter can read, as Docker's profile does).
 */
#define DENY(nr) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM)
static const unsigned denied[] = {
	__NR_init_module, __NR_finit_module, __NR_delete_module, __NR_kexec_load, __NR_kexec_file_load,
	__NR_open_by_handle_at, __NR_name_to_handle_at, __NR_keyctl, __NR_add_key, __NR_request_key,
	__NR_bpf, __NR_perf_event_open, __NR_userfaultfd, __NR_mount, __NR_umount2, __NR_pivot_root,
	__NR_fsopen, __NR_fsconfig, __NR_fsmount, __NR_fspick, __NR_move_mount, __NR_open_tree,
	__NR_mount_setattr, __NR_swapon, __NR_swapoff, __NR_reboot, __NR_settimeofday,
	__NR_clock_settime, __NR_clock_adjtime, __NR_adjtimex, __NR_acct, __NR_quotactl,
	__NR_lookup_dcookie, __NR_uselib, __NR_ustat, __NR_sysfs, __NR_iopl, __NR_ioperm, __NR_setns,
	__NR_vhangup, __NR_syslog,
};

static void install_seccomp(void)
{
	struct sock_filter head[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000 /* __X32_SYSCALL_BIT */, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_pkey_alloc, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_inotify_init, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_inotify_init1, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone3, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
	};
	struct sock_filter tail[] = {
		/* unshare(flags) and clone(flags, ...): flags in args[0] */
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_unshare, 1, 0),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 0, 3),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
		BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_NEWUSER, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_madvise, 0, 3),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[2])),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, MADV_FREE, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EINVAL),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	/* sized from the three parts (a fixed guess was three entries short once the tail grew,
	 * and the filter was written past the array on PID 1's stack) */
	struct sock_filter f[sizeof(head) / sizeof(head[0]) + 2 * sizeof(denied) / sizeof(denied[0]) +
			     sizeof(tail) / sizeof(tail[0])];
	size_t n = 0;
	struct sock_fprog prog;

	for (size_t i = 0; i < sizeof(head) / sizeof(head[0]); i++)
		f[n++] = head[i];
	for (size_t i = 0; i < sizeof(denied) / sizeof(denied[0]); i++) {
		struct sock_filter d[] = { DENY(denied[i]) };

		f[n++] = d[0];
		f[n++] = d[1];
	}
	for (size_t i = 0; i < sizeof(tail) / sizeof(tail[0]); i++)
		f[n++] = tail[i];
	prog.len = n;
	prog.filter = f;
	/* root with CAP_SYS_ADMIN, before the capabilities are dropped: no NO_NEW_PRIVS needed,
	 * so sudo keeps working. Without the filter a workspace must not run: fatal. */
	if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog)) {
		perror("bunshin-init: installing the seccomp filter");
		exit(1);
	}
}

/*
 * The capabilities a workspace keeps (Docker's default set less CAP_MKNOD): enough for
 * sudo, package managers, services and chromium, and none that reaches the host kernel
 * (no CAP_SYS_ADMIN: no mount, remount or namespace games; no CAP_SYS_MODULE, _RAWIO,
 * _PTRACE, _BOOT, _TIME, _NET_ADMIN, _SYSLOG, _DAC_READ_SEARCH, _MKNOD). Dropped from the
 * bounding set, so no setuid binary or file capability brings them back.
 */
static const int kept_caps[] = {
	CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FSETID, CAP_FOWNER, CAP_SETGID, CAP_SETUID, CAP_SETPCAP,
	CAP_NET_BIND_SERVICE, CAP_NET_RAW, CAP_SYS_CHROOT, CAP_KILL, CAP_AUDIT_WRITE, CAP_SETFCAP,
};

static void drop_capabilities(void)
{
	struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct data[2] = { { 0 } };
	int last = 40;
	FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "r");

	if (f) {
		if (fscanf(f, "%d", &last) != 1)
			last = 40;
		fclose(f);
	}
	for (int cap = 0; cap <= last; cap++) {
		int keep = 0;

		for (size_t i = 0; i < sizeof(kept_caps) / sizeof(kept_caps[0]); i++)
			keep |= kept_caps[i] == cap;
		if (!keep && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)) {
			perror("bunshin-init: dropping a capability from the bounding set");
			exit(1);
		}
	}
	for (size_t i = 0; i < sizeof(kept_caps) / sizeof(kept_caps[0]); i++) {
		int cap = kept_caps[i];

		data[cap / 32].effective |= 1u << (cap % 32);
		data[cap / 32].permitted |= 1u << (cap % 32);
	}
	if (syscall(SYS_capset, &hdr, data)) {
		perror("bunshin-init: capset");
		exit(1);
	}
}

static pid_t start_agent(void)
{
	pid_t pid = fork();

	if (pid == 0) {
		char *const argv[] = { "bunshin-agent", "-u", AGENT_SCRIPT, NULL };
		char *const envp[] = { "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
				       "HOME=/root", "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1", NULL };
		sigset_t none;

		sigemptyset(&none);
		sigprocmask(SIG_SETMASK, &none, NULL);
		execve(AGENT_PYTHON, argv, envp);
		perror("bunshin-init: exec " AGENT_PYTHON);
		_exit(127);
	}
	if (pid < 0)
		perror("bunshin-init: fork agent");
	return pid;
}

static int pid1(void)
{
	sigset_t set;
	pid_t agent;

	install_seccomp();
	drop_capabilities();
	/* PID 1 gets no default signal actions; SIGTERM stops the whole workspace. */
	sigfillset(&set);
	sigprocmask(SIG_BLOCK, &set, NULL);
	agent = start_agent();
	for (;;) {
		struct timespec ts = { 1, 0 };
		siginfo_t si;
		int sig = sigtimedwait(&set, &si, &ts);

		if (sig == SIGTERM || sig == SIGINT) {
			kill(-1, SIGKILL);
			return 0;
		}
		for (;;) {
			int status;
			pid_t pid = waitpid(-1, &status, WNOHANG);

			if (pid <= 0)
				break;
			if (pid == agent) {
				fprintf(stderr, "bunshin-init: agent exited (status %d), restarting\n", status);
				usleep(100000);
				agent = start_agent();
			}
		}
	}
}

/*
 * runas: set the real, effective and saved gid then uid to GID and UID, keeping the
 * supplementary groups, and exec CMD searched on $PATH: exactly what Python's
 * Popen(user=, group=) does in its child. The agent starts user commands through it because
 * Popen with user= cannot use vfork and forks the whole agent (about 0.9 ms on this kind
 * of host, most of a short command's cost); without it Popen vforks and execs this small
 * static program instead. A failure is reported as two ints (errno, stage: 0 = set ids,
 * 1 = exec) on ERRFD, which is close-on-exec, so the agent reads EOF when CMD runs.
 */
static int runas(int argc, char **argv)
{
	if (argc < 6) {
		fprintf(stderr, "usage: /.bunshin/init runas UID GID ERRFD CMD...\n");
		return 2;
	}
	uid_t uid = (uid_t)strtoul(argv[2], NULL, 10);
	gid_t gid = (gid_t)strtoul(argv[3], NULL, 10);
	int errfd = atoi(argv[4]);
	char **cmd = argv + 5;
	int report[2] = {0, 0};

	fcntl(errfd, F_SETFD, FD_CLOEXEC);
	if (setregid(gid, gid) || setreuid(uid, uid)) {
		report[0] = errno;
	} else if (strchr(cmd[0], '/')) {
		execv(cmd[0], cmd);
		report[0] = errno, report[1] = 1;
	} else {
		/* Python's search: each $PATH entry in turn (os.defpath when unset); the first error
		 * other than ENOENT/ENOTDIR is the one reported; no /bin/sh fallback on ENOEXEC */
		const char *path = getenv("PATH");
		char *dirs = strdup(path ? path : "/bin:/usr/bin"), *rest = dirs, *dir;
		char full[4096];
		int saved = 0;
		while (dirs && (dir = strsep(&rest, ":")) != NULL) {
			size_t n = strlen(dir);
			if (n)  /* as os.path.join: no second slash after one the entry ends with */
				snprintf(full, sizeof full, "%s%s%s", dir, dir[n - 1] == '/' ? "" : "/", cmd[0]);
			else
				snprintf(full, sizeof full, "%s", cmd[0]);
			execv(full, cmd);
			if (errno != ENOENT && errno != ENOTDIR && !saved)
				saved = errno;
		}
		report[0] = saved ? saved : errno, report[1] = 1;
	}
	if (write(errfd, report, sizeof report) < 0)
		return 127;
	return 127;
}

int main(int argc, char **argv)
{
	if (argc >= 2 && !strcmp(argv[1], "runas"))
		return runas(argc, argv);
	if (argc >= 2 && !strcmp(argv[1], "launch"))
		return launch(argc, argv);
	if (argc >= 2 && !strcmp(argv[1], "restore"))
		return restore(argc, argv);
	if (argc >= 2 && !strcmp(argv[1], "pid1") && getpid() == 1)
		return pid1();
	fprintf(stderr, "usage: bunshin-init launch ... | restore ... | pid1 (as PID 1 of a workspace)\n");
	return 2;
}
