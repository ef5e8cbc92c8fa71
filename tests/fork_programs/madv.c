// SPDX-License-Identifier: Apache-2.0
/*
 * madv: checks that anonymous memory dropped with MADV_DONTNEED reads back as zeros.
 * Runs INSIDE a workspace (compiled on the host with gcc -static).
 *
 *   madv MB READY_FILE OUT_FILE
 *
 * Maps MB MiB of private anonymous memory, fills it with a pattern that has no zero byte,
 * writes its pid to READY_FILE and waits for SIGUSR1. Then (in a clone, typically) it
 *   1. counts bytes that differ from the pattern (memory must have survived the restore),
 *   2. madvise(MADV_DONTNEED)s the whole area and counts NON-zero bytes (Linux semantics:
 *      there must be none),
 *   3. writes the area again and counts mismatches,
 * writes "before_bad=N after_nonzero=N refill_bad=N" to OUT_FILE and sleeps forever.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

static unsigned char pattern(size_t i)
{
	return (unsigned char)((i * 131 + (i >> 12) * 7 + 0x5a) | 1); /* odd: never zero */
}

static void write_file(const char *path, const char *text)
{
	char tmp[4096];
	FILE *f;

	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	f = fopen(tmp, "w");
	if (!f || fputs(text, f) < 0 || fclose(f)) {
		perror(tmp);
		exit(1);
	}
	if (rename(tmp, path)) {
		perror(path);
		exit(1);
	}
}

int main(int argc, char **argv)
{
	size_t size, i;
	long before_bad = 0, after_nonzero = 0, refill_bad = 0;
	unsigned char *p;
	char buf[256];
	sigset_t set;
	int sig;

	if (argc != 4) {
		fprintf(stderr, "usage: madv MB READY_FILE OUT_FILE\n");
		return 2;
	}
	size = (size_t)atol(argv[1]) << 20;
	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	sigprocmask(SIG_BLOCK, &set, NULL);
	p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	for (i = 0; i < size; i++)
		p[i] = pattern(i);
	snprintf(buf, sizeof(buf), "%d\n", getpid());
	write_file(argv[2], buf);

	if (sigwait(&set, &sig))
		return 1;
	for (i = 0; i < size; i++)
		before_bad += p[i] != pattern(i);
	if (madvise(p, size, MADV_DONTNEED)) {
		perror("madvise");
		return 1;
	}
	for (i = 0; i < size; i++)
		after_nonzero += p[i] != 0;
	for (i = 0; i < size; i++)
		p[i] = pattern(i + 1);
	for (i = 0; i < size; i++)
		refill_bad += p[i] != pattern(i + 1);
	snprintf(buf, sizeof(buf), "before_bad=%ld after_nonzero=%ld refill_bad=%ld\n", before_bad,
		 after_nonzero, refill_bad);
	write_file(argv[3], buf);
	for (;;)
		pause();
}
