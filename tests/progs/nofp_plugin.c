/* The library nofp_dlopen.c opens after its start (built -O2 -fomit-frame-pointer -shared):
 * plugin_work -> plugin_leaf. */
static volatile unsigned long plugin_sink;

__attribute__((noinline, noclone)) unsigned long plugin_leaf(unsigned long x)
{
    for (int i = 0; i < 20000; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    plugin_sink = x;
    return x;
}

__attribute__((noinline, noclone)) unsigned long plugin_work(unsigned long n)
{
    unsigned long buf[4];
    for (int i = 0; i < 4; i++)
        buf[i] = n + (unsigned long)i;
    return plugin_leaf(buf[n & 3]) * 3 + buf[1];
}
