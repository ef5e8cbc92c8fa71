/*
 * Holds known values in ymm8-ymm15 (both halves) and checks them without end, yielding the CPU
 * between checks (so that a stop lands both in user code and in a system call). Exits 3 at the
 * first register that changed: a task whose CRIU died mid-injection must get its whole vector
 * state back (sigreturn restores only the legacy FXSAVE part from a frame without magic2).
 * Writes READY (argv[1]) before it starts; "noavx" into it on a CPU without AVX2. With a second
 * argument the checks run in a second thread (CRIU runs its parasite in other threads one
 * command at a time, compel_run_in_thread), the first one waiting in pause().
 */
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

static unsigned char pat[8][32] __attribute__((aligned(32)));

static void *check(void *unused)
{
	asm volatile("vmovdqa 0(%0), %%ymm8\n\t"
		     "vmovdqa 32(%0), %%ymm9\n\t"
		     "vmovdqa 64(%0), %%ymm10\n\t"
		     "vmovdqa 96(%0), %%ymm11\n\t"
		     "vmovdqa 128(%0), %%ymm12\n\t"
		     "vmovdqa 160(%0), %%ymm13\n\t"
		     "vmovdqa 192(%0), %%ymm14\n\t"
		     "vmovdqa 224(%0), %%ymm15\n\t"
		     "1:\n\t"
#define CHECK(off, reg)                                   \
		     "vpcmpeqq " #off "(%0), %%" #reg ", %%ymm0\n\t" \
		     "vpmovmskb %%ymm0, %%eax\n\t"                    \
		     "cmp $-1, %%eax\n\t"                             \
		     "jne 2f\n\t"
		     CHECK(0, ymm8) CHECK(32, ymm9) CHECK(64, ymm10) CHECK(96, ymm11)
		     CHECK(128, ymm12) CHECK(160, ymm13) CHECK(192, ymm14) CHECK(224, ymm15)
		     "mov $24, %%eax\n\t" /* sched_yield */
		     "syscall\n\t"
		     "jmp 1b\n\t"
		     "2:\n\t"
		     "mov $231, %%eax\n\t" /* exit_group(3) */
		     "mov $3, %%edi\n\t"
		     "syscall\n\t"
		     :
		     : "r"(pat)
		     : "rax", "rcx", "rdi", "r11", "memory", "xmm0", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
		       "xmm13", "xmm14", "xmm15");
	return unused;
}

int main(int argc, char **argv)
{
	pthread_t t;
	int fd, i, j;

	for (i = 0; i < 8; i++)
		for (j = 0; j < 32; j++)
			pat[i][j] = (unsigned char)(i * 37 + j * 11 + 1);
	fd = open(argc > 1 ? argv[1] : "/tmp/vecregs.ready", O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (!__builtin_cpu_supports("avx2")) {
		if (write(fd, "noavx", 5) != 5)
			return 1;
		close(fd);
		for (;;)
			pause();
	}
	if (write(fd, "ok", 2) != 2)
		return 1;
	close(fd);
	if (argc > 2) {
		if (pthread_create(&t, NULL, check, NULL))
			return 1;
		for (;;)
			pause();
	}
	check(NULL);
	return 0;
}
