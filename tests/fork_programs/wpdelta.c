// SPDX-License-Identifier: Apache-2.0
/*
 * wpdelta: memory a snapshot of a write-tracked clone (memory modes copy, ksm) must keep.
 * Runs INSIDE a workspace (built static on the host).
 *
 *   wpdelta MB DIR
 *
 * Maps MB MiB of private anonymous memory R filled with a pattern (about 256 distinct pages, so
 * KSM has pages to merge), 64 "hot" pages H, 64 pages S of which only every other one is
 * ever touched (the others stay empty in a populated page table), then made PROT_NONE, and a
 * 32 GiB PROT_NONE reservation right after one touched read-write page (V8's and
 * PartitionAlloc's layout: a delta restore must not map it writable). Forks a helper Y that
 * overwrites the first 64 pages of its copy of R with its own pattern and waits. Writes
 * DIR/ready ("MAIN Y S-ADDRESS") and
 * waits for signals (the test snapshots the source and forks a clone meanwhile):
 *   SIGUSR1  mutate, in the clone: rewrite R[100..110), MADV_DONTNEED R[200..216), move
 *            R[300..308) onto R[400..408) with mremap (fresh zero pages mapped where they were),
 *            kill Y and fork a child C that holds R copy-on-write (taking Y's pid when the
 *            pid namespace lets it write ns_last_pid), then write DIR/mutated ("C")
 *   SIGUSR2  start writing H without pause: round r writes (r, k) into page k, then stores
 *            (r, k + 1) in a state page; writes DIR/writing
 *   SIGHUP   stop writing (DIR/paused)
 *   SIGWINCH check everything this process and C (if any) must hold, given the state page, and
 *            write one "name=value" line per check into DIR/check (every value must be 0):
 *              hot_bad, cold_bad, written_bad, dropped_nonzero, moved_bad, refilled_nonzero,
 *              child_bad (C's view of R), child_missing (C did not answer)
 *   SIGTERM  exit
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PG 4096UL
#define HOT 64

static unsigned char pat(size_t i) { return (unsigned char)((i * 131 + (i >> 12) * 7 + 0x5a) | 1); }
static unsigned char ypat(size_t i) { return (unsigned char)((i * 17 + 0x33) | 0x80); }
static unsigned char cpat(size_t i) { return (unsigned char)((i * 29 + 0x11) | 0x40); }

static volatile sig_atomic_t want_mutate, want_write, want_stop, want_check, want_exit;
static void on_sig(int s)
{
	if (s == SIGUSR1)
		want_mutate = 1;
	else if (s == SIGUSR2)
		want_write = 1;
	else if (s == SIGHUP)
		want_stop = 1;
	else if (s == SIGWINCH)
		want_check = 1;
	else
		want_exit = 1;
}

static const char *dir;
static void put(const char *name, const char *text)
{
	char p[512], t[520];
	int fd;

	snprintf(p, sizeof(p), "%s/%s", dir, name);
	snprintf(t, sizeof(t), "%s.tmp", p);
	fd = open(t, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text))
		_exit(3);
	close(fd);
	rename(t, p);
}

static unsigned char *R, *H, *S;
static volatile uint64_t *state; /* [0] round, [1] pages of this round written */
static size_t npages;
static int mutated;

/* what page p of R must hold in the process that did (or inherited) the mutation */
static long check_cold(const unsigned char *r, int after_mutation, long *written, long *dropped, long *moved,
		       long *refilled)
{
	long bad = 0;

	for (size_t p = 0; p < npages; p++) {
		const unsigned char *pg = r + p * PG;

		for (size_t j = 0; j < PG; j++) {
			size_t i = p * PG + j;
			unsigned char want = pat(i);
			long *cnt = &bad;

			if (after_mutation) {
				if (p >= 100 && p < 110)
					want = cpat(i), cnt = written;
				else if (p >= 200 && p < 216)
					want = 0, cnt = dropped;
				else if (p >= 300 && p < 308)
					want = 0, cnt = refilled;
				else if (p >= 400 && p < 408)
					want = pat(i - 100 * PG), cnt = moved;
			}
			*cnt += pg[j] != want;
		}
	}
	return bad;
}

static long check_hot(void)
{
	uint64_t r = state[0], n = state[1];
	long bad = 0;

	for (uint64_t k = 0; k < HOT; k++) {
		uint64_t *pg = (uint64_t *)(H + k * PG);
		/* pages before n hold round r, the others r - 1; page n may already hold r (it is
		 * written before the state says so) */
		uint64_t want = k < n ? r : (r ? r - 1 : 0);

		if (!(pg[0] == want || (k == n && pg[0] == r)) || pg[1] != (pg[0] ? k : 0) || pg[511] != pg[0])
			bad++;
	}
	return bad;
}

static pid_t helper_y, child_c;

static void child_loop(void)
{
	/* C: on SIGWINCH, check its view of R (what its parent held at the fork) into DIR/child */
	for (;;) {
		if (want_exit)
			_exit(0);
		if (want_check) {
			long w = 0, d = 0, m = 0, f = 0, bad;
			char buf[128];

			want_check = 0;
			bad = check_cold(R, 1, &w, &d, &m, &f);
			snprintf(buf, sizeof(buf), "%ld\n", bad + w + d + m + f);
			put("child", buf);
		}
		usleep(2000);
	}
}

