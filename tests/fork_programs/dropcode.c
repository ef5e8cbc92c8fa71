// SPDX-License-Identifier: Apache-2.0
/*
 * dropcode: a process whose first executable mapping is anonymous memory with its first page
 * dropped, as chromium's V8 code range is after V8 discards a freed code page.
 * Runs INSIDE a workspace (compiled on the host with gcc -static; the static binary sits at
 * 0x400000, so the area below it is the first executable mapping, where CRIU's parasite goes).
 *
 *   dropcode READY_FILE
 *
 * Maps 2 MiB of private anonymous RWX memory at AREA, fills it with a pattern without zero
 * bytes, writes "PID AREA" to READY_FILE and waits for signals:
 *   SIGUSR1  madvise(MADV_DONTNEED) the first page, then write /tmp/dropcode.dropped
 *   SIGUSR2  check the area and write /tmp/dropcode.out (rewritten each time):
 *            "first_nonzero=N rest_bad=N" (a dropped first page reads zeros, the rest keeps
 *            its pattern; both must be 0)
 * Neither touches the first page except the check, so after SIGUSR1 it stays not present.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define AREA 0x100000UL
#define LEN (2UL << 20)
#define PG 4096UL

static volatile sig_atomic_t drop, check;

static void on_signal(int sig)
{
	if (sig == SIGUSR1)
		drop = 1;
	else
		check = 1;
}

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
	if (!f || fputs(text, f) < 0 || fclose(f) || rename(tmp, path)) {
		perror(path);
		exit(1);
	}
}

int main(int argc, char **argv)
{
	unsigned char *p;
	char text[128];
	sigset_t none;

	if (argc != 2) {
		fprintf(stderr, "usage: dropcode READY_FILE\n");
		return 2;
	}
	p = mmap((void *)AREA, LEN, PROT_READ | PROT_WRITE | PROT_EXEC,
		 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
	if (p != (void *)AREA) {
		perror("mmap");
		return 1;
	}
	for (size_t i = 0; i < LEN; i++)
		p[i] = pattern(i);
	signal(SIGUSR1, on_signal);
	signal(SIGUSR2, on_signal);
	snprintf(text, sizeof(text), "%d %lu\n", getpid(), AREA);
	write_file(argv[1], text);
	sigemptyset(&none);
	for (;;) {
		sigset_t all;

		sigfillset(&all);
		sigprocmask(SIG_BLOCK, &all, NULL);
		while (!drop && !check)
			sigsuspend(&none);
		if (drop) {
			drop = 0;
			if (madvise(p, PG, MADV_DONTNEED)) {
				perror("madvise");
				return 1;
			}
			write_file("/tmp/dropcode.dropped", "1\n");
		}
		if (check) {
			long first = 0, rest = 0;

			check = 0;
			for (size_t i = 0; i < PG; i++)
				first += p[i] != 0;
			for (size_t i = PG; i < LEN; i++)
				rest += p[i] != pattern(i);
			snprintf(text, sizeof(text), "first_nonzero=%ld rest_bad=%ld\n", first, rest);
			write_file("/tmp/dropcode.out", text);
		}
		sigprocmask(SIG_UNBLOCK, &all, NULL);
	}
}
