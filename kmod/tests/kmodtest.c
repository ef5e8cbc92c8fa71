// SPDX-License-Identifier: GPL-2.0
/*
 * In-VM tests and benchmark for bunshin_share.ko.  Built static, runs as /init's
 * child inside the test VM.  Usage:
 *   kmodtest test            functional tests, prints "TEST <name> PASS|FAIL|SKIP"
 *   kmodtest bench <MiB>     share vs copy timing, prints a table and BENCH_JSON
 * The source processes (S, and D when D is not the caller) are forked "servers"
 * that execute memory commands sent over a pipe, so every write in S is a real
 * store by S, taking the kernel's own copy-on-write fault.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bunshin_share.h"

#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif
#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

#define PG 4096UL
#define HP (2UL << 20)
#define WORDS (PG / 8)

static int devfd = -1;
static int failures, passes, skips;
static int cur_fail;
static const char *cur_name;

#define CHECK(cond, ...) do {						\
		if (!(cond)) {						\
			printf("  check failed (%s:%d): %s: ", cur_name, __LINE__, #cond); \
			printf(__VA_ARGS__);				\
			printf("\n");					\
			cur_fail = 1;					\
		}							\
	} while (0)

static void begin(const char *name)
{
	cur_name = name;
	cur_fail = 0;
	printf("RUN  %s\n", name);
	fflush(stdout);
}

static void end(void)
{
	printf("TEST %s %s\n", cur_name, cur_fail ? "FAIL" : "PASS");
	fflush(stdout);
	if (cur_fail)
		failures++;
	else
		passes++;
}

static void skip(const char *why)
{
	printf("TEST %s SKIP (%s)\n", cur_name, why);
	fflush(stdout);
	skips++;
}

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t pat(uint64_t seed, uint64_t page, uint64_t word)
{
	return (seed * 0x9E3779B97F4A7C15ULL) ^ (page << 20) ^ word ^ 0x5a5a000000000000ULL;
}

static int pidfd_open(pid_t pid)
{
	return syscall(SYS_pidfd_open, pid, 0);
}

/* ---- share ioctl ---- */
static struct bunshin_share_req last_req;

static int share(int src_pidfd, int dst_pidfd, uint64_t start, uint64_t len)
{
	struct bunshin_share_req r;

	memset(&r, 0, sizeof(r));
	r.src_pidfd = src_pidfd;
	r.dst_pidfd = dst_pidfd;
	r.start = start;
	r.length = len;
	if (ioctl(devfd, BUNSHIN_SHARE_IOC_SHARE, &r) < 0)
		return -errno;
	last_req = r;
	return 0;
}

/* ---- server processes ---- */
enum { OP_MMAP = 1, OP_FILL, OP_FILLCONST, OP_READ, OP_WRITE, OP_MUNMAP, OP_MADVISE,
       OP_MLOCK, OP_MMAPFILE, OP_VERIFY, OP_MREMAP, OP_EXIT };

struct cmd { int op; uint64_t a, b, c, d; };
struct resp { int64_t ret; uint64_t val; };

struct server { pid_t pid; int pidfd; int wfd, rfd; };

static void serve(int rfd, int wfd)
{
	struct cmd c;
	struct resp r;

	while (read(rfd, &c, sizeof(c)) == sizeof(c)) {
		r.ret = 0;
		r.val = 0;
		switch (c.op) {
		case OP_MMAP: {	/* a=addr b=len c=prot d=flags */
			void *p = mmap((void *)c.a, c.b, c.c, c.d | MAP_FIXED_NOREPLACE, -1, 0);
			r.ret = p == MAP_FAILED ? -errno : 0;
			break;
		}
		case OP_MMAPFILE: { /* a=addr b=len */
			int fd = open("/testfile", O_RDWR);
			void *p = fd < 0 ? MAP_FAILED :
				mmap((void *)c.a, c.b, PROT_READ | PROT_WRITE,
				     MAP_PRIVATE | MAP_FIXED_NOREPLACE, fd, 0);
			r.ret = p == MAP_FAILED ? -errno : 0;
			if (fd >= 0)
				close(fd);
			break;
		}
		case OP_FILL: { /* a=addr b=npages c=seed d=hole modulus (0: none) */
			for (uint64_t p = 0; p < c.b; p++) {
				uint64_t *w = (uint64_t *)(c.a + p * PG);

				if (c.d && p % c.d == 3)
					continue;
				for (uint64_t i = 0; i < WORDS; i++)
					w[i] = pat(c.c, p, i);
			}
			break;
		}
		case OP_FILLCONST: /* a=addr b=npages c=byte */
			memset((void *)c.a, (int)c.c, c.b * PG);
			break;
		case OP_VERIFY: { /* a=addr b=npages c=seed d=hole modulus; val=bad pages */
			for (uint64_t p = 0; p < c.b; p++) {
				uint64_t *w = (uint64_t *)(c.a + p * PG);
				int hole = c.d && p % c.d == 3;

				for (uint64_t i = 0; i < WORDS; i++)
					if (w[i] != (hole ? 0 : pat(c.c, p, i))) {
						r.val++;
						break;
					}
			}
			break;
		}
		case OP_READ:
			r.val = *(volatile uint64_t *)c.a;
			break;
		case OP_WRITE:
			*(volatile uint64_t *)c.a = c.b;
			break;
		case OP_MUNMAP:
			r.ret = munmap((void *)c.a, c.b) ? -errno : 0;
			break;
		case OP_MADVISE:
			r.ret = madvise((void *)c.a, c.b, (int)c.c) ? -errno : 0;
			break;
		case OP_MREMAP: { /* a=old b=len c=new */
			void *p = mremap((void *)c.a, c.b, c.b, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)c.c);
			r.ret = p == MAP_FAILED ? -errno : 0;
			break;
		}
		case OP_MLOCK:
			r.ret = mlock((void *)c.a, c.b) ? -errno : 0;
			break;
		case OP_EXIT:
			_exit(0);
		}
		if (write(wfd, &r, sizeof(r)) != sizeof(r))
			_exit(3);
	}
	_exit(0);
}

