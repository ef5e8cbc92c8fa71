// SPDX-License-Identifier: Apache-2.0
/*
 * uffdsem: anonymous memory semantics a program must see, in a workspace or in its clone.
 * Runs INSIDE a workspace (built static on the host).
 *
 *   uffdsem MB READY_FILE OUT_FILE
 *
 * Maps MB MiB of private anonymous memory (plus a second, small area), fills both with a
 * pattern without zero bytes, writes READY_FILE and waits for SIGUSR1 (the test snapshots
 * and forks meanwhile). Then it checks, and writes one "name=value" line per check to
 * OUT_FILE (every value must be 0 unless named *_errno / *_rc):
 *   before_bad        bytes differing from the pattern (memory survived the restore)
 *   dontneed_nonzero  non-zero bytes after MADV_DONTNEED of the first quarter
 *   write_after_drop  a byte written after the drop reads back, the rest of its page is zero
 *   child_*           a forked child: the parent's dropped pages read zeros, the rest the
 *                     pattern, its own drop reads zeros, its writes stay its own
 *   grandchild_*      the same one generation further (fork of the fork)
 *   parent_after_child  the parent's memory is untouched by what the child did
 *   mremap_*          a range moved with mremap keeps its content; a drop in it reads zeros;
 *                     a mapping grown with mremap reads zeros past its old end (no SIGBUS)
 *   free_rc/free_errno  madvise(MADV_FREE): must fail with EINVAL (22) in a workspace
 *   free_bad          bytes lost after MADV_FREE then MADV_PAGEOUT (must be none)
 *   fixed_nonzero     anonymous memory mapped MAP_FIXED over part of the area reads zeros
 *   small_bad         the second area kept its pattern
 * then sleeps until killed. Each SIGUSR2 received before SIGUSR1 makes it fork 20 children that
 * read a page and exit (the monitor must follow and then forget them).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define PG 4096UL
#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif

static unsigned char pat(size_t i) { return (unsigned char)((i * 131 + (i >> 12) * 7 + 0x5a) | 1); }

static long bad_pattern(const unsigned char *p, size_t off, size_t len)
{
	long bad = 0;

	for (size_t i = 0; i < len; i++)
		bad += p[i] != pat(off + i);
	return bad;
}

static long nonzero(const unsigned char *p, size_t len)
{
	long n = 0;

	for (size_t i = 0; i < len; i++)
		n += p[i] != 0;
	return n;
}

static sigjmp_buf jb;
static volatile int got_sig;
static void on_sig(int s) { got_sig = s; siglongjmp(jb, 1); }

static char out[8192];
static int outn;
#define REPORT(name, val) (outn += snprintf(out + outn, sizeof(out) - outn, "%s=%ld\n", name, (long)(val)))

/* checks of a forked process; its results go through a pipe */
static void child_checks(unsigned char *p, size_t size, int fd, const char *who, int depth)
{
	char buf[2048];
	int n = 0;
	size_t q = size / 4;
	long drop_nz, own;

	size_t mine = q + (depth - 1) * 32 * PG; /* the child drops at q, the grandchild at q + 32 pages */

	n += snprintf(buf + n, sizeof(buf) - n, "%s_parent_drop_nonzero=%ld\n", who, nonzero(p, q - 2 * PG));
	if (depth == 2) /* the child's drop, inherited */
		n += snprintf(buf + n, sizeof(buf) - n, "%s_inherited_drop_nonzero=%ld\n", who, nonzero(p + q, 16 * PG));
	n += snprintf(buf + n, sizeof(buf) - n, "%s_pattern_bad=%ld\n", who,
		      bad_pattern(p + q + 16 * PG, q + 16 * PG, q - 16 * PG));
	madvise(p + mine, 16 * PG, MADV_DONTNEED);
	drop_nz = nonzero(p + mine, 16 * PG);
	n += snprintf(buf + n, sizeof(buf) - n, "%s_own_drop_nonzero=%ld\n", who, drop_nz);
	memset(p + 2 * q, 0x70 + depth, 8 * PG);
	own = 0;
	for (size_t i = 0; i < 8 * PG; i++)
		own += p[2 * q + i] != 0x70 + depth;
	n += snprintf(buf + n, sizeof(buf) - n, "%s_own_write_bad=%ld\n", who, own);
	if (depth == 1) { /* fork once more: the grandchild inherits this child's discard state */
		int pp[2];
		pid_t g;

		if (pipe(pp) == 0 && (g = fork()) == 0) {
			close(pp[0]);
			child_checks(p, size, pp[1], "grandchild", 2);
			_exit(0);
		}
		close(pp[1]);
		{
			char gb[2048];
			int k = read(pp[0], gb, sizeof(gb) - 1);
			int st;

			if (k > 0 && n + k < (int)sizeof(buf)) {
				memcpy(buf + n, gb, k);
				n += k;
			}
			waitpid(-1, &st, 0);
		}
		/* the grandchild's drop must not have touched this child's pages */
		own = 0;
		for (size_t i = 0; i < 8 * PG; i++)
			own += p[2 * q + i] != 0x71;
		n += snprintf(buf + n, sizeof(buf) - n, "%s_after_grandchild_bad=%ld\n", who,
			      (long)(nonzero(p + q, 16 * PG) + own + bad_pattern(p + q + 32 * PG, q + 32 * PG, 16 * PG)));
	}
	if (write(fd, buf, n) != n)
		_exit(3);
}

