// A C++ program with templates and an exception, built -O2 -fomit-frame-pointer
// (tests/test_cfi_unwind.py): main -> Runner<Mix>::run -> apply<Mix> -> Mix::step -> spin<3>.
// `nofp_cpp SECONDS` prints {"pid", "tids", "cpu_s"}.
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <stdexcept>
#include <unistd.h>

static volatile unsigned long sink;

template <int N> __attribute__((noinline)) unsigned long spin(unsigned long x)
{
    for (int i = 0; i < 20000; i++)
        x = x * 6364136223846793005UL + N;
    sink = x;
    return x;
}

struct Mix {
    unsigned long buf[6];
    __attribute__((noinline)) unsigned long step(unsigned long n)
    {
        for (int i = 0; i < 6; i++)
            buf[i] = n + i;
        return spin<3>(buf[n % 6]) + buf[2];
    }
};

template <typename T> __attribute__((noinline)) unsigned long apply(T &t, unsigned long n)
{
    unsigned long r = t.step(n + 1);
    if (r == 42)
        throw std::runtime_error("unlikely");
    return r * 3 + n;
}

template <typename T> struct Runner {
    T t;
    __attribute__((noinline)) unsigned long run(unsigned long n)
    {
        try {
            return apply(t, n) * 5 + n;
        } catch (const std::exception &) {
            return 0;
        }
    }
};

static double now_s()
{
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    usleep(300000);
    Runner<Mix> r{};
    unsigned long acc = 0;
    double end = now_s() + seconds;
    while (now_s() < end)
        acc += r.run(acc);
    sink = acc;
    timespec cpu;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    printf("{\"pid\": %d, \"tids\": [%d], \"cpu_s\": %.3f}\n", (int)getpid(), (int)getpid(),
           cpu.tv_sec + cpu.tv_nsec * 1e-9);
    return 0;
}