static struct server spawn(void)
{
	struct server s;
	int c2s[2], s2c[2];

	if (pipe(c2s) || pipe(s2c)) {
		perror("pipe");
		exit(2);
	}
	s.pid = fork();
	if (s.pid < 0) {
		perror("fork");
		exit(2);
	}
	if (s.pid == 0) {
		close(c2s[1]);
		close(s2c[0]);
		serve(c2s[0], s2c[1]);
	}
	close(c2s[0]);
	close(s2c[1]);
	s.wfd = c2s[1];
	s.rfd = s2c[0];
	s.pidfd = pidfd_open(s.pid);
	if (s.pidfd < 0) {
		perror("pidfd_open");
		exit(2);
	}
	return s;
}

static struct resp call(struct server *s, int op, uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
	struct cmd cm = { op, a, b, c, d };
	struct resp r = { -EPIPE, 0 };

	if (write(s->wfd, &cm, sizeof(cm)) != sizeof(cm))
		return r;
	if (op == OP_EXIT)
		return (struct resp){ 0, 0 };
	if (read(s->rfd, &r, sizeof(r)) != sizeof(r))
		r.ret = -EPIPE;
	return r;
}

static void stop(struct server *s)
{
	call(s, OP_EXIT, 0, 0, 0, 0);
	waitpid(s->pid, NULL, 0);
	close(s->wfd);
	close(s->rfd);
	close(s->pidfd);
}

/* ---- /proc helpers ---- */
static uint64_t pagemap(pid_t pid, uint64_t addr)
{
	char path[64];
	uint64_t e = 0;
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/pagemap", pid);
	fd = open(path, O_RDONLY);
	if (fd < 0)
		return 0;
	if (pread(fd, &e, 8, (addr / PG) * 8) != 8)
		e = 0;
	close(fd);
	return e;
}

#define PM_PRESENT (1ULL << 63)
#define PM_SWAP (1ULL << 62)
#define PM_PFN(e) ((e) & ((1ULL << 55) - 1))

/* value (kB) of `key` in the smaps entry of the VMA starting at addr */
static long smaps_kb(pid_t pid, uint64_t addr, const char *key)
{
	char path[64], line[256], hdr[32];
	int in = 0;
	long v = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/smaps", pid);
	snprintf(hdr, sizeof(hdr), "%" PRIx64 "-", addr);
	f = fopen(path, "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		if (strchr(line, '-') && !strchr(line, ':') ) {
			in = 0;
		}
		if (!strncmp(line, hdr, strlen(hdr)))
			in = 1;
		else if (in && !strncmp(line, key, strlen(key)) && line[strlen(key)] == ':') {
			v = strtol(line + strlen(key) + 1, NULL, 10);
			break;
		}
	}
	fclose(f);
	return v;
}

static int write_file(const char *path, const char *val)
{
	int fd = open(path, O_WRONLY);
	int ok;

	if (fd < 0)
		return -1;
	ok = write(fd, val, strlen(val)) == (ssize_t)strlen(val);
	close(fd);
	return ok ? 0 : -1;
}

static long read_long(const char *path)
{
	char buf[64] = "";
	int fd = open(path, O_RDONLY);

	if (fd < 0)
		return -1;
	if (read(fd, buf, sizeof(buf) - 1) < 0)
		buf[0] = 0;
	close(fd);
	return strtol(buf, NULL, 10);
}

static void *dmap(uint64_t addr, uint64_t len, int prot, int advice)
{
	void *p = mmap((void *)addr, len, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);

	if (p == MAP_FAILED) {
		printf("  dmap %#" PRIx64 " failed: %s\n", addr, strerror(errno));
		exit(2);
	}
	if (advice >= 0)
		madvise(p, len, advice);
	return p;
}

/* number of pages in [addr, addr+n pages) of the caller not matching pattern */
static int verify_local(uint64_t addr, uint64_t npages, uint64_t seed, uint64_t hole)
{
	int bad = 0;

	for (uint64_t p = 0; p < npages; p++) {
		uint64_t *w = (uint64_t *)(addr + p * PG);
		int h = hole && p % hole == 3;

		for (uint64_t i = 0; i < WORDS; i++)
			if (w[i] != (h ? 0 : pat(seed, p, i))) {
				bad++;
				break;
			}
	}
	return bad;
}

#define BASE(i) (0x200000000000ULL + (uint64_t)(i) * 0x40000000ULL)
#define RW (PROT_READ | PROT_WRITE)
#define PA (MAP_PRIVATE | MAP_ANONYMOUS)

/* ---- tests ---- */