static void mutate(void)
{
	char buf[64];
	unsigned char *moved;
	FILE *f;

	for (size_t i = 100 * PG; i < 110 * PG; i++)
		R[i] = cpat(i);
	if (madvise(R + 200 * PG, 16 * PG, MADV_DONTNEED))
		_exit(4);
	moved = mremap(R + 300 * PG, 8 * PG, 8 * PG, MREMAP_MAYMOVE | MREMAP_FIXED, R + 400 * PG);
	if (moved != R + 400 * PG)
		_exit(5);
	if (mmap(R + 300 * PG, 8 * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) !=
	    R + 300 * PG)
		_exit(6);
	kill(helper_y, SIGKILL);
	waitpid(helper_y, NULL, 0);
	/* the child takes the pid of Y where the pid namespace allows it: the parent's images then
	 * hold a pagemap of another process under this pid */
	f = fopen("/proc/sys/kernel/ns_last_pid", "w");
	if (f) {
		fprintf(f, "%d", helper_y - 1);
		fclose(f);
	}
	child_c = fork();
	if (child_c < 0)
		_exit(7);
	if (child_c == 0)
		child_loop();
	mutated = 1;
	snprintf(buf, sizeof(buf), "%d\n", child_c);
	put("mutated", buf);
}

static void check(void)
{
	long w = 0, d = 0, m = 0, f = 0, cold, hot = check_hot(), cbad = -1;
	char buf[512], p[512];

	cold = check_cold(R, mutated, &w, &d, &m, &f);
	if (child_c > 0) {
		snprintf(p, sizeof(p), "%s/child", dir);
		unlink(p);
		kill(child_c, SIGWINCH);
		for (int i = 0; i < 5000 && cbad < 0; i++) {
			FILE *cf = fopen(p, "r");

			if (cf) {
				if (fscanf(cf, "%ld", &cbad) != 1)
					cbad = -1;
				fclose(cf);
			}
			if (cbad < 0)
				usleep(2000);
		}
	}
	snprintf(buf, sizeof(buf),
		 "hot_bad=%ld\ncold_bad=%ld\nwritten_bad=%ld\ndropped_nonzero=%ld\nmoved_bad=%ld\nrefilled_nonzero=%ld\n"
		 "child_bad=%ld\nchild_missing=%d\nrounds=%lu\n",
		 hot, cold, w, d, m, f, cbad > 0 ? cbad : 0, child_c > 0 && cbad < 0, (unsigned long)state[0]);
	put("check", buf);
}

int main(int argc, char **argv)
{
	struct sigaction sa = { .sa_handler = on_sig };
	int writing = 0;
	char buf[64];

	if (argc != 3)
		return 2;
	dir = argv[2];
	npages = (size_t)atol(argv[1]) * 256;
	if (npages < 512)
		return 2;
	R = mmap(NULL, npages * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	H = mmap(NULL, (HOT + 1) * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (R == MAP_FAILED || H == MAP_FAILED)
		return 1;
	state = (volatile uint64_t *)(H + HOT * PG);
	S = mmap(NULL, 64 * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (S == MAP_FAILED)
		return 1;
	for (int i = 0; i < 64; i += 2)
		S[i * PG] = 1;
	mprotect(S, 64 * PG, PROT_NONE);
	for (size_t i = 0; i < npages * PG; i++)
		R[i] = pat(i);
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGUSR2, &sa, NULL);
	sigaction(SIGHUP, &sa, NULL);
	sigaction(SIGWINCH, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	helper_y = fork();
	if (helper_y == 0) {
		for (size_t i = 0; i < 64 * PG; i++)
			R[i] = ypat(i);
		for (;;)
			pause();
	}
	{ /* not inherited by children (here after the fork, and MADV_DONTFORK for C): CRIU premaps
	   * an area a child inherits writable, and fails with ENOMEM on 32 GiB, delta or not */
		unsigned char *res = mmap(NULL, (32UL << 30) + PG, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

		if (res == MAP_FAILED || mprotect(res, PG, PROT_READ | PROT_WRITE) ||
		    madvise(res, (32UL << 30) + PG, MADV_DONTFORK))
			return 1;
		res[0] = 1;
	}
	snprintf(buf, sizeof(buf), "%d %d %lu\n", getpid(), helper_y, (unsigned long)S);
	put("ready", buf);
	for (;;) {
		if (want_exit) {
			if (child_c > 0)
				kill(child_c, SIGTERM);
			return 0;
		}
		if (want_mutate) {
			want_mutate = 0;
			mutate();
		}
		if (want_write) {
			want_write = 0;
			writing = 1;
			put("writing", "1\n");
		}
		if (want_stop) {
			want_stop = 0;
			writing = 0;
			put("paused", "1\n");
		}
		if (want_check) {
			want_check = 0;
			check();
		}
		if (writing) {
			/* one pass over H per round; the state page says how far this round got */
			uint64_t r = state[0] + 1;

			for (uint64_t k = 0; k < HOT && !want_stop && !want_check; k++) {
				uint64_t *pg = (uint64_t *)(H + k * PG);

				if (k == 0) { /* round r begins: no page of it written yet */
					state[1] = 0;
					state[0] = r;
				}
				__atomic_thread_fence(__ATOMIC_SEQ_CST);
				pg[0] = r;
				pg[1] = k;
				pg[511] = r;
				__atomic_thread_fence(__ATOMIC_SEQ_CST);
				state[1] = k + 1;
			}
			continue;
		}
		usleep(2000);
	}
}
