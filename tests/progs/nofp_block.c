/* A C program with a known call tree whose leaf blocks, for the off-CPU stacks
 * (tests/test_bpf_offcpu.py): built -O2 -fomit-frame-pointer (the CFI walk must unwind it) or with
 * frame pointers, every function noinline and followed by work on its result (no tail call):
 *
 *     main -> block_a -> block_b -> block_c -> nanosleep (sleep) | read on a pipe (pipe)
 *
 * `nofp_block sleep|pipe SECONDS`: spins 0.3 s first (the collector registers its mappings after the
 * exec: a sleep there would be blocked time with the stack of before), then for SECONDS calls the tree, whose leaf sleeps 2 ms in libc's nanosleep (sleep) or
 * reads one byte from a pipe a second thread writes every 2 ms (pipe); prints
 * {"pid", "tids": [the main thread], "cpu_s", "iterations" (calls of the tree)} on stdout.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static volatile unsigned long sink;
static volatile int stop_flag;
static int use_pipe;
static int fds[2];

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *writer(void *arg)
{
    (void)arg;
    struct timespec ts = {0, 2 * 1000 * 1000};
    char c = 'x';
    while (!stop_flag) {
        nanosleep(&ts, NULL);
        if (write(fds[1], &c, 1) != 1)
            break;
    }
    return NULL;
}

__attribute__((noinline, noclone)) unsigned long block_c(unsigned long n)
{
    unsigned long buf[8];
    for (int i = 0; i < 8; i++)
        buf[i] = n + (unsigned long)i; /* a frame of its own on the stack */
    if (use_pipe) {
        char c;
        if (read(fds[0], &c, 1) == 1)
            buf[1] += (unsigned long)c;
    } else {
        struct timespec ts = {0, 2 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return buf[n & 7] * 3 + buf[1];
}

__attribute__((noinline, noclone)) unsigned long block_b(unsigned long n)
{
    return block_c(n + 1) * 5 + n;
}

__attribute__((noinline, noclone)) unsigned long block_a(unsigned long n)
{
    return block_b(n + 2) * 7 + n;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: nofp_block sleep|pipe SECONDS\n");
        return 2;
    }
    use_pipe = strcmp(argv[1], "pipe") == 0;
    double seconds = atof(argv[2]);
    pthread_t w;
    if (use_pipe) {
        if (pipe(fds) != 0 || pthread_create(&w, NULL, writer, NULL) != 0)
            return 1;
    }
    double end = now_s() + 0.3;
    while (now_s() < end)
        ;
    end = now_s() + seconds;
    unsigned long acc = 0, iterations = 0;
    while (now_s() < end) {
        acc += block_a(acc);
        iterations++;
    }
    sink = acc;
    if (use_pipe) {
        stop_flag = 1; /* the writer's last bytes stay in the pipe (closing its end first: SIGPIPE) */
        pthread_join(w, NULL);
    }
    struct timespec cpu;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    printf("{\"pid\": %d, \"tids\": [%d], \"cpu_s\": %.3f, \"iterations\": %lu}\n", (int)getpid(),
           (int)getpid(), cpu.tv_sec + cpu.tv_nsec * 1e-9, iterations);
    return 0;
}