static void test_basic(void)
{
	const uint64_t A = BASE(1), N = 64;
	struct server s = spawn();
	uint64_t *d;
	struct resp r;
	int same = 0, holes_ok = 1;
	long rss, pss;

	begin("share_basic");
	r = call(&s, OP_MMAP, A, N * PG, RW, PA);
	CHECK(r.ret == 0, "S mmap %" PRId64, r.ret);
	call(&s, OP_MADVISE, A, N * PG, MADV_NOHUGEPAGE, 0);
	call(&s, OP_FILL, A, N, 1, 8);
	d = dmap(A, N * PG, RW, MADV_NOHUGEPAGE);
	CHECK(share(s.pidfd, -1, A, N * PG) == 0, "share: %s", strerror(errno));
	CHECK(last_req.pages_mapped == N - N / 8, "pages_mapped=%llu", (unsigned long long)last_req.pages_mapped);
	/* page frames first: reading a hole in D maps the zero page */
	for (uint64_t p = 0; p < N; p++) {
		uint64_t es = pagemap(s.pid, A + p * PG), ed = pagemap(getpid(), A + p * PG);

		if (p % 8 == 3) {
			if ((es | ed) & PM_PRESENT)
				holes_ok = 0;
		} else if ((es & PM_PRESENT) && (ed & PM_PRESENT) && PM_PFN(es) == PM_PFN(ed) && PM_PFN(es))
			same++;
	}
	CHECK(same == N - N / 8, "pages with equal PFN in S and D: %d", same);
	CHECK(holes_ok, "a page not present in S became present");
	CHECK(verify_local(A, N, 1, 8) == 0, "D content differs from S");
	rss = smaps_kb(getpid(), A, "Rss");
	pss = smaps_kb(getpid(), A, "Pss");
	printf("  D smaps: Rss %ld kB Pss %ld kB (56 pages shared with S)\n", rss, pss);
	CHECK(rss == (long)(N - N / 8) * 4 && pss * 2 == rss, "Rss %ld Pss %ld", rss, pss);
	end();

	begin("write_in_D_private");
	d[0] = 0xdddd;
	CHECK(d[0] == 0xdddd, "D lost its write");
	r = call(&s, OP_READ, A, 0, 0, 0);
	CHECK(r.val == pat(1, 0, 0), "S sees D's write: %#" PRIx64, r.val);
	CHECK(PM_PFN(pagemap(getpid(), A)) != PM_PFN(pagemap(s.pid, A)), "page 0 still same frame");
	CHECK(PM_PFN(pagemap(getpid(), A + PG)) == PM_PFN(pagemap(s.pid, A + PG)), "untouched page 1 no longer shared");
	CHECK(d[1] == pat(1, 0, 1), "rest of D's copied page wrong");
	end();

	begin("write_in_S_private");
	call(&s, OP_WRITE, A + PG, 0x5555, 0, 0);
	r = call(&s, OP_READ, A + PG, 0, 0, 0);
	CHECK(r.val == 0x5555, "S lost its write");
	CHECK(d[WORDS] == pat(1, 1, 0), "D sees S's write: %#" PRIx64, d[WORDS]);
	CHECK(PM_PFN(pagemap(getpid(), A + 5 * PG)) == PM_PFN(pagemap(s.pid, A + 5 * PG)), "untouched page 5 no longer shared");
	end();

	begin("madv_dontneed_in_D_zeroes");
	CHECK(madvise((void *)(A + 2 * PG), PG, MADV_DONTNEED) == 0, "madvise: %s", strerror(errno));
	{
		int nz = 0;

		for (uint64_t i = 0; i < WORDS; i++)
			nz += d[2 * WORDS + i] != 0;
		CHECK(nz == 0, "%d non-zero words after MADV_DONTNEED", nz);
	}
	r = call(&s, OP_READ, A + 2 * PG + 8, 0, 0, 0);
	CHECK(r.val == pat(1, 2, 1), "S changed by D's MADV_DONTNEED");
	end();

	begin("madv_free_in_D");
	CHECK(madvise((void *)(A + 4 * PG), PG, MADV_FREE) == 0, "madvise: %s", strerror(errno));
	{
		uint64_t w1 = d[4 * WORDS + 1];

		CHECK(w1 == 0 || w1 == pat(1, 4, 1), "after MADV_FREE got %#" PRIx64, w1);
		d[4 * WORDS] = 0x4444;
		CHECK(d[4 * WORDS] == 0x4444, "write after MADV_FREE lost");
	}
	r = call(&s, OP_READ, A + 4 * PG, 0, 0, 0);
	CHECK(r.val == pat(1, 4, 0), "S changed by D's MADV_FREE + write");
	end();

	begin("write_into_hole");
	d[3 * WORDS] = 0x3333;
	r = call(&s, OP_READ, A + 3 * PG, 0, 0, 0);
	CHECK(r.val == 0, "S sees D's write into a hole");
	CHECK(d[3 * WORDS] == 0x3333 && d[3 * WORDS + 1] == 0, "D's hole page");
	end();

	begin("unmap_S_keeps_D");
	r = call(&s, OP_MUNMAP, A, N * PG, 0, 0);
	CHECK(r.ret == 0, "S munmap %" PRId64, r.ret);
	stop(&s);
	{
		int bad = 0;

		for (uint64_t p = 5; p < N; p++) {
			if (p % 8 == 3)
				continue;
			for (uint64_t i = 0; i < WORDS; i++)
				if (d[p * WORDS + i] != pat(1, p, i)) {
					bad++;
					break;
				}
		}
		CHECK(bad == 0, "%d pages of D wrong after S unmapped and exited", bad);
	}
	for (uint64_t p = 5; p < N; p++)
		d[p * WORDS] = p;	/* now exclusive: write reuses the page */
	CHECK(d[63 * WORDS] == 63, "write after S exit");
	munmap(d, N * PG);
	end();
}

static void test_third_party(void)
{
	const uint64_t A = BASE(2), N = 32;
	struct server s = spawn(), t = spawn();
	struct resp r;

	begin("share_between_two_other_processes");
	call(&s, OP_MMAP, A, N * PG, RW, PA);
	call(&s, OP_FILL, A, N, 2, 0);
	r = call(&t, OP_MMAP, A, N * PG, RW, PA);
	CHECK(r.ret == 0, "D mmap");
	CHECK(share(s.pidfd, t.pidfd, A, N * PG) == 0, "share: %s", strerror(errno));
	r = call(&t, OP_VERIFY, A, N, 2, 0);
	CHECK(r.val == 0, "%" PRIu64 " pages differ in D", r.val);
	call(&t, OP_WRITE, A, 7, 0, 0);
	r = call(&s, OP_READ, A, 0, 0, 0);
	CHECK(r.val == pat(2, 0, 0), "S sees D's write");
	stop(&s);
	r = call(&t, OP_READ, A + PG, 0, 0, 0);
	CHECK(r.val == pat(2, 1, 0), "D page 1 after S exited: %#" PRIx64, r.val);
	r = call(&t, OP_READ, A, 0, 0, 0);
	CHECK(r.val == 7, "D page 0 lost D's write");
	stop(&t);
	end();
}

