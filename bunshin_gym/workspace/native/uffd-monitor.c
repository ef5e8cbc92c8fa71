// SPDX-License-Identifier: Apache-2.0
/*
 * bunshin-uffd-monitor: serves the anonymous memory of one clone restored in "share" mode.
 *
 * The clone's private anonymous memory is mapped MAP_PRIVATE from its snapshot's page image
 * held on tmpfs (criu/patches/0003-uffd-share-anon.patch), so unmodified pages are the page
 * cache's and shared by every clone, and writes copy. Plain file mappings would break
 * anonymous memory semantics (after MADV_DONTNEED a page must read back as zeros, not as the
 * image's page), so each restored process hands a userfaultfd to this monitor, which
 * registers those ranges in MINOR|MISSING mode with the remove, fork, remap and unmap events,
 * maps every page up front with UFFDIO_CONTINUE and keeps, per process and per range, a
 * bitmap of the pages that still hold image data:
 *   - MADV_DONTNEED (remove event) clears bits; a later fault there gets UFFDIO_ZEROPAGE;
 *   - fork (fork event) copies the bitmaps to the child's new userfaultfd;
 *   - mremap (remap event) moves them, munmap (unmap event) drops them;
 *   - a fault on a page without data (grown mapping, dropped page) gets a zero page.
 * MADV_FREE would send a remove event and then fail, so workspaces reject it with a seccomp
 * filter (bunshin-init pid1); images are sparse and larger than their data, so growing a
 * mapping in place never reaches the end of the file (SIGBUS).
 *
 * One monitor per clone (not one per host): a fault in the monitor can only ever take down
 * the clone it serves, its state is one clone's, and it dies with that clone. It is two
 * processes: the worker above, and a guard, its parent, which holds a duplicate of every
 * userfaultfd and waits. If the worker dies, the duplicates keep the userfaultfd contexts
 * alive, so the clone's processes block on their next fault instead of reading stale image
 * data; the guard then kills the clone (its cgroups), writes REPORT and exits. If the guard
 * dies, the worker does the same. A normal stop (SIGTERM to the guard) stops both quietly.
 *
 *   bunshin-uffd-monitor --probe
 *       exit 0 if this kernel has what the mechanism needs, else print what is missing, exit 1
 *   bunshin-uffd-monitor SOCKET IMAGES_DIR STATE_FILE REPORT_FILE CGROUP_DIR...
 *       listen on SOCKET for criu restore (CRIU_UFFD_SOCK); the images are on the tmpfs
 *       holding IMAGES_DIR; STATE_FILE gets counters (JSON, rewritten every second); prints
 *       "ready GUARD_PID WORKER_PID" once listening.
 *   bunshin-uffd-monitor --wp SOCKET STATE_FILE REPORT_FILE CGROUP_DIR...
 *       write tracking of a clone restored by copy (CRIU_UFFD_WP_SOCK, memory modes copy and
 *       ksm): at each task's handshake, its private anonymous memory is registered for
 *       asynchronous write-protect (UFFD_FEATURE_WP_ASYNC: a write only clears the page's
 *       uffd-wp bit, nothing blocks and no message comes) and its present pages are
 *       write-protected (PAGEMAP_SCAN with PM_SCAN_WP_MATCHING: unpopulated pages are left
 *       alone, so huge PROT_NONE reservations cost no page tables). A later dump reads which
 *       pages are still unwritten (criu/patches/0018-*). No events are asked for: a page moved
 *       by mremap or inherited by fork loses the bit, the conservative answer. If this monitor
 *       dies, its userfaultfds close and the kernel drops every bit: the clone runs on and
 *       its next snapshots are full dumps (the clone is not stopped, nothing reads stale data).
 *   bunshin-uffd-monitor --probe-wp
 *       exit 0 if this kernel has asynchronous write-protect and PAGEMAP_SCAN
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PG 4096UL
#define HELLO_MAGIC 0x44465542u /* 'BUFD', see criu/uffd.c setup_uffd_share() */

static const unsigned long long NEED_FEATURES =
	UFFD_FEATURE_MINOR_SHMEM | UFFD_FEATURE_MISSING_SHMEM | UFFD_FEATURE_EVENT_FORK | UFFD_FEATURE_EVENT_REMAP |
	UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_UNMAP;

/* Linux 6.7+ (the build host's headers may be older) */
#ifndef UFFD_FEATURE_WP_ASYNC
#define UFFD_FEATURE_WP_ASYNC (1 << 15)
#endif
#define PM_PAGE_IS_WRITTEN (1 << 1)
#define PM_PAGE_IS_PRESENT (1 << 3)
#define PM_PAGE_IS_SWAPPED (1 << 4)
#define PM_SCAN_WP_MATCHING (1 << 0)
struct pm_page_region {
	uint64_t start, end, categories;
};
struct pm_scan_arg_ {
	uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages, category_inverted, category_mask,
		category_anyof_mask, return_mask;
};
#define PAGEMAP_SCAN_ _IOWR('f', 16, struct pm_scan_arg_)

/* --wp: write tracking only (asynchronous write-protect), see the header */
static int wp_mode;

static double now(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

static void logf_(const char *fmt, ...)
{
	va_list ap;
	time_t t = time(NULL);
	char ts[32];

	strftime(ts, sizeof(ts), "%H:%M:%S", localtime(&t));
	fprintf(stderr, "%s bunshin-uffd-monitor[%d]: ", ts, getpid());
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	fflush(stderr);
}

/* stopping the clone ------------------------------------------------------------------- */
static char **cg_dirs;
static int cg_n;
static const char *report_file;

static int write_str(const char *path, const char *s)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	int ok;

	if (fd < 0)
		return -1;
	ok = write(fd, s, strlen(s)) == (ssize_t)strlen(s);
	close(fd);
	return ok ? 0 : -1;
}

