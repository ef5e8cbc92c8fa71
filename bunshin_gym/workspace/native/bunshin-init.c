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
 * It is C rather than Python because it runs on every workspace start (a couple of
 * milliseconds instead of an interpreter start) and because PID 1 must stay tiny: it is
 * dumped and restored with every snapshot.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
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
#include <unistd.h>

#define AGENT_PYTHON "/usr/bin/python3"
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

/* Everything below runs inside the new namespaces, as PID 1, before the pivot. */
static void setup_root(const char *root, const char *lower, const char *upper, const char *work,
		       const char *snap, const char *hostname)
{
	char opts[4096], p[4096];
	static const struct { const char *name; int major, minor; } devs[] = {
		{ "null", 1, 3 }, { "zero", 1, 5 }, { "full", 1, 7 },
		{ "random", 1, 8 }, { "urandom", 1, 9 }, { "tty", 5, 0 },
	};

	mountx("none", "/", NULL, MS_REC | MS_PRIVATE, NULL);
	if (snprintf(opts, sizeof(opts), "lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work) >=
	    (int)sizeof(opts))
		fail("overlay options too long");
	mountx("overlay", root, "overlay", 0, opts);

#define AT(sub) (snprintf(p, sizeof(p), "%s%s", root, sub), p)
	mkdirx(AT("/proc"), 0555);
	mountx("proc", AT("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	mkdirx(AT("/sys"), 0555);
	mountx("sysfs", AT("/sys"), "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	mkdirx(AT("/dev"), 0755);
	mountx("tmpfs", AT("/dev"), "tmpfs", MS_NOSUID, "mode=755,size=65536k");
	for (size_t i = 0; i < sizeof(devs) / sizeof(devs[0]); i++) {
		char dev[64];

		snprintf(dev, sizeof(dev), "/dev/%s", devs[i].name);
		mknodx(AT(dev), devs[i].major, devs[i].minor);
	}
	symlinkx("/proc/self/fd", AT("/dev/fd"));
	symlinkx("/proc/self/fd/0", AT("/dev/stdin"));
	symlinkx("/proc/self/fd/1", AT("/dev/stdout"));
	symlinkx("/proc/self/fd/2", AT("/dev/stderr"));
	symlinkx("pts/ptmx", AT("/dev/ptmx"));
	mkdirx(AT("/dev/pts"), 0755);
	mountx("devpts", AT("/dev/pts"), "devpts", MS_NOSUID | MS_NOEXEC,
	       "newinstance,ptmxmode=0666,mode=0620,gid=5");
	mkdirx(AT("/dev/shm"), 01777);
	mountx("shm", AT("/dev/shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
	mkdirx(AT("/tmp"), 01777);
	mountx("tmpfs", AT("/tmp"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
	mkdirx(AT("/run"), 0755);
	mountx("tmpfs", AT("/run"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=755");
	mkdirx(AT("/run/bunshin"), 0700);
	mkdirx(AT("/.snap"), 0755);
	mountx(snap, AT("/.snap"), NULL, MS_BIND, NULL);
	mountx(NULL, AT("/.snap"), NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL);
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
	if (unshare(CLONE_NEWNS))
		fail("unshare");
	mountx("none", "/", NULL, MS_REC | MS_PRIVATE, NULL);
	if (snprintf(opts, sizeof(opts), "lowerdir=%s,upperdir=%s,workdir=%s", argv[3], argv[4],
		     argv[5]) >= (int)sizeof(opts))
		fail("overlay options too long");
	mountx("overlay", argv[2], "overlay", 0, opts);
	if (!strcmp(argv[6], "1") && prctl(67 /* PR_SET_MEMORY_MERGE */, 1, 0, 0, 0))
		fail("PR_SET_MEMORY_MERGE");
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

static int launch(int argc, char **argv)
{
	int pipefd[2];
	pid_t pid;

	if (argc < 8) {
		fprintf(stderr, "usage: bunshin-init launch ROOT LOWERDIRS UPPER WORK SNAPDIR HOSTNAME "
				"[CGROUP_PROCS_FILE...]\n");
		return 2;
	}
	for (int i = 8; i < argc; i++)
		join_cgroup(argv[i]);
	if (unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS))
		fail("unshare");
	if (pipe2(pipefd, O_CLOEXEC))
		fail("pipe2");
	pid = fork();
	if (pid < 0)
		fail("fork");
	if (pid == 0) {
		char *const init_argv[] = { "init", "pid1", NULL };
		char *const envp[] = { "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
				       NULL };

		close(pipefd[0]);
		err_fd = pipefd[1];
		prctl(PR_SET_PDEATHSIG, 0);
		setup_root(argv[2], argv[3], argv[4], argv[5], argv[6], argv[7]);
		own_stdio();
		if (setsid() < 0)
			fail("setsid");
		execve("/.bunshin/init", init_argv, envp);
		fail("exec /.bunshin/init");
	}
	close(pipefd[1]);
	{
		char msg[512];
		ssize_t n = read(pipefd[0], msg, sizeof(msg) - 1);

		if (n > 0) {
			msg[n] = 0;
			waitpid(pid, NULL, 0);
			fprintf(stderr, "bunshin-init: workspace setup failed: %s\n", msg);
			return 1;
		}
	}
	printf("%d\n", pid);
	return 0;
}

/*
 * Workspace-wide seccomp filter, inherited by every process and kept by CRIU:
 * - io_uring_setup fails with ENOSYS: CRIU cannot dump io_uring; libuv/node fall back to epoll.
 * - madvise(MADV_FREE) fails with EINVAL, as the kernel answers for file mappings: a clone's
 *   anonymous memory may be served from a page image, where a lazy free would let the
 *   image's stale page reappear. Allocators (jemalloc, glibc) fall back to MADV_DONTNEED.
 */
static void install_seccomp(void)
{
	struct sock_filter f[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_madvise, 0, 3),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[2])),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, MADV_FREE, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EINVAL),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = { .len = sizeof(f) / sizeof(f[0]), .filter = f };

	/* root in the initial user namespace: no NO_NEW_PRIVS needed, so sudo keeps working */
	if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog))
		perror("bunshin-init: seccomp");
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

int main(int argc, char **argv)
{
	if (argc >= 2 && !strcmp(argv[1], "launch"))
		return launch(argc, argv);
	if (argc >= 2 && !strcmp(argv[1], "restore"))
		return restore(argc, argv);
	if (argc >= 2 && !strcmp(argv[1], "pid1") && getpid() == 1)
		return pid1();
	fprintf(stderr, "usage: bunshin-init launch ... | restore ... | pid1 (as PID 1 of a workspace)\n");
	return 2;
}