static int thp_enabled(void)
{
	char buf[128] = "";
	int fd = open("/sys/kernel/mm/transparent_hugepage/enabled", O_RDONLY);

	if (fd < 0)
		return 0;
	if (read(fd, buf, sizeof(buf) - 1) < 0)
		buf[0] = 0;
	close(fd);
	return strstr(buf, "[always]") || strstr(buf, "[madvise]");
}

static void test_thp(void)
{
	const uint64_t A = BASE(3), B = BASE(4), N = 8 * HP / PG;
	struct server s;
	struct resp r;
	uint64_t *d;
	long ahp;

	begin("thp_shared_as_huge");
	if (!thp_enabled()) {
		skip("THP disabled");
		return;
	}
	s = spawn();
	call(&s, OP_MMAP, A, 8 * HP, RW, PA);
	call(&s, OP_MADVISE, A, 8 * HP, MADV_HUGEPAGE, 0);
	call(&s, OP_FILL, A, N, 3, 0);
	ahp = smaps_kb(s.pid, A, "AnonHugePages");
	printf("  S AnonHugePages %ld kB\n", ahp);
	CHECK(ahp >= 2048, "S got no THP (%ld kB)", ahp);
	d = dmap(A, 8 * HP, RW, MADV_HUGEPAGE);
	CHECK(share(s.pidfd, -1, A, 8 * HP) == 0, "share: %s", strerror(errno));
	CHECK(last_req.pages_mapped == N, "pages_mapped=%llu", (unsigned long long)last_req.pages_mapped);
	ahp = smaps_kb(getpid(), A, "AnonHugePages");
	printf("  D AnonHugePages %ld kB after share\n", ahp);
	CHECK(ahp >= 2048, "D did not get huge mappings (%ld kB)", ahp);
	CHECK(verify_local(A, N, 3, 0) == 0, "D content differs");
	CHECK(PM_PFN(pagemap(getpid(), A + 3 * PG)) == PM_PFN(pagemap(s.pid, A + 3 * PG)), "THP subpage not shared");
	d[0] = 1;
	r = call(&s, OP_READ, A, 0, 0, 0);
	CHECK(r.val == pat(3, 0, 0), "S sees D's write into THP");
	call(&s, OP_WRITE, A + HP, 2, 0, 0);
	CHECK(d[HP / 8] == pat(3, HP / PG, 0), "D sees S's write into THP");
	{
		/* pages past the two written huge pages are still intact */
		int bad = 0;

		for (uint64_t p = 2 * HP / PG; p < N; p++)
			for (uint64_t i = 0; i < WORDS; i += 64)
				if (d[p * WORDS + i] != pat(3, p, i))
					bad++;
		CHECK(bad == 0, "%d words wrong after CoW of other huge pages", bad);
	}
	r = call(&s, OP_READ, A + 5 * HP + 8, 0, 0, 0);
	CHECK(r.val == pat(3, 5 * HP / PG, 1), "S content after D's CoW");
	munmap(d, 8 * HP);
	end();

	begin("thp_subrange_split");
	call(&s, OP_MMAP, B, 8 * HP, RW, PA);
	call(&s, OP_MADVISE, B, 8 * HP, MADV_HUGEPAGE, 0);
	call(&s, OP_FILL, B, N, 4, 0);
	{
		const uint64_t off = HP / 2, len = 4 * HP;	/* [B+1M, B+9M) */
		uint64_t bad = 0;

		d = dmap(B + off, len, RW, MADV_HUGEPAGE);
		CHECK(share(s.pidfd, -1, B + off, len) == 0, "share: %s", strerror(errno));
		CHECK(last_req.pages_mapped == len / PG, "pages_mapped=%llu", (unsigned long long)last_req.pages_mapped);
		for (uint64_t p = 0; p < len / PG; p++)
			for (uint64_t i = 0; i < WORDS; i += 16)
				if (d[p * WORDS + i] != pat(4, p + off / PG, i))
					bad++;
		CHECK(bad == 0, "%" PRIu64 " words differ in the sub-range", bad);
		r = call(&s, OP_VERIFY, B, N, 4, 0);
		CHECK(r.val == 0, "S corrupted by the split: %" PRIu64 " pages", r.val);
		d[0] = 9;
		r = call(&s, OP_READ, B + off, 0, 0, 0);
		CHECK(r.val == pat(4, off / PG, 0), "S sees D's write");
		munmap(d, len);
	}
	stop(&s);
	end();
}