/* Kill every process of the clone: freeze first (nothing runs on), kill, thaw (v1 frozen
 * tasks cannot die), repeat until the cgroups are empty. */
static int stop_clone(void)
{
	char p[4096];
	int killed = 0;

	for (int i = 0; i < cg_n; i++) {
		snprintf(p, sizeof(p), "%s/cgroup.freeze", cg_dirs[i]);
		write_str(p, "1");
		snprintf(p, sizeof(p), "%s/freezer.state", cg_dirs[i]);
		write_str(p, "FROZEN");
	}
	for (int round = 0; round < 2000; round++) {
		int left = 0;

		for (int i = 0; i < cg_n; i++) {
			FILE *f;
			int pid;

			snprintf(p, sizeof(p), "%s/cgroup.kill", cg_dirs[i]);
			if (!write_str(p, "1"))
				continue;
			snprintf(p, sizeof(p), "%s/cgroup.procs", cg_dirs[i]);
			f = fopen(p, "re");
			if (!f)
				continue;
			while (fscanf(f, "%d", &pid) == 1) {
				if (kill(pid, SIGKILL) == 0)
					killed++;
				left++;
			}
			fclose(f);
		}
		for (int i = 0; i < cg_n; i++) {
			snprintf(p, sizeof(p), "%s/cgroup.freeze", cg_dirs[i]);
			write_str(p, "0");
			snprintf(p, sizeof(p), "%s/freezer.state", cg_dirs[i]);
			write_str(p, "THAWED");
		}
		if (!left)
			break;
		usleep(5000);
	}
	return killed;
}

static void write_report(const char *who, const char *why, const char *action, int killed)
{
	char tmp[4096], buf[2048];
	int fd, n;

	n = snprintf(buf, sizeof(buf),
		     "{\"event\": \"monitor-died\", \"who\": \"%s\", \"reason\": \"%s\", \"time\": %ld, "
		     "\"action\": \"%s\", \"signalled\": %d}\n",
		     who, why, (long)time(NULL), action, killed);
	snprintf(tmp, sizeof(tmp), "%s.tmp", report_file);
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd >= 0) {
		if (write(fd, buf, n) != n)
			logf_("writing %s: %s", tmp, strerror(errno));
		close(fd);
		rename(tmp, report_file);
	}
}

static void report(const char *who, const char *why)
{
	int killed;

	/* written before the clone is stopped, then again with what was signalled: whoever sees
	 * the clone's processes gone finds why (they were gone before the report was there) */
	write_report(who, why, "stopping the clone", -1);
	killed = stop_clone();
	logf_("%s: %s; stopped the clone (%d processes signalled)", who, why, killed);
	write_report(who, why, "clone stopped", killed);
}

/* per-process state ---------------------------------------------------------------------- */
struct region {
	unsigned long start, npages, nvalid;
	uint64_t *valid; /* bit set: the page still holds image data; clear: reads as zeros */
};

struct ctx {
	int fd;		/* userfaultfd */
	int chan;	/* restore handshake channel, -1 once done */
	int id;		/* key shared with the guard */
	pid_t pid;	/* host pid if known (restored tasks), 0 for forked children */
	int registered;
	struct region *r;
	int nr, cap;
};

static struct ctx **ctxs;
static int nctx, capctx, next_id = 1;
static int guard_sk = -1;
static unsigned long img_major, img_minor;
static unsigned long probe_addr = 0x10000;

static struct {
	long minor, missing, cont, zero, eexist, eagain, removes, unmaps, remaps, forks, procs, procs_gone;
	long errors;
	unsigned long registered_pages, continued_pages, protected_ranges;
	double restore_s;
	char last_error[256];
} st;

static void error_(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(st.last_error, sizeof(st.last_error), fmt, ap);
	va_end(ap);
	st.errors++;
	logf_("error: %s", st.last_error);
}

static inline int bit_get(struct region *r, unsigned long i) { return r->valid[i / 64] >> (i % 64) & 1; }
static inline void bit_clear(struct region *r, unsigned long i)
{
	if (bit_get(r, i)) {
		r->valid[i / 64] &= ~(1ULL << (i % 64));
		r->nvalid--;
	}
}

static void region_free(struct region *r) { free(r->valid); r->valid = NULL; }

static void ctx_insert(struct ctx *c, struct region nr)
{
	int i;

	if (c->nr == c->cap) {
		c->cap = c->cap ? c->cap * 2 : 16;
		c->r = realloc(c->r, c->cap * sizeof(*c->r));
	}
	for (i = c->nr; i > 0 && c->r[i - 1].start > nr.start; i--)
		c->r[i] = c->r[i - 1];
	c->r[i] = nr;
	c->nr++;
}

static void ctx_drop(struct ctx *c, int i)
{
	region_free(&c->r[i]);
	memmove(&c->r[i], &c->r[i + 1], (c->nr - i - 1) * sizeof(*c->r));
	c->nr--;
}

static struct region region_new(unsigned long start, unsigned long npages, int set)
{
	struct region r = { start, npages, set ? npages : 0, calloc((npages + 63) / 64, 8) };

	if (set) {
		memset(r.valid, 0xff, (npages + 63) / 64 * 8);
		if (npages % 64)
			r.valid[npages / 64] = (1ULL << (npages % 64)) - 1;
	}
	return r;
}

