// SPDX-License-Identifier: Apache-2.0
/*
 * bgwriter: a process that never stops changing its memory, for the background-dump test
 * (criu/patches/0020). Runs INSIDE a workspace (built static on the host).
 *
 *   bgwriter MB DIR
 *
 * Maps MB MiB of private anonymous memory R, fills every page with a pattern, writes DIR/ready
 * ("PID") and from then on loops without pause: rewrites a counter into every page of R, and
 * every round also drops a page of R (MADV_DONTNEED), unmaps and maps again a page of a scratch
 * area U, moves a page of a second area M with mremap and back, and forks a child that writes
 * its own copy of a few pages of R and exits. Every page a snapshot holds must be what the
 * process held at the moment it was frozen, whatever it did to the page afterwards.
 *
 * A page W is MADV_WIPEONFORK, as BoringSSL's fork-safety page in every chromium process: it is
 * rewritten every round, and each forked child checks that it reads zeros there (else it writes
 * DIR/wipe-broken): a background dump makes it copy-on-write for its fork and must give the
 * flag back.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define PG 4096UL

static void die(const char *what)
{
	perror(what);
	exit(1);
}

int main(int argc, char **argv)
{
	if (argc != 3)
		return 2;
	size_t n = (size_t)atoi(argv[1]) * 256, nm = 64, nu = 64;
	unsigned char *r = mmap(NULL, n * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	unsigned char *u = mmap(NULL, nu * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	/* M and a hole of the same size after it, where its pages are moved to and back */
	unsigned char *m = mmap(NULL, 2 * nm * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	unsigned char *w = mmap(NULL, PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (r == MAP_FAILED || u == MAP_FAILED || m == MAP_FAILED || w == MAP_FAILED)
		die("mmap");
	if (madvise(w, PG, MADV_WIPEONFORK))
		die("madvise wipeonfork");
	munmap(m + nm * PG, nm * PG);
	for (size_t i = 0; i < n; i++)
		memset(r + i * PG, (int)(i * 131 + 7), PG);
	for (size_t i = 0; i < nu; i++)
		memset(u + i * PG, (int)(i + 1), PG);
	for (size_t i = 0; i < nm; i++)
		memset(m + i * PG, (int)(i + 3), PG);

	char path[4096], broken[4096];
	snprintf(broken, sizeof(broken), "%s/wipe-broken", argv[2]);
	snprintf(path, sizeof(path), "%s/ready", argv[2]);
	FILE *f = fopen(path, "w");
	if (!f)
		die(path);
	fprintf(f, "%d\n", getpid());
	fclose(f);

	for (uint64_t round = 1;; round++) {
		for (size_t i = 0; i < n; i++) {
			uint64_t *p = (uint64_t *)(r + i * PG);
			p[(round + i) % (PG / 8)] = round * 1000003 + i;
		}
		memset(w, (int)(round % 255) + 1, PG);
		size_t k = round % n;
		if (madvise(r + k * PG, PG, MADV_DONTNEED))
			die("madvise");
		unsigned char *up = u + (round % nu) * PG;
		if (munmap(up, PG))
			die("munmap");
		if (mmap(up, PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != up)
			die("mmap fixed");
		memset(up, (int)round, PG);
		unsigned char *mp = m + (round % nm) * PG, *to = mp + nm * PG;
		if (mremap(mp, PG, PG, MREMAP_MAYMOVE | MREMAP_FIXED, to) != to)
			die("mremap");
		to[0] = (unsigned char)round;
		if (mremap(to, PG, PG, MREMAP_MAYMOVE | MREMAP_FIXED, mp) != mp)
			die("mremap back");
		if (round % 8 == 0) {
			pid_t c = fork();
			if (c == 0) {
				for (size_t i = 0; i < 16 && i < n; i++)
					r[i * PG] = 0xee;
				for (size_t i = 0; i < PG; i++)
					if (w[i]) {
						close(open(broken, O_CREAT | O_WRONLY, 0644));
						break;
					}
				_exit(0);
			}
			if (c > 0)
				waitpid(c, NULL, 0);
		}
	}
}