int main(int argc, char **argv)
{
	size_t size, q, small = 64 * PG;
	unsigned char *p, *s;
	sigset_t set;
	int sig;
	FILE *f;

	if (argc != 4) {
		fprintf(stderr, "usage: uffdsem MB READY_FILE OUT_FILE\n");
		return 2;
	}
	size = (size_t)atol(argv[1]) << 20;
	q = size / 4;
	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	sigaddset(&set, SIGUSR2);
	sigprocmask(SIG_BLOCK, &set, NULL);
	p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	s = mmap(NULL, small, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED || s == MAP_FAILED)
		return 1;
	for (size_t i = 0; i < size; i++)
		p[i] = pat(i);
	for (size_t i = 0; i < small; i++)
		s[i] = pat(i + 12345);
	f = fopen(argv[2], "w");
	fprintf(f, "%d\n", getpid());
	fclose(f);
	while (sigwait(&set, &sig) == 0 && sig == SIGUSR2)
		for (int k = 0; k < 20; k++) {
			pid_t c = fork();

			if (c == 0)
				_exit(p[k * PG] != pat(k * PG));
			waitpid(c, NULL, 0);
		}

	REPORT("before_bad", bad_pattern(p, 0, size));
	/* drop the first quarter (two pages short of it: those get written below) */
	madvise(p, q, MADV_DONTNEED);
	REPORT("dontneed_nonzero", nonzero(p, q - 2 * PG));
	p[q - PG + 7] = 0x44;
	REPORT("write_after_drop", (p[q - PG + 7] != 0x44) + nonzero(p + q - PG, 7) + nonzero(p + q - PG + 8, PG - 8));

	{ /* fork: the child (and its child) see the drop; their own changes stay theirs */
		int pp[2];
		pid_t c;
		char buf[4096];
		int k, st;

		if (pipe(pp))
			return 1;
		c = fork();
		if (c == 0) {
			close(pp[0]);
			child_checks(p, size, pp[1], "child", 1);
			_exit(0);
		}
		close(pp[1]);
		k = read(pp[0], buf, sizeof(buf) - 1);
		waitpid(c, &st, 0);
		if (k > 0 && outn + k < (int)sizeof(out)) {
			memcpy(out + outn, buf, k);
			outn += k;
		}
		REPORT("child_exit", WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
		REPORT("parent_after_child", bad_pattern(p + q, q, q) + bad_pattern(p + 2 * q, 2 * q, 8 * PG));
	}

	{ /* mremap: move 64 pages of the third quarter elsewhere */
		unsigned char *dst = mmap(NULL, 64 * PG, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		unsigned char *m = mremap(p + 2 * q + 64 * PG, 64 * PG, 64 * PG, MREMAP_MAYMOVE | MREMAP_FIXED, dst);
		struct sigaction sa = { .sa_handler = on_sig };
		unsigned char *g;

		if (m == MAP_FAILED) {
			REPORT("mremap_failed", errno);
		} else {
			REPORT("mremap_moved_bad", bad_pattern(m, 2 * q + 64 * PG, 64 * PG));
			madvise(m + 8 * PG, 4 * PG, MADV_DONTNEED);
			REPORT("mremap_drop_nonzero", nonzero(m + 8 * PG, 4 * PG));
			REPORT("mremap_rest_bad", bad_pattern(m + 12 * PG, 2 * q + 76 * PG, 52 * PG));
		}
		/* grow the tail of the area (last 16 pages) to 48 pages, moving if need be */
		sigaction(SIGBUS, &sa, NULL);
		sigaction(SIGSEGV, &sa, NULL);
		g = mremap(p + size - 16 * PG, 16 * PG, 48 * PG, MREMAP_MAYMOVE);
		if (g == MAP_FAILED) {
			REPORT("mremap_grow_failed", errno);
		} else {
			long nz = -1;

			got_sig = 0;
			if (!sigsetjmp(jb, 1))
				nz = nonzero(g + 16 * PG, 32 * PG);
			REPORT("mremap_grow_signal", got_sig);
			REPORT("mremap_grow_nonzero", nz);
			REPORT("mremap_grow_old_bad", bad_pattern(g, size - 16 * PG, 16 * PG));
			g[40 * PG] = 5;
			REPORT("mremap_grow_write_bad", g[40 * PG] != 5);
		}
		signal(SIGBUS, SIG_DFL);
		signal(SIGSEGV, SIG_DFL);
	}

	{ /* MADV_FREE must fail (seccomp, EINVAL) and lose nothing, even after MADV_PAGEOUT */
		unsigned char *r = p + 3 * q;
		int rc = madvise(r, 32 * PG, MADV_FREE);

		REPORT("free_rc", rc);
		REPORT("free_errno", rc ? errno : 0);
		madvise(r, 64 * PG, MADV_PAGEOUT);
		REPORT("free_bad", bad_pattern(r, 3 * q, 64 * PG));
	}

	{ /* new anonymous memory over part of the area */
		unsigned char *x = mmap(p + 3 * q + 128 * PG, 8 * PG, PROT_READ | PROT_WRITE,
					MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);

		REPORT("fixed_nonzero", x == MAP_FAILED ? -1 : nonzero(x, 8 * PG));
		munmap(p + 3 * q + 256 * PG, 8 * PG);
		REPORT("after_munmap_bad", bad_pattern(p + 3 * q + 264 * PG, 3 * q + 264 * PG, 64 * PG));
	}
	REPORT("small_bad", bad_pattern(s, 12345, small));

	{
		char tmp[4096];

		snprintf(tmp, sizeof(tmp), "%s.tmp", argv[3]);
		f = fopen(tmp, "w");
		fputs(out, f);
		fclose(f);
		rename(tmp, argv[3]);
	}
	for (;;)
		pause();
}