/* index of the region containing addr, or -1 */
static int lookup(struct ctx *c, unsigned long a)
{
	int lo = 0, hi = c->nr - 1;

	while (lo <= hi) {
		int mid = (lo + hi) / 2;
		struct region *r = &c->r[mid];

		if (a < r->start)
			hi = mid - 1;
		else if (a >= r->start + r->npages * PG)
			lo = mid + 1;
		else
			return mid;
	}
	return -1;
}

static int page_valid(struct ctx *c, unsigned long a)
{
	int i = lookup(c, a);

	return i >= 0 && bit_get(&c->r[i], (a - c->r[i].start) / PG);
}

/* MADV_DONTNEED: the pages read as zeros from now on */
static void clear_range(struct ctx *c, unsigned long s, unsigned long e)
{
	for (int i = 0; i < c->nr; i++) {
		struct region *r = &c->r[i];
		unsigned long rs = r->start, re = r->start + r->npages * PG;
		unsigned long a = s > rs ? s : rs, b = e < re ? e : re;

		for (; a < b; a += PG)
			bit_clear(r, (a - rs) / PG);
		if (!r->nvalid)
			ctx_drop(c, i--);
	}
}

/* Take [s, e) out of every region (munmap, the source and target of mremap); the part
 * inside is returned as a new region when want != NULL. */
static void cut_range(struct ctx *c, unsigned long s, unsigned long e, struct region *want)
{
	if (want)
		*want = region_new(s, (e - s) / PG, 0);
	for (int i = 0; i < c->nr; i++) {
		struct region r = c->r[i];
		unsigned long rs = r.start, re = r.start + r.npages * PG;

		if (re <= s || rs >= e)
			continue;
		if (want)
			for (unsigned long a = s > rs ? s : rs; a < (e < re ? e : re); a += PG)
				if (bit_get(&r, (a - rs) / PG)) {
					unsigned long j = (a - s) / PG;

					want->valid[j / 64] |= 1ULL << (j % 64);
					want->nvalid++;
				}
		/* keep the parts before s and after e */
		memmove(&c->r[i], &c->r[i + 1], (c->nr - i - 1) * sizeof(*c->r));
		c->nr--;
		i--;
		if (rs < s) {
			struct region left = region_new(rs, (s - rs) / PG, 0);

			for (unsigned long j = 0; j < left.npages; j++)
				if (bit_get(&r, j)) {
					left.valid[j / 64] |= 1ULL << (j % 64);
					left.nvalid++;
				}
			if (left.nvalid)
				ctx_insert(c, left), i++;
			else
				region_free(&left);
		}
		if (re > e) {
			struct region right = region_new(e, (re - e) / PG, 0);

			for (unsigned long j = 0; j < right.npages; j++)
				if (bit_get(&r, (e - rs) / PG + j)) {
					right.valid[j / 64] |= 1ULL << (j % 64);
					right.nvalid++;
				}
			if (right.nvalid)
				ctx_insert(c, right), i++;
			else
				region_free(&right);
		}
		region_free(&r);
	}
}

static struct ctx *ctx_new(int fd, pid_t pid)
{
	struct ctx *c = calloc(1, sizeof(*c));

	c->fd = fd;
	c->chan = -1;
	c->pid = pid;
	c->id = next_id++;
	if (nctx == capctx) {
		capctx = capctx ? capctx * 2 : 16;
		ctxs = realloc(ctxs, capctx * sizeof(*ctxs));
	}
	ctxs[nctx++] = c;
	st.procs++;
	return c;
}

/* guard protocol: {op 'A', id} + fd to hold, {op 'D', id} to close it */
struct gmsg {
	char op;
	int id;
};

static void guard_send(char op, int id, int fd)
{
	struct gmsg m = { op, id };
	char cbuf[CMSG_SPACE(sizeof(int))];
	struct iovec iov = { &m, sizeof(m) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };

	if (fd >= 0) {
		struct cmsghdr *cm;

		memset(cbuf, 0, sizeof(cbuf));
		mh.msg_control = cbuf;
		mh.msg_controllen = sizeof(cbuf);
		cm = CMSG_FIRSTHDR(&mh);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(cm), &fd, sizeof(int));
	}
	if (sendmsg(guard_sk, &mh, MSG_NOSIGNAL) < 0)
		error_("handing a userfaultfd to the guard: %s", strerror(errno));
}

static void ctx_free(int k)
{
	struct ctx *c = ctxs[k];

	guard_send('D', c->id, -1);
	close(c->fd);
	if (c->chan >= 0)
		close(c->chan);
	for (int i = 0; i < c->nr; i++)
		region_free(&c->r[i]);
	free(c->r);
	free(c);
	ctxs[k] = ctxs[--nctx];
	st.procs_gone++;
}

/* uffd operations ---------------------------------------------------------------------- */
static void wake(int fd, unsigned long a)
{
	struct uffdio_range r = { a, PG };

	ioctl(fd, UFFDIO_WAKE, &r);
}

static int zero_page(struct ctx *c, unsigned long a)
{
	struct uffdio_zeropage z = { .range = { a, PG }, .mode = 0 };

	if (!ioctl(c->fd, UFFDIO_ZEROPAGE, &z)) {
		st.zero++;
		return 0;
	}
	if (errno == EEXIST) {
		st.eexist++;
		wake(c->fd, a);
		return 0;
	}
	if (errno == EAGAIN) { /* the layout is changing: the event is queued, let it refault */
		st.eagain++;
		wake(c->fd, a);
		return 0;
	}
	if (errno == ESRCH || errno == ENOENT) /* process gone / range unmapped meanwhile */
		return 0;
	error_("UFFDIO_ZEROPAGE at %lx (pid %d): %s", a, c->pid, strerror(errno));
	wake(c->fd, a);
	return -1;
}