static void test_ksm(void)
{
	const uint64_t A = BASE(5), N = 32;
	struct server s;
	struct resp r;
	uint64_t *d;
	double t0;
	int merged = 0;

	begin("ksm_pages");
	if (write_file("/sys/kernel/mm/ksm/pages_to_scan", "5000") ||
	    write_file("/sys/kernel/mm/ksm/sleep_millisecs", "10") ||
	    write_file("/sys/kernel/mm/ksm/run", "1")) {
		skip("no KSM");
		return;
	}
	s = spawn();
	call(&s, OP_MMAP, A, N * PG, RW, PA);
	call(&s, OP_MADVISE, A, N * PG, MADV_NOHUGEPAGE, 0);
	call(&s, OP_FILLCONST, A, N, 0x6b, 0);
	r = call(&s, OP_MADVISE, A, N * PG, MADV_MERGEABLE, 0);
	CHECK(r.ret == 0, "MADV_MERGEABLE %" PRId64, r.ret);
	t0 = now();
	while (now() - t0 < 60) {
		uint64_t e0 = pagemap(s.pid, A), e1 = pagemap(s.pid, A + 7 * PG);

		if (PM_PFN(e0) && PM_PFN(e0) == PM_PFN(e1)) {
			merged = 1;
			break;
		}
		usleep(100000);
	}
	printf("  KSM merged S's pages: %s after %.1f s, pages_sharing=%ld\n", merged ? "yes" : "no",
	       now() - t0, read_long("/sys/kernel/mm/ksm/pages_sharing"));
	CHECK(merged, "ksmd did not merge");
	d = dmap(A, N * PG, RW, MADV_NOHUGEPAGE);
	CHECK(share(s.pidfd, -1, A, N * PG) == 0, "share: %s", strerror(errno));
	CHECK(PM_PFN(pagemap(getpid(), A + 3 * PG)) == PM_PFN(pagemap(s.pid, A)), "D does not map the KSM page");
	{
		int bad = 0;

		for (uint64_t i = 0; i < N * WORDS; i++)
			bad += d[i] != 0x6b6b6b6b6b6b6b6bULL;
		CHECK(bad == 0, "%d words differ", bad);
	}
	d[0] = 1;
	r = call(&s, OP_READ, A, 0, 0, 0);
	CHECK(r.val == 0x6b6b6b6b6b6b6b6bULL, "S sees D's write to a KSM page");
	CHECK(d[WORDS] == 0x6b6b6b6b6b6b6b6bULL, "neighbour changed");
	/* unmerge everything: ksmd walks the stable tree and the rmap */
	write_file("/sys/kernel/mm/ksm/run", "2");
	r = call(&s, OP_READ, A + 5 * PG, 0, 0, 0);
	CHECK(r.val == 0x6b6b6b6b6b6b6b6bULL, "S content after unmerge");
	CHECK(d[5 * WORDS] == 0x6b6b6b6b6b6b6b6bULL, "D content after unmerge");
	stop(&s);
	CHECK(d[9 * WORDS] == 0x6b6b6b6b6b6b6b6bULL, "D content after S exit");
	write_file("/sys/kernel/mm/ksm/run", "0");
	munmap(d, N * PG);
	end();
}

static void test_swap(void)
{
	const uint64_t A = BASE(6), N = 64;
	struct server s;
	struct resp r;
	int swapped = 0;

	begin("swap_entries");
	if (access("/tmp/swap_on", F_OK)) {
		CHECK(0, "no swap device was set up by /init");
		end();
		return;
	}
	s = spawn();
	call(&s, OP_MMAP, A, N * PG, RW, PA);
	call(&s, OP_MADVISE, A, N * PG, MADV_NOHUGEPAGE, 0);
	call(&s, OP_FILL, A, N, 6, 0);
	r = call(&s, OP_MADVISE, A, N / 2 * PG, MADV_PAGEOUT, 0);
	CHECK(r.ret == 0, "MADV_PAGEOUT %" PRId64, r.ret);
	for (uint64_t p = 0; p < N; p++)
		swapped += !!(pagemap(s.pid, A + p * PG) & PM_SWAP);
	printf("  %d of %" PRIu64 " S pages in swap before sharing\n", swapped, N);
	CHECK(swapped > 0, "nothing swapped out");
	dmap(A, N * PG, RW, MADV_NOHUGEPAGE);
	CHECK(share(s.pidfd, -1, A, N * PG) == 0, "share: %s", strerror(errno));
	printf("  pages_mapped=%llu swap_shared=%llu\n", (unsigned long long)last_req.pages_mapped,
	       (unsigned long long)last_req.swap_shared);
	CHECK(last_req.swap_shared == (uint64_t)swapped, "swap_shared %llu", (unsigned long long)last_req.swap_shared);
	CHECK(verify_local(A, N, 6, 0) == 0, "D content differs (swap-in through D)");
	*(uint64_t *)A = 1;
	r = call(&s, OP_VERIFY, A, N, 6, 0);
	CHECK(r.val == 0, "S content differs: %" PRIu64 " pages", r.val);
	stop(&s);
	munmap((void *)A, N * PG);
	end();
}


/*
 * Page migration has to find and unmap every PTE of a page through the rmap.
 * If D's mapping were invisible to the rmap, migrating a shared page would
 * fail (or leave D on the old frame).  Moving S's shared pages to NUMA node 1
 * must move D's view too: both keep mapping one frame, now a new one.
 */
static int move_pages_to(pid_t pid, uint64_t addr, uint64_t n, int node, int *status)
{
	void *pages[64];
	int nodes[64];

	for (uint64_t i = 0; i < n; i++) {
		pages[i] = (void *)(addr + i * PG);
		nodes[i] = node;
		status[i] = -1;
	}
	return syscall(SYS_move_pages, pid, n, pages, nodes, status, 4 /* MPOL_MF_MOVE_ALL */);
}

static void rmap_migration_check(struct server *s, uint64_t A, uint64_t n, uint64_t seed, const char *what)
{
	uint64_t before[64];
	int status[64], moved = 0, bad = 0, rc;

	void *first = (void *)A;
	int from = -1, to;

	for (uint64_t p = 0; p < n; p++)
		before[p] = PM_PFN(pagemap(s->pid, A + p * PG));
	/* S faulted its pages on the node of the CPU it ran on: move them to the other node
	 * (a move to the node they are on is a no-op that changes no frame) */
	rc = syscall(SYS_move_pages, s->pid, 1, &first, NULL, &from, 0);
	CHECK(rc == 0 && from >= 0, "%s: move_pages query: %s (node %d)", what, strerror(errno), from);
	to = from == 1 ? 0 : 1;
	rc = move_pages_to(s->pid, A, n, to, status);
	CHECK(rc == 0, "%s: move_pages: %s", what, strerror(errno));
	for (uint64_t p = 0; p < n; p++) {
		uint64_t es = pagemap(s->pid, A + p * PG), ed = pagemap(getpid(), A + p * PG);

		if (status[p] == to && PM_PFN(es) != before[p])
			moved++;
		if (!(es & PM_PRESENT) || !(ed & PM_PRESENT) || PM_PFN(es) != PM_PFN(ed))
			bad++;
	}
	printf("  %s: %d of %" PRIu64 " shared pages migrated from node %d to node %d (status[0]=%d), "
	       "%d not on one frame\n", what, moved, n, from, to, status[0], bad);
	CHECK(moved == (int)n, "%s: only %d pages migrated", what, moved);
	CHECK(bad == 0, "%s: %d pages of S and D no longer on the same frame", what, bad);
	CHECK(verify_local(A, n, seed, 0) == 0, "%s: D content after migration", what);
}

