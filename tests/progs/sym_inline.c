/* -O2 -g: leaf_step is inlined into mid_step, which is inlined into outer_loop (a real function),
 * so one address in outer_loop is three frames by DWARF (tests/test_symbolize_debuginfo.py). */
#include <stdio.h>
#include <stdlib.h>

volatile long sink;

static inline __attribute__((always_inline)) long leaf_step(long x) {
    x ^= x << 13;
    x ^= x >> 7;
    sink = x;
    return x ^ (x << 17);
}

static inline __attribute__((always_inline)) long mid_step(long x, long i) {
    return leaf_step(x + i) * 3;
}

__attribute__((noinline)) long outer_loop(long n) {
    long acc = 1;
    for (long i = 0; i < n; i++)
        acc = mid_step(acc, i);
    return acc;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000;
    printf("%ld\n", outer_loop(n));
    return 0;
}