/* map [a, a+len) from the page cache; EEXIST pages (already mapped) are skipped */
static unsigned long continue_range(struct ctx *c, unsigned long a, unsigned long len)
{
	unsigned long done = 0;

	while (done < len) {
		struct uffdio_continue cont = { .range = { a + done, len - done }, .mode = 0 };

		if (!ioctl(c->fd, UFFDIO_CONTINUE, &cont)) {
			st.continued_pages += (len - done) / PG;
			return len;
		}
		if (cont.mapped > 0) {
			done += cont.mapped;
			st.continued_pages += cont.mapped / PG;
		}
		if (errno == EEXIST) {
			done += PG;
			continue;
		}
		if (errno == EAGAIN)
			continue;
		return done | (1UL << 63) | ((unsigned long)errno << 48);
	}
	return len;
}

static void handle_fault(struct ctx *c, struct uffd_msg *m)
{
	unsigned long a = m->arg.pagefault.address & ~(PG - 1);
	int minor = !!(m->arg.pagefault.flags & UFFD_PAGEFAULT_FLAG_MINOR);

	if (minor)
		st.minor++;
	else
		st.missing++;
	if (minor && page_valid(c, a)) {
		struct uffdio_continue cont = { .range = { a, PG }, .mode = 0 };

		if (!ioctl(c->fd, UFFDIO_CONTINUE, &cont)) {
			st.cont++;
			return;
		}
		if (errno == EEXIST) {
			st.eexist++;
			wake(c->fd, a);
			return;
		}
		if (errno == EAGAIN) {
			st.eagain++;
			wake(c->fd, a);
			return;
		}
		if (errno == ESRCH || errno == ENOENT)
			return;
		error_("UFFDIO_CONTINUE at %lx (pid %d): %s", a, c->pid, strerror(errno));
		wake(c->fd, a);
		return;
	}
	if (!minor && page_valid(c, a))
		/* a data page the image lacks: the image changed under us */
		error_("missing fault at %lx (pid %d) on a page that should be in the image", a, c->pid);
	zero_page(c, a);
}

static void handle_msg(struct ctx *c, struct uffd_msg *m)
{
	switch (m->event) {
	case UFFD_EVENT_PAGEFAULT:
		handle_fault(c, m);
		break;
	case UFFD_EVENT_REMOVE:
		st.removes++;
		clear_range(c, m->arg.remove.start, m->arg.remove.end);
		break;
	case UFFD_EVENT_UNMAP:
		st.unmaps++;
		cut_range(c, m->arg.remove.start, m->arg.remove.end, NULL);
		break;
	case UFFD_EVENT_REMAP: {
		struct region moved;
		unsigned long from = m->arg.remap.from, to = m->arg.remap.to, len = m->arg.remap.len;

		st.remaps++;
		cut_range(c, from, from + len, &moved);
		cut_range(c, to, to + len, NULL);
		moved.start = to;
		if (moved.nvalid)
			ctx_insert(c, moved);
		else
			region_free(&moved);
		break;
	}
	case UFFD_EVENT_FORK: {
		struct ctx *n = ctx_new(m->arg.fork.ufd, 0);

		st.forks++;
		n->registered = 1;
		n->r = calloc(c->cap ? c->cap : 1, sizeof(*n->r));
		n->cap = c->cap ? c->cap : 1;
		for (int i = 0; i < c->nr; i++) { /* the child inherits the discard state */
			struct region r = c->r[i];

			r.valid = malloc((r.npages + 63) / 64 * 8);
			memcpy(r.valid, c->r[i].valid, (r.npages + 63) / 64 * 8);
			n->r[i] = r;
		}
		n->nr = c->nr;
		guard_send('A', n->id, n->fd);
		break;
	}
	default:
		error_("unknown userfaultfd event %d", m->event);
	}
}

/* --wp: write-protect the present pages of [s, e) (a registered range); unpopulated pages are
 * left alone (UFFDIO_WRITEPROTECT would fill the range with markers and page tables). The scan
 * is given an output vector on purpose: without one the kernel takes a fast path that
 * write-protects every pte of a populated page table, empty ones too (as markers, which a dump
 * then sees as swapped pages: zero pages dumped, and VMAs that held none, such as V8's
 * PROT_NONE reservations, then get premapped writable at restore and fail with ENOMEM) */
static int protect_present(int pagemap, unsigned long s, unsigned long e)
{
	static struct pm_page_region vec[512];
	struct pm_scan_arg_ a = { .size = sizeof(a), .flags = PM_SCAN_WP_MATCHING, .start = s, .end = e,
				  .vec = (unsigned long)vec, .vec_len = 512, .category_mask = PM_PAGE_IS_WRITTEN,
				  .category_anyof_mask = PM_PAGE_IS_PRESENT | PM_PAGE_IS_SWAPPED,
				  .return_mask = PM_PAGE_IS_PRESENT };

	while (a.start < e) {
		if (ioctl(pagemap, PAGEMAP_SCAN_, &a) < 0)
			return -1;
		if (a.walk_end <= a.start) /* no progress: give up rather than spin */
			return errno = EIO, -1;
		a.start = a.walk_end;
	}
	return 0;
}