static void test_rmap(void)
{
	const uint64_t A = BASE(14), X = BASE(15), B = BASE(16), N = 32;
	struct server s;
	struct resp r;

	begin("rmap_finds_D_migration");
	if (access("/sys/devices/system/node/node1", F_OK)) {
		skip("VM has one NUMA node");
		return;
	}
	s = spawn();
	call(&s, OP_MMAP, A, N * PG, RW, PA);
	call(&s, OP_MADVISE, A, N * PG, MADV_NOHUGEPAGE, 0);
	call(&s, OP_FILL, A, N, 14, 0);
	dmap(A, N * PG, RW, MADV_NOHUGEPAGE);
	CHECK(share(s.pidfd, -1, A, N * PG) == 0, "share: %s", strerror(errno));
	rmap_migration_check(&s, A, N, 14, "same pgoff");
	/* still copy-on-write after migration */
	*(uint64_t *)A = 1;
	r = call(&s, OP_READ, A, 0, 0, 0);
	CHECK(r.val == pat(14, 0, 0), "S sees D's write after migration");
	munmap((void *)A, N * PG);
	end();

	begin("rmap_mremapped_source_pgoff");
	/* S's VMA was moved by mremap: its vm_pgoff no longer matches its address */
	call(&s, OP_MMAP, X, N * PG, RW, PA);
	call(&s, OP_MADVISE, X, N * PG, MADV_NOHUGEPAGE, 0);
	call(&s, OP_FILL, X, N, 16, 0);
	r = call(&s, OP_MREMAP, X, N * PG, B, 0);
	CHECK(r.ret == 0, "mremap %" PRId64, r.ret);
	dmap(B, N * PG, RW, MADV_NOHUGEPAGE);
	CHECK(share(s.pidfd, -1, B, N * PG) == 0, "share: %s", strerror(errno));
	CHECK(verify_local(B, N, 16, 0) == 0, "D content");
	rmap_migration_check(&s, B, N, 16, "mremapped S");
	stop(&s);
	CHECK(verify_local(B, N, 16, 0) == 0, "D content after S exit");
	munmap((void *)B, N * PG);
	end();
}

static void test_reshare(void)
{
	const uint64_t A = BASE(17), N = 32;
	struct server s = spawn();
	uint64_t *d;
	struct resp r;

	begin("reshare_into_linked_vma");
	call(&s, OP_MMAP, A, N * PG, RW, PA);
	call(&s, OP_MADVISE, A, N * PG, MADV_NOHUGEPAGE, 0);
	call(&s, OP_FILL, A, N, 17, 0);
	d = dmap(A, N * PG, RW, MADV_NOHUGEPAGE);
	/* first half, then the second half of the same D VMA from the same S VMA */
	CHECK(share(s.pidfd, -1, A, N / 2 * PG) == 0, "first share: %s", strerror(errno));
	d[0] = 0xabc;	/* D now has a private page of its own in this VMA */
	CHECK(share(s.pidfd, -1, A + N / 2 * PG, N / 2 * PG) == 0, "second share: %s", strerror(errno));
	CHECK(last_req.pages_mapped == N / 2, "pages_mapped %llu", (unsigned long long)last_req.pages_mapped);
	CHECK(d[0] == 0xabc, "D's own page outside the second range changed");
	{
		int bad = 0;

		for (uint64_t p = 1; p < N; p++)
			for (uint64_t i = 0; i < WORDS; i++)
				bad += d[p * WORDS + i] != pat(17, p, i);
		CHECK(bad == 0, "%d words differ", bad);
	}
	/* sharing over D's own page again replaces it with S's content */
	CHECK(share(s.pidfd, -1, A, PG) == 0, "third share: %s", strerror(errno));
	CHECK(d[0] == pat(17, 0, 0), "re-shared page not S's: %#" PRIx64, d[0]);
	r = call(&s, OP_READ, A, 0, 0, 0);
	CHECK(r.val == pat(17, 0, 0), "S changed");
	stop(&s);
	munmap(d, N * PG);
	end();
}

static void expect_err(const char *what, int got, int want)
{
	printf("  %-44s -> %s (%s)\n", what, got ? strerror(-got) : "success",
	       got == -want ? "ok" : "WRONG");
	CHECK(got == -want, "%s: got %d want -%d", what, got, want);
}

