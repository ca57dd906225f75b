/* A shared library for tests/test_symbolize_debuginfo.py: an exported function, a static one (named
 * only by .symtab, so only by the debug file once the library is stripped) and a helper always
 * inlined into the static one. SYMLIB_VARIANT changes the code (another build id). */
#ifndef SYMLIB_VARIANT
#define SYMLIB_VARIANT 1
#endif

volatile long symlib_sink;

static inline __attribute__((always_inline)) long symlib_mix(long x) {
    for (int i = 0; i < 100; i++)
        x = x * 6364136223846793005L + SYMLIB_VARIANT + (x >> 17);
    return x;
}

static __attribute__((noinline)) long symlib_hidden_work(long n) {
    long acc = n;
    for (long i = 0; i < n; i++)
        acc ^= symlib_mix(acc + i);
    symlib_sink = acc;
    return acc;
}

long symlib_entry(long n) {
    return symlib_hidden_work(n) + 1;
}