/* --wp handshake: register the task's private anonymous memory for asynchronous write-protect
 * and write-protect what is present. A range that cannot be registered or protected stays
 * untracked (its pages read as written: dumped in full); the restore goes on either way. */
static int register_process_wp(struct ctx *c)
{
	char path[64], line[4096];
	FILE *f;
	int nreg = 0, pm;
	double t0 = now();

	snprintf(path, sizeof(path), "/proc/%d/maps", c->pid);
	f = fopen(path, "re");
	snprintf(path, sizeof(path), "/proc/%d/pagemap", c->pid);
	pm = open(path, O_RDONLY | O_CLOEXEC);
	if (!f || pm < 0) {
		error_("pid %d: reading its maps or pagemap: %s", c->pid, strerror(errno));
		if (f)
			fclose(f);
		if (pm >= 0)
			close(pm);
		c->registered = 1;
		return 0;
	}
	while (fgets(line, sizeof(line), f)) {
		unsigned long s, e, off, ino, ma, mi;
		char perms[8], name[256] = "";
		struct uffdio_register reg;

		if (sscanf(line, "%lx-%lx %7s %lx %lx:%lx %lu %255s", &s, &e, perms, &off, &ma, &mi, &ino, name) < 7)
			continue;
		/* private anonymous memory only: heap and stack included, the kernel's special
		 * mappings ([vdso], [vvar], [vsyscall], [uprobes]) and every file mapping left out */
		if (perms[3] != 'p' || ino || (name[0] == '[' && strcmp(name, "[heap]") && strncmp(name, "[stack", 6)))
			continue;
		if (name[0] && name[0] != '[')
			continue;
		reg = (struct uffdio_register){ .range = { s, e - s }, .mode = UFFDIO_REGISTER_MODE_WP };
		if (ioctl(c->fd, UFFDIO_REGISTER, &reg)) {
			error_("pid %d: UFFDIO_REGISTER(WP) %lx-%lx: %s (left untracked)", c->pid, s, e, strerror(errno));
			continue;
		}
		st.registered_pages += (e - s) / PG;
		if (protect_present(pm, s, e)) {
			error_("pid %d: write-protecting %lx-%lx: %s (left untracked)", c->pid, s, e, strerror(errno));
			continue;
		}
		st.protected_ranges++;
		nreg++;
	}
	fclose(f);
	close(pm);
	c->registered = 1;
	st.restore_s += now() - t0;
	logf_("pid %d: %d ranges write-tracked in %.3f s", c->pid, nreg, now() - t0);
	return 0;
}

/* restore handshake: register what the process maps from the images, map it all, answer */
static int register_process(struct ctx *c)
{
	if (wp_mode)
		return register_process_wp(c);

	char path[64], line[4096];
	FILE *f;
	int nreg = 0;
	double t0 = now();

	snprintf(path, sizeof(path), "/proc/%d/maps", c->pid);
	f = fopen(path, "re");
	if (!f) {
		error_("reading %s: %s", path, strerror(errno));
		return -1;
	}
	while (fgets(line, sizeof(line), f)) {
		unsigned long s, e, off, ino, ma, mi;
		char perms[8];
		struct uffdio_register reg;
		unsigned long r;

		if (sscanf(line, "%lx-%lx %7s %lx %lx:%lx %lu", &s, &e, perms, &off, &ma, &mi, &ino) != 7)
			continue;
		if (ma != img_major || mi != img_minor || !ino)
			continue;
		if (perms[3] != 'p') {
			error_("pid %d: shared mapping %lx-%lx of an image", c->pid, s, e);
			fclose(f);
			return -1;
		}
		reg = (struct uffdio_register){ .range = { s, e - s },
						.mode = UFFDIO_REGISTER_MODE_MINOR | UFFDIO_REGISTER_MODE_MISSING };
		if (ioctl(c->fd, UFFDIO_REGISTER, &reg)) {
			error_("pid %d: UFFDIO_REGISTER %lx-%lx: %s", c->pid, s, e, strerror(errno));
			fclose(f);
			return -1;
		}
		ctx_insert(c, region_new(s, (e - s) / PG, 1));
		st.registered_pages += (e - s) / PG;
		r = continue_range(c, s, e - s);
		if (r >> 63)
			/* not fatal: the rest is mapped on first touch */
			error_("pid %d: UFFDIO_CONTINUE %lx-%lx stopped at +%lx: %s", c->pid, s, e, r & ((1UL << 48) - 1),
			       strerror((r >> 48) & 0x7fff));
		nreg++;
	}
	fclose(f);
	c->registered = 1;
	st.restore_s += now() - t0;
	logf_("pid %d: %d ranges registered and mapped in %.3f s", c->pid, nreg, now() - t0);
	return 0;
}

static int api(int fd)
{
	struct uffdio_api a = { .api = UFFD_API, .features = wp_mode ? UFFD_FEATURE_WP_ASYNC : NEED_FEATURES };

	if (ioctl(fd, UFFDIO_API, &a)) {
		error_("UFFDIO_API: %s", strerror(errno));
		return -1;
	}
	return 0;
}