static void test_errors(void)
{
	const uint64_t A = BASE(7), N = 16;
	struct server s = spawn();
	int nullfd = open("/dev/null", O_RDONLY), selfpidfd = pidfd_open(getpid());
	struct resp r;

	begin("bad_requests");
	call(&s, OP_MMAP, A, N * PG, RW, PA);
	call(&s, OP_FILL, A, N, 7, 0);

	/* wrong process */
	expect_err("src pidfd not open (9999)", share(9999, -1, A, N * PG), EBADF);
	expect_err("src fd is not a pidfd", share(nullfd, -1, A, N * PG), EBADF);
	expect_err("dst pidfd -2", share(s.pidfd, -2, A, N * PG), EBADF);
	{
		pid_t c = fork();
		int pfd;

		if (c == 0)
			_exit(0);
		pfd = pidfd_open(c);
		waitpid(c, NULL, 0);
		expect_err("src process exited and reaped", share(pfd, -1, A, N * PG), ESRCH);
		close(pfd);
	}
	expect_err("src == dst", share(selfpidfd, -1, BASE(8), PG), EINVAL);

	/* malformed */
	expect_err("unaligned start", share(s.pidfd, -1, A + 1, N * PG), EINVAL);
	expect_err("zero length", share(s.pidfd, -1, A, 0), EINVAL);
	expect_err("unaligned length", share(s.pidfd, -1, A, 100), EINVAL);
	expect_err("range wraps", share(s.pidfd, -1, ~0UL & ~(PG - 1), 2 * PG), EINVAL);
	{
		struct bunshin_share_req q = { .src_pidfd = s.pidfd, .dst_pidfd = -1, .start = A,
					       .length = PG, .flags = 1 };
		expect_err("unknown flag", ioctl(devfd, BUNSHIN_SHARE_IOC_SHARE, &q) < 0 ? -errno : 0, EINVAL);
	}
	expect_err("unknown ioctl", ioctl(devfd, _IO(0xB5, 77), 0) < 0 ? -errno : 0, ENOTTY);

	/* mismatched ranges */
	expect_err("D range not mapped", share(s.pidfd, -1, A, N * PG), ENOMEM);
	dmap(A, N / 2 * PG, RW, -1);
	expect_err("D maps only half the range", share(s.pidfd, -1, A, N * PG), ENOMEM);
	dmap(A + N / 2 * PG, N / 2 * PG, PROT_READ, -1);
	expect_err("D range spans two VMAs", share(s.pidfd, -1, A, N * PG), EINVAL);
	expect_err("S range not mapped", share(s.pidfd, -1, A + N * PG, PG), ENOMEM);
	expect_err("protections differ (D read-only)", share(s.pidfd, -1, A + N / 2 * PG, PG), EINVAL);
	munmap((void *)A, N * PG);

	/* refused mapping kinds */
	{
		const uint64_t F = BASE(9);

		r = call(&s, OP_MMAPFILE, F, 4 * PG, 0, 0);
		CHECK(r.ret == 0, "S file mmap %" PRId64, r.ret);
		dmap(F, 4 * PG, RW, -1);
		expect_err("S range is a private file mapping", share(s.pidfd, -1, F, 4 * PG), EOPNOTSUPP);
		munmap((void *)F, 4 * PG);
		{
			int fd = open("/testfile", O_RDWR);
			void *p = mmap((void *)F, 4 * PG, RW, MAP_PRIVATE | MAP_FIXED_NOREPLACE, fd, 0);

			CHECK(p != MAP_FAILED, "D file mmap");
			close(fd);
		}
		call(&s, OP_MUNMAP, F, 4 * PG, 0, 0);
		call(&s, OP_MMAP, F, 4 * PG, RW, PA);
		call(&s, OP_FILL, F, 4, 9, 0);
		expect_err("D range is a private file mapping", share(s.pidfd, -1, F, 4 * PG), EOPNOTSUPP);
		munmap((void *)F, 4 * PG);
	}
	{
		const uint64_t H = BASE(10);

		r = call(&s, OP_MMAP, H, 4 * PG, RW, MAP_SHARED | MAP_ANONYMOUS);
		CHECK(r.ret == 0, "S shared mmap");
		dmap(H, 4 * PG, RW, -1);
		expect_err("S range is shared anonymous", share(s.pidfd, -1, H, 4 * PG), EOPNOTSUPP);
		munmap((void *)H, 4 * PG);
	}
	{
		const uint64_t L = BASE(11);

		call(&s, OP_MMAP, L, 4 * PG, RW, PA);
		r = call(&s, OP_MLOCK, L, 4 * PG, 0, 0);
		CHECK(r.ret == 0, "mlock %" PRId64, r.ret);
		dmap(L, 4 * PG, RW, -1);
		expect_err("S range is mlocked", share(s.pidfd, -1, L, 4 * PG), EOPNOTSUPP);
		CHECK(mlock((void *)L, 4 * PG) == 0, "D mlock");
		call(&s, OP_MUNMAP, L, 4 * PG, 0, 0);
		call(&s, OP_MMAP, L, 4 * PG, RW, PA);
		call(&s, OP_FILL, L, 4, 11, 0);
		expect_err("D range is mlocked", share(s.pidfd, -1, L, 4 * PG), EOPNOTSUPP);
		munmap((void *)L, 4 * PG);
	}
	{
		const uint64_t T = BASE(12);
		uint64_t *d;

		call(&s, OP_MMAP, T, 4 * PG, RW, PA);
		call(&s, OP_FILL, T, 4, 12, 0);
		d = dmap(T, 4 * PG, RW, -1);
		d[0] = 1;	/* D already has anonymous memory of its own here */
		expect_err("D range already written", share(s.pidfd, -1, T, 4 * PG), EBUSY);
		CHECK(d[0] == 1, "D's memory changed by a refused request");
		munmap(d, 4 * PG);
	}
	{
		/* an unprivileged caller holding the device fd cannot reach root's S */
		const uint64_t U = BASE(13);
		pid_t c;
		int st = -1;

		call(&s, OP_MMAP, U, 4 * PG, RW, PA);
		call(&s, OP_FILL, U, 4, 13, 0);
		c = fork();
		if (c == 0) {
			int e;

			if (setresgid(65534, 65534, 65534) || setresuid(65534, 65534, 65534))
				_exit(100);
			dmap(U, 4 * PG, RW, -1);
			e = share(s.pidfd, -1, U, 4 * PG);
			_exit(e == -EACCES ? 0 : 101 + (e < 0 ? -e : 0));
		}
		waitpid(c, &st, 0);
		expect_err("unprivileged caller, root's S",
			   WIFEXITED(st) && WEXITSTATUS(st) == 0 ? -EACCES : -(WEXITSTATUS(st)), EACCES);
	}
	/* S itself is untouched by all of this */
	r = call(&s, OP_VERIFY, A, N, 7, 0);
	CHECK(r.val == 0, "S corrupted by refused requests");
	stop(&s);
	close(nullfd);
	close(selfpidfd);
	end();
}

