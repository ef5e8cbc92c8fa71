// SPDX-License-Identifier: Apache-2.0
/*
 * scanmaps: the mappings CRIU's page scans tell apart (criu/patches/0039, 0040).
 * Runs INSIDE a workspace (compiled on the host with gcc -static).
 *
 *   scanmaps DIR
 *
 * Writes DIR/data (1 MiB of a pattern) and maps it:
 *   - private, read-only, every page read: file pages only, no page of its own to dump;
 *   - private, read-write, three pages written: those three are its own (copies);
 * and maps 1 MiB of private anonymous memory written in full, a 64 MiB PROT_NONE reservation,
 * and 16 anonymous pages with guard regions installed on pages 5 and 9 (MADV_GUARD_INSTALL;
 * skipped where the kernel has none). Holds two deleted files open: DIR/small (4 KiB) and
 * DIR/large (3 MiB, past CRIU's threshold for copying in chunks), one of them mapped shared.
 * Then writes "ro=ADDR rw=ADDR anon=ADDR guard=ADDR|none" to DIR/ready and sleeps.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_GUARD_INSTALL
#define MADV_GUARD_INSTALL 102
#endif

#define MIB (1 << 20)

static void fill(unsigned char *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)(i * 131 + (i >> 12) * 7 + seed);
}

static int deleted_file(const char *dir, const char *name, size_t size, unsigned seed)
{
	char path[4096];
	unsigned char *buf = malloc(size);
	int fd;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	if (fd < 0 || !buf)
		exit(1);
	fill(buf, size, seed);
	if (write(fd, buf, size) != (ssize_t)size)
		exit(1);
	unlink(path);
	free(buf);
	return fd;
}

int main(int argc, char **argv)
{
	char path[4096], text[256];
	unsigned char *ro, *rw, *anon, *guard, *shared, sum = 0;
	int fd, large;
	FILE *f;

	if (argc != 2)
		return 2;
	snprintf(path, sizeof(path), "%s/data", argv[1]);
	fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	anon = malloc(MIB);
	if (fd < 0 || !anon)
		return 1;
	fill(anon, MIB, 1);
	if (write(fd, anon, MIB) != MIB)
		return 1;

	ro = mmap(NULL, MIB, PROT_READ, MAP_PRIVATE, fd, 0);
	rw = mmap(NULL, MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
	anon = mmap(NULL, MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	guard = mmap(NULL, 16 << 12, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (ro == MAP_FAILED || rw == MAP_FAILED || anon == MAP_FAILED || guard == MAP_FAILED)
		return 1;
	if (mmap(NULL, 64 * MIB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) == MAP_FAILED)
		return 1;
	for (size_t i = 0; i < MIB; i += 4096)
		sum += ro[i];
	rw[0] ^= 0xff;
	rw[7 << 12] ^= 0xff;
	rw[200 << 12] ^= 0xff;
	fill(anon, MIB, 3);
	memset(guard, 0x5a, 16 << 12);
	if (madvise(guard + (5 << 12), 4096, MADV_GUARD_INSTALL) ||
	    madvise(guard + (9 << 12), 4096, MADV_GUARD_INSTALL))
		guard = NULL;

	deleted_file(argv[1], "small", 4096, 5);
	large = deleted_file(argv[1], "large", 3 * MIB, 7);
	shared = mmap(NULL, MIB, PROT_READ | PROT_WRITE, MAP_SHARED, large, 0);
	if (shared == MAP_FAILED)
		return 1;
	shared[4096] ^= sum | 1; /* the mapping writes the deleted file */

	snprintf(path, sizeof(path), "%s/ready", argv[1]);
	snprintf(text, sizeof(text), "ro=%lx rw=%lx anon=%lx guard=%lx\n", (unsigned long)ro, (unsigned long)rw,
		 (unsigned long)anon, (unsigned long)guard);
	f = fopen(path, "w");
	if (!f || fputs(text, f) < 0 || fclose(f))
		return 1;
	while (1)
		pause();
}