/* a restored task's hello: its userfaultfd, its handshake channel, its credentials */
static int accept_hello(int sk)
{
	uint32_t h[2];
	char cbuf[CMSG_SPACE(2 * sizeof(int)) + CMSG_SPACE(sizeof(struct ucred)) + 64];
	struct iovec iov = { h, sizeof(h) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf) };
	int fds[2] = { -1, -1 }, nfd = 0;
	pid_t pid = 0;
	ssize_t n = recvmsg(sk, &mh, MSG_CMSG_CLOEXEC);

	if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
		return -1; /* criu is done (or gone) */
	if (n < 0)
		return 0;
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
		if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
			nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			memcpy(fds, CMSG_DATA(cm), (nfd > 2 ? 2 : nfd) * sizeof(int));
		} else if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_CREDENTIALS) {
			struct ucred cr;

			memcpy(&cr, CMSG_DATA(cm), sizeof(cr));
			pid = cr.pid;
		}
	}
	if (n != sizeof(h) || h[0] != HELLO_MAGIC || nfd != 2 || pid <= 0) {
		error_("bad hello from criu (%zd bytes, %d fds, pid %d)", n, nfd, pid);
		for (int i = 0; i < 2; i++)
			if (fds[i] >= 0)
				close(fds[i]);
		return 0;
	}
	if (api(fds[0])) {
		close(fds[0]);
		close(fds[1]); /* the restorer reads EOF and fails the restore */
		return 0;
	}
	{
		struct ctx *c = ctx_new(fds[0], pid);

		c->chan = fds[1];
		guard_send('A', c->id, c->fd);
	}
	return 0;
}

/* a process whose mm is gone answers ESRCH (mmget fails before anything else is checked) */
static int ctx_dead(struct ctx *c)
{
	struct uffdio_zeropage z = { .range = { probe_addr, PG }, .mode = UFFDIO_ZEROPAGE_MODE_DONTWAKE };

	return ioctl(c->fd, UFFDIO_ZEROPAGE, &z) && errno == ESRCH;
}

static const char *state_file;

static void write_state(void)
{
	char tmp[4096];
	unsigned long regions = 0, bitmap = 0, valid = 0;
	struct timespec cpu;
	FILE *f;

	for (int k = 0; k < nctx; k++)
		for (int i = 0; i < ctxs[k]->nr; i++) {
			regions++;
			bitmap += (ctxs[k]->r[i].npages + 63) / 64 * 8;
			valid += ctxs[k]->r[i].nvalid;
		}
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
	snprintf(tmp, sizeof(tmp), "%s.tmp", state_file);
	f = fopen(tmp, "we");
	if (!f)
		return;
	fprintf(f,
		"{\"pid\": %d, \"cpu_s\": %.4f, \"processes\": %d, \"regions\": %lu, \"bitmap_bytes\": %lu, "
		"\"valid_pages\": %lu, \"registered_pages\": %lu, \"continued_pages\": %lu, \"protected_ranges\": %lu, "
		"\"wp\": %d, \"restore_s\": %.4f, "
		"\"faults_minor\": %ld, \"faults_missing\": %ld, \"continue\": %ld, \"zeropage\": %ld, "
		"\"eexist\": %ld, \"eagain\": %ld, \"remove\": %ld, \"unmap\": %ld, \"remap\": %ld, \"fork\": %ld, "
		"\"processes_seen\": %ld, \"processes_gone\": %ld, \"errors\": %ld, \"last_error\": \"",
		getpid(), cpu.tv_sec + cpu.tv_nsec * 1e-9, nctx, regions, bitmap, valid, st.registered_pages,
		st.continued_pages, st.protected_ranges, wp_mode, st.restore_s, st.minor, st.missing, st.cont, st.zero, st.eexist, st.eagain,
		st.removes, st.unmaps, st.remaps, st.forks, st.procs, st.procs_gone, st.errors);
	for (char *p = st.last_error; *p; p++)
		if (*p != '"' && *p != '\\' && (unsigned char)*p >= 32)
			fputc(*p, f);
	fputs("\"}\n", f);
	fclose(f);
	rename(tmp, state_file);
}

static volatile sig_atomic_t stopping;
static void on_term(int sig) { (void)sig; stopping = 1; }