/* ---- benchmark ---- */
static void bench(uint64_t mib)
{
	const uint64_t A = 0x300000000000ULL, C = 0x380000000000ULL, len = mib << 20, n = len / PG;
	struct server s = spawn();
	double t, t_fill, t_share, t_copy_fresh, t_copy_warm, t_cow, t_share_thp = -1, t_copy_thp = -1;
	uint64_t *d;
	long thp_kb = -1;

	printf("BENCH %" PRIu64 " MiB (%" PRIu64 " pages) in the VM\n", mib, n);
	fflush(stdout);
	call(&s, OP_MMAP, A, len, RW, PA);
	call(&s, OP_MADVISE, A, len, MADV_NOHUGEPAGE, 0);
	t = now();
	call(&s, OP_FILLCONST, A, n, 0x11, 0);
	t_fill = now() - t;
	d = dmap(A, len, RW, MADV_NOHUGEPAGE);
	t = now();
	if (share(s.pidfd, -1, A, len)) {
		printf("BENCH share failed: %s\n", strerror(errno));
		failures++;
		return;
	}
	t_share = now() - t;
	if (last_req.pages_mapped != n || d[n * WORDS - 1] != 0x1111111111111111ULL) {
		printf("BENCH share result wrong (%llu pages)\n", (unsigned long long)last_req.pages_mapped);
		failures++;
	}
	{
		void *c = dmap(C, len, RW, MADV_NOHUGEPAGE);

		t = now();
		memcpy(c, d, len);	/* into fresh anonymous memory: faults + copy */
		t_copy_fresh = now() - t;
		t = now();
		memcpy(c, d, len);	/* into already-faulted memory: copy only */
		t_copy_warm = now() - t;
		munmap(c, len);
	}
	t = now();
	for (uint64_t p = 0; p < n; p++)
		d[p * WORDS] = p;	/* every page takes its CoW fault */
	t_cow = now() - t;
	munmap(d, len);
	call(&s, OP_MUNMAP, A, len, 0, 0);

	if (thp_enabled()) {
		call(&s, OP_MMAP, A, len, RW, PA);
		call(&s, OP_MADVISE, A, len, MADV_HUGEPAGE, 0);
		call(&s, OP_FILLCONST, A, n, 0x22, 0);
		thp_kb = smaps_kb(s.pid, A, "AnonHugePages");
		d = dmap(A, len, RW, MADV_HUGEPAGE);
		t = now();
		if (share(s.pidfd, -1, A, len) == 0)
			t_share_thp = now() - t;
		{
			void *c = dmap(C, len, RW, MADV_HUGEPAGE);

			t = now();
			memcpy(c, d, len);
			t_copy_thp = now() - t;
			munmap(c, len);
		}
		munmap(d, len);
	}
	stop(&s);

	printf("\n%-44s %10s %12s %10s\n", "operation (same VM, TCG)", "seconds", "ns/4K page", "GiB/s");
#define ROW(name, sec) do { if ((sec) >= 0) printf("%-44s %10.4f %12.0f %10.2f\n", name, sec, (sec) * 1e9 / n, \
						    (double)len / (1 << 30) / (sec)); } while (0)
	ROW("S fills its memory (first touch)", t_fill);
	ROW("share into D (ioctl), 4K pages", t_share);
	ROW("memcpy into fresh anonymous memory", t_copy_fresh);
	ROW("memcpy into already-faulted memory", t_copy_warm);
	ROW("D writes every shared page (CoW faults)", t_cow);
	ROW("share into D (ioctl), THP", t_share_thp);
	ROW("memcpy into fresh memory, THP", t_copy_thp);
	printf("\nshare vs memcpy(fresh): %.1fx faster; S AnonHugePages in THP run: %ld kB\n",
	       t_copy_fresh / t_share, thp_kb);
	printf("BENCH_JSON {\"mib\": %" PRIu64 ", \"pages\": %" PRIu64 ", \"fill_s\": %.6f, \"share_4k_s\": %.6f, "
	       "\"memcpy_fresh_s\": %.6f, \"memcpy_warm_s\": %.6f, \"cow_all_pages_s\": %.6f, "
	       "\"share_thp_s\": %.6f, \"memcpy_fresh_thp_s\": %.6f, \"share_ns_per_page\": %.1f, "
	       "\"memcpy_fresh_ns_per_page\": %.1f, \"share_1gib_s_scaled\": %.6f, \"memcpy_fresh_1gib_s_scaled\": %.6f}\n",
	       mib, n, t_fill, t_share, t_copy_fresh, t_copy_warm, t_cow, t_share_thp, t_copy_thp,
	       t_share * 1e9 / n, t_copy_fresh * 1e9 / n, t_share * 1024 / mib, t_copy_fresh * 1024 / mib);
	fflush(stdout);
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	devfd = open(BUNSHIN_SHARE_DEVICE, O_RDWR | O_CLOEXEC);
	if (devfd < 0) {
		printf("cannot open %s: %s\n", BUNSHIN_SHARE_DEVICE, strerror(errno));
		printf("KMODTEST RESULT: FAIL\n");
		return 1;
	}
	if (ioctl(devfd, BUNSHIN_SHARE_IOC_VERSION) != BUNSHIN_SHARE_API) {
		printf("api version mismatch\n");
		return 1;
	}
	if (argc > 1 && !strcmp(argv[1], "bench")) {
		bench(argc > 2 ? strtoull(argv[2], NULL, 0) : 256);
	} else {
		test_basic();
		test_third_party();
		test_thp();
		test_ksm();
		test_swap();
		test_rmap();
		test_reshare();
		test_errors();
		printf("summary: %d passed, %d failed, %d skipped\n", passes, failures, skips);
	}
	printf("KMODTEST RESULT: %s\n", failures ? "FAIL" : "PASS");
	return failures ? 1 : 0;
}