static int worker(int lsk)
{
	struct pollfd *pf = NULL;
	int cap = 0, nconn = 0, conns[64];
	double last_gc = now(), last_state = 0;
	struct sigaction sa = { .sa_handler = on_term };

	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);
	while (!stopping) {
		int n = 0, np;

		if (cap < nctx * 2 + 66) {
			cap = nctx * 2 + 66;
			pf = realloc(pf, cap * sizeof(*pf));
		}
		pf[n++] = (struct pollfd){ guard_sk, POLLIN, 0 };
		pf[n++] = (struct pollfd){ lsk, POLLIN, 0 };
		for (int i = 0; i < nconn; i++)
			pf[n++] = (struct pollfd){ conns[i], POLLIN, 0 };
		for (int k = 0; k < nctx; k++) {
			pf[n++] = (struct pollfd){ ctxs[k]->fd, ctxs[k]->registered ? POLLIN : 0, 0 };
			pf[n++] = (struct pollfd){ ctxs[k]->chan, POLLIN, 0 };
		}
		np = poll(pf, n, 1000);
		if (np < 0 && errno != EINTR) {
			error_("poll: %s", strerror(errno));
			sleep(1);
			continue;
		}
		if (stopping)
			break;
		if (np > 0) {
			int i = 0, k0 = nctx;

			if (pf[i++].revents & (POLLHUP | POLLERR | POLLIN)) {
				/* the guard never writes: readable or hung up means it is gone */
				if (wp_mode)
					logf_("the monitor's guard process died; write tracking of the clone ends");
				else
					report("worker", "the monitor's guard process died");
				return 1;
			}
			if (pf[i++].revents & POLLIN) {
				int c = accept4(lsk, NULL, NULL, SOCK_CLOEXEC);
				int one = 1;

				if (c >= 0 && nconn < 64) {
					setsockopt(c, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one));
					conns[nconn++] = c;
				} else if (c >= 0) {
					close(c);
				}
			}
			for (int j = 0; j < nconn; j++, i++) {
				if ((pf[i].revents & POLLIN) && accept_hello(conns[j]) == 0)
					continue;
				if (pf[i].revents & (POLLIN | POLLHUP | POLLERR)) {
					close(conns[j]);
					conns[j] = -1;
				}
			}
			for (int j = 0; j < nconn; j++)
				if (conns[j] < 0)
					conns[j--] = conns[--nconn];
			/* ctxs added by accept_hello are polled next round; k0 bounds this one */
			for (int k = 0; k < k0 && k < nctx; k++, i += 2) {
				struct ctx *c = ctxs[k];

				if (pf[i].revents & POLLIN) {
					struct uffd_msg m;

					while (read(c->fd, &m, sizeof(m)) == sizeof(m))
						handle_msg(c, &m);
				}
				if (c->chan >= 0 && (pf[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) {
					char b = 0;

					if (read(c->chan, &b, 1) == 1 && b == 'R') {
						b = register_process(c) ? 'E' : 'A';
						if (write(c->chan, &b, 1) != 1)
							error_("answering pid %d: %s", c->pid, strerror(errno));
					}
					close(c->chan);
					c->chan = -1;
				}
			}
			for (int k = 0; k < nctx; k++) /* tasks whose restore failed */
				if (!ctxs[k]->registered && ctxs[k]->chan < 0)
					ctx_free(k--);
		}
		if (now() - last_gc > 2) {
			last_gc = now();
			for (int k = 0; k < nctx; k++)
				if (ctxs[k]->registered && ctx_dead(ctxs[k]))
					ctx_free(k--);
		}
		if (now() - last_state > 1) {
			last_state = now();
			write_state();
		}
	}
	write_state();
	return 0;
}

/* the guard: holds a duplicate of every userfaultfd and waits for the worker */
static int guard(pid_t worker_pid, int sk)
{
	int *held = NULL, *ids = NULL, nheld = 0, capheld = 0;
	sigset_t set;
	int sfd;

	sigemptyset(&set);
	sigaddset(&set, SIGCHLD);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	sigprocmask(SIG_BLOCK, &set, NULL);
	sfd = signalfd(-1, &set, SFD_CLOEXEC);
	for (;;) {
		struct pollfd pf[2] = { { sk, POLLIN, 0 }, { sfd, POLLIN, 0 } };
		int status;

		if (poll(pf, 2, -1) < 0)
			continue;
		if (pf[1].revents & POLLIN) {
			struct signalfd_siginfo si;

			if (read(sfd, &si, sizeof(si)) == sizeof(si) && si.ssi_signo != SIGCHLD) {
				/* normal stop: the worker exits, the clone is left alone */
				kill(worker_pid, SIGTERM);
				waitpid(worker_pid, NULL, 0);
				return 0;
			}
		}
		if (waitpid(worker_pid, &status, WNOHANG) == worker_pid) {
			char why[128];

			if (WIFSIGNALED(status))
				snprintf(why, sizeof(why), "the monitor's worker process was killed by signal %d (%s)",
					 WTERMSIG(status), strsignal(WTERMSIG(status)));
			else
				snprintf(why, sizeof(why), "the monitor's worker process exited with status %d",
					 WEXITSTATUS(status));
			if (wp_mode)
				/* write tracking only: closing the userfaultfds drops it, the clone runs on */
				logf_("%s; write tracking of the clone ends (its next snapshots are full dumps)", why);
			else if (nheld)
				report("guard", why);
			else
				logf_("%s; it served no process", why);
			return 1;
		}
		if (pf[0].revents & POLLIN) {
			struct gmsg m;
			char cbuf[CMSG_SPACE(sizeof(int))];
			struct iovec iov = { &m, sizeof(m) };
			struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
					     .msg_controllen = sizeof(cbuf) };

			if (recvmsg(sk, &mh, MSG_CMSG_CLOEXEC) != sizeof(m))
				continue;
			if (m.op == 'A') {
				struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
				int fd;

				if (!cm || cm->cmsg_type != SCM_RIGHTS)
					continue;
				memcpy(&fd, CMSG_DATA(cm), sizeof(int));
				if (nheld == capheld) {
					capheld = capheld ? capheld * 2 : 16;
					held = realloc(held, capheld * sizeof(int));
					ids = realloc(ids, capheld * sizeof(int));
				}
				held[nheld] = fd;
				ids[nheld++] = m.id;
			} else if (m.op == 'D') {
				for (int i = 0; i < nheld; i++)
					if (ids[i] == m.id) {
						close(held[i]);
						held[i] = held[--nheld];
						ids[i] = ids[nheld];
						break;
					}
			}
		}
	}
}

/* --probe-wp: asynchronous write-protect on anonymous memory, and PAGEMAP_SCAN reporting it */
static int probe_wp(void)
{
	int fd = syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK), pm;
	struct uffdio_api a = { .api = UFFD_API, .features = UFFD_FEATURE_WP_ASYNC };
	struct pm_page_region r[4];
	struct pm_scan_arg_ s = { .size = sizeof(s), .vec_len = 4, .category_anyof_mask = PM_PAGE_IS_PRESENT,
				  .return_mask = PM_PAGE_IS_WRITTEN };
	char *m;
	long n;

	if (fd < 0 || ioctl(fd, UFFDIO_API, &a)) {
		printf("the kernel lacks asynchronous userfaultfd write-protect (UFFD_FEATURE_WP_ASYNC, Linux 6.7+): %s\n",
		       strerror(errno));
		return 1;
	}
	m = mmap(NULL, 2 * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	m[0] = m[PG] = 1;
	struct uffdio_register reg = { .range = { (unsigned long)m, 2 * PG }, .mode = UFFDIO_REGISTER_MODE_WP };
	pm = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
	if (ioctl(fd, UFFDIO_REGISTER, &reg) || pm < 0 || protect_present(pm, (unsigned long)m, (unsigned long)m + 2 * PG)) {
		printf("registering or write-protecting anonymous memory failed: %s\n", strerror(errno));
		return 1;
	}
	m[PG] = 2; /* async: resolved by the kernel, no message */
	s.start = (unsigned long)m;
	s.end = (unsigned long)m + 2 * PG;
	s.vec = (unsigned long)r;
	n = ioctl(pm, PAGEMAP_SCAN_, &s);
	/* expected: page 0 unwritten, page 1 written */
	if (n != 2 || (r[0].categories & PM_PAGE_IS_WRITTEN) || !(r[1].categories & PM_PAGE_IS_WRITTEN)) {
		printf("PAGEMAP_SCAN does not report written pages as expected (%ld regions)\n", n);
		return 1;
	}
	printf("ok wp-async\n");
	return 0;
}

static int probe(void)
{
	int fd = syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
	struct uffdio_api a = { .api = UFFD_API, .features = 0 };

	if (fd < 0) {
		printf("userfaultfd: %s\n", strerror(errno));
		return 1;
	}
	if (ioctl(fd, UFFDIO_API, &a)) {
		printf("UFFDIO_API: %s\n", strerror(errno));
		return 1;
	}
	if ((a.features & NEED_FEATURES) != NEED_FEATURES) {
		printf("the kernel lacks userfaultfd features 0x%llx (has 0x%llx; need minor and missing faults "
		       "on shmem and the fork, remap, remove and unmap events)\n",
		       NEED_FEATURES & ~(unsigned long long)a.features, (unsigned long long)a.features);
		return 1;
	}
	printf("ok features 0x%llx\n", (unsigned long long)a.features);
	return 0;
}

int main(int argc, char **argv)
{
	struct sockaddr_un sun = { .sun_family = AF_UNIX };
	struct stat img;
	int lsk, sv[2], one = 1;
	pid_t w;
	FILE *mm;

	if (argc == 2 && !strcmp(argv[1], "--probe"))
		return probe();
	if (argc == 2 && !strcmp(argv[1], "--probe-wp"))
		return probe_wp();
	if (argc > 1 && !strcmp(argv[1], "--wp")) {
		/* --wp SOCKET STATE REPORT CGROUP...: the share monitor's layout without IMAGES_DIR */
		static char *av[260];

		if (argc < 5 || argc > 256) {
			fprintf(stderr, "usage: bunshin-uffd-monitor --wp SOCKET STATE_FILE REPORT_FILE CGROUP_DIR...\n");
			return 2;
		}
		wp_mode = 1;
		av[0] = argv[0];
		av[1] = argv[2];
		av[2] = "/";
		for (int i = 3; i < argc; i++)
			av[i] = argv[i];
		argv = av;
	}
	if (argc < 6) {
		fprintf(stderr, "usage: bunshin-uffd-monitor --probe | SOCKET IMAGES_DIR STATE_FILE REPORT_FILE "
				"CGROUP_DIR...\n");
		return 2;
	}
	state_file = argv[3];
	report_file = argv[4];
	cg_dirs = argv + 5;
	cg_n = argc - 5;
	if (stat(argv[2], &img)) {
		perror(argv[2]);
		return 1;
	}
	img_major = major(img.st_dev);
	img_minor = minor(img.st_dev);
	mm = fopen("/proc/sys/vm/mmap_min_addr", "re");
	if (mm) {
		unsigned long v;

		if (fscanf(mm, "%lu", &v) == 1 && v > probe_addr)
			probe_addr = (v + PG - 1) & ~(PG - 1);
		fclose(mm);
	}
	if (strlen(argv[1]) >= sizeof(sun.sun_path)) {
		fprintf(stderr, "socket path too long\n");
		return 1;
	}
	strcpy(sun.sun_path, argv[1]);
	unlink(argv[1]);
	lsk = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	setsockopt(lsk, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one));
	if (lsk < 0 || bind(lsk, (struct sockaddr *)&sun, sizeof(sun)) || listen(lsk, 64)) {
		perror("listen");
		return 1;
	}
	chmod(argv[1], 0600);
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv)) {
		perror("socketpair");
		return 1;
	}
	w = fork();
	if (w < 0) {
		perror("fork");
		return 1;
	}
	if (w == 0) {
		int null = open("/dev/null", O_WRONLY | O_CLOEXEC);

		dup2(null, 1);
		close(null);
		close(sv[0]);
		guard_sk = sv[1];
		prctl(PR_SET_NAME, "uffd-monitor", 0, 0, 0);
		return worker(lsk);
	}
	close(sv[1]);
	close(lsk);
	prctl(PR_SET_NAME, "uffd-guard", 0, 0, 0);
	printf("ready %d %d\n", getpid(), w);
	fflush(stdout);
	{ /* stdout is the launcher's pipe: let go of it */
		int null = open("/dev/null", O_WRONLY | O_CLOEXEC);

		dup2(null, 1);
		close(null);
	}
	return guard(w, sv[0]);
}
