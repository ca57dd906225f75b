/* TEST DOUBLE of NCCL's side of the profiler plugin interface: it loads a profiler plugin exactly
 * as NCCL does (dlopen the file NCCL_PROFILER_PLUGIN names, look up the newest ncclProfiler_vN
 * symbol it knows, then older ones; init per communicator; startEvent / stopEvent /
 * recordEventState in the order NCCL 2.23..2.32 issues them; finalize) and plays one rank of a
 * communicator. It is not NCCL and runs no GPU: its "GPU timer" is the host's CLOCK_MONOTONIC
 * with an offset and a drift (--offset-ns, --drift-ppm), and a kernel channel's start and stop are
 * reported to the plugin `latency` after they "happened", as NCCL's proxy thread sees them late.
 * What it really did is printed as JSON lines ("truth") for tests/test_nccl_profiler.py to
 * compare with what the collector made of the plugin's records. Nothing it prints is a
 * measurement of NCCL. Layouts: bpf/fastpath/nccl_profiler_abi.h, checked below against offsets
 * counted by hand from NCCL's documentation.
 *
 * Usage: nccl_profiler_host PLUGIN.so --knows 7,6,5,4,3,2,1 --rank R --nranks N --hash H --ops K
 *        [--sleep-us U] [--offset-ns O] [--drift-ppm D] [--fork] [--bench]
 *        [--coord FILE [--late-gpu-us L | --late-host-us L] [--late-ops A:B]]
 * --coord (v4+): the ranks' AllReduce kernels depend on each other as on a GPU: each rank posts its
 * kernel's start into FILE (shared, ops x nranks), and every rank's kernel ends `dur` after the
 * last one started, on the GPU timer, however late its host sees it (the ends are synchronous, as
 * a ring's last step makes them). --late-gpu-us: in ops A..B-1 this rank's kernel starts L later
 * than its enqueue (its GPU busy with earlier work); --late-host-us: its host enqueues L later.
 * Exit 0; 3 when no known version is exported (NCCL then goes on without a plugin: so does this).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../../bpf/fastpath/nccl_profiler_abi.h"

_Static_assert(offsetof(gp_ncclProfilerEventDescr_v4_t, coll.seqNumber) == 24, "v4 coll.seqNumber");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v4_t, coll.count) == 56, "v4 coll.count");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v4_t, coll.nChannels) == 80, "v4 coll.nChannels");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v4_t, coll.proto) == 96, "v4 coll.proto");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v4_t, kernelCh.pTimer) == 32, "v4 kernelCh.pTimer");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v6_t, coll.nChannels) == 80, "v5/v6 coll.nChannels");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v6_t, p2p.peer) == 56, "v5/v6 p2p.peer");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v7_t, coll.nChannels) == 80, "v7 coll.nChannels");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v7_t, coll.userTag) == 128, "v7 coll.userTag");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v7_t, p2p.peer) == 56, "v7 p2p.peer");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v7_t, kernelPhase.pTimer) == 40, "v7 kernelPhase.pTimer");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v3_t, coll.count) == 72, "v3 coll.count");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v2_t, coll.algo) == 112, "v2 coll.algo");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v1_t, coll.algo) == 106, "v1 coll.algo");
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v1_t, proxyOp.pid) == 24, "v1 proxyOp.pid");

static int version;
static void *api; /* the plugin's ncclProfiler_vN */
static void *ctx;
static int mask;
static long long offset_ns = 1700000000000000000LL; /* a globaltimer counts from the epoch */
static double drift_ppm = 40.0;
static unsigned long long t_origin;
static unsigned long long calls; /* plugin calls made */
static unsigned seed = 12345;
static int bench_mode; /* --bench: no waiting, only the plugin's calls */
static unsigned long long *coord; /* --coord: [ops][nranks] kernel starts (host ns), 0 = not yet */
static unsigned long long late_gpu_ns, late_host_ns;
static int late_from = -1, late_to = -1;

static unsigned long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

static unsigned long long gpu_timer(unsigned long long host)
{
    return (unsigned long long)(offset_ns + (long long)host + (long long)((double)(host - t_origin) * drift_ppm * 1e-6));
}

static unsigned rnd(void)
{
    seed = seed * 1103515245u + 12345u;
    return (seed >> 8) & 0xffffff;
}

/* How late the proxy thread sees a kernel timestamp: mostly 1..30 us, now and then 2 ms. */
static unsigned long long latency_ns(void)
{
    return rnd() % 50 == 0 ? 2000000ULL : 1000ULL + rnd() % 29000;
}

static void spin_until(unsigned long long t)
{
    while (now_ns() < t)
        ;
}

/* --- the four calls, whatever the version ------------------------------------------------------ */
static void start(void **h, void *descr)
{
    calls++;
    if (version >= 5)
        ((gp_ncclProfiler_v5_t *)api)->startEvent(ctx, h, descr);
    else if (version == 4)
        ((gp_ncclProfiler_v4_t *)api)->startEvent(ctx, h, descr);
    else
        ((gp_ncclProfiler_v1_t *)api)->startEvent(ctx, h, descr);
}

static void stop(void *h)
{
    calls++;
    if (h)
        ((gp_ncclProfiler_v1_t *)api)->stopEvent(h); /* same slot in every version */
}

static void record(void *h, int state, unsigned long long ptimer)
{
    calls++;
    if (version >= 4) {
        gp_ncclProfilerEventStateArgs_v4_t a = {0};
        a.kernelCh.pTimer = ptimer;
        ((gp_ncclProfiler_v4_t *)api)->recordEventState(h, state, &a);
    } else {
        gp_ncclProfilerEventStateArgs_v1_t a = {0};
        ((gp_ncclProfiler_v1_t *)api)->recordEventState(h, state, &a);
    }
}

/* One descriptor buffer large enough for every version's, filled per version. */
union descr {
    gp_ncclProfilerEventDescr_v1_t v1;
    gp_ncclProfilerEventDescr_v2_t v2;
    gp_ncclProfilerEventDescr_v3_t v3;
    gp_ncclProfilerEventDescr_v4_t v4;
    gp_ncclProfilerEventDescr_v6_t v6;
    gp_ncclProfilerEventDescr_v7_t v7;
};

static void set_common(union descr *d, unsigned long long type, void *parent, int rank)
{
    memset(d, 0, sizeof(*d));
    if (version >= 5) {
        d->v6.type = type;
        d->v6.parentObj = parent;
        d->v6.rank = rank;
    } else {
        d->v4.type = (uint8_t)type; /* v1..v4 share the first three members' layout */
        d->v4.parentObj = parent;
        d->v4.rank = rank;
    }
}

static int rank_, nranks;
static unsigned long long comm_hash;

static int v1_func(const char *f)
{
    return !strcmp(f, "AllReduce") ? 4 : !strcmp(f, "AllGather") ? 2 : !strcmp(f, "Send") ? 6 : 7;
}

/* Start the task event (Coll or P2p) of an operation. */
static void *start_task(int p2p, const char *func, size_t count, int root_or_peer, unsigned long long seqn,
                        void *parent, int nch)
{
    union descr d;
    void *h = NULL;
    set_common(&d, p2p ? ncclProfileP2p : ncclProfileColl, parent, rank_);
    if (version >= 4) {
        /* v4's and v5..v7's coll/p2p members read here are at the same offsets (asserted above) */
        if (version >= 7) { /* what v7 appends: a tag the application set on the call */
            if (!p2p) {
                d.v7.coll.kernelVariant = "ring_simple";
                d.v7.coll.userTag = 0x7a67;
            } else {
                d.v7.p2p.userTag = 0x7a67;
            }
        }
        if (!p2p) {
            d.v4.coll.seqNumber = seqn;
            d.v4.coll.func = func;
            d.v4.coll.count = count;
            d.v4.coll.root = root_or_peer;
            d.v4.coll.datatype = "ncclFloat32";
            d.v4.coll.nChannels = (uint8_t)nch;
            d.v4.coll.nWarps = 16;
            d.v4.coll.algo = "RING";
            d.v4.coll.proto = "SIMPLE";
        } else {
            d.v4.p2p.func = func;
            d.v4.p2p.count = count;
            d.v4.p2p.datatype = "ncclFloat32";
            d.v4.p2p.peer = root_or_peer;
            d.v4.p2p.nChannels = (uint8_t)nch;
        }
    } else if (version == 3 || version == 2) {
        /* v2 and v3 differ only after coll.datatype (trafficBytes): set both layouts' fields */
        if (!p2p) {
            if (version == 3) {
                d.v3.coll.name = "double";
                d.v3.coll.commHash = comm_hash;
                d.v3.coll.seqNumber = seqn;
                d.v3.coll.func = func;
                d.v3.coll.count = count;
                d.v3.coll.root = root_or_peer;
                d.v3.coll.datatype = "ncclFloat32";
                d.v3.coll.nMaxChannels = (uint8_t)nch;
                d.v3.coll.algo = "RING";
                d.v3.coll.proto = "LL";
            } else {
                d.v2.coll.name = "double";
                d.v2.coll.commHash = comm_hash;
                d.v2.coll.seqNumber = seqn;
                d.v2.coll.func = func;
                d.v2.coll.count = count;
                d.v2.coll.root = root_or_peer;
                d.v2.coll.datatype = "ncclFloat32";
                d.v2.coll.algo = "TREE";
                d.v2.coll.proto = "LL128";
            }
        } else {
            d.v3.p2p.name = "double";
            d.v3.p2p.commHash = comm_hash;
            d.v3.p2p.func = func;
            d.v3.p2p.count = count;
            d.v3.p2p.datatype = "ncclFloat32";
            d.v3.p2p.peer = root_or_peer;
        }
    } else {
        if (!p2p) {
            d.v1.coll.name = "double";
            d.v1.coll.commHash = comm_hash;
            d.v1.coll.seqNumber = seqn;
            d.v1.coll.func = (uint8_t)v1_func(func);
            d.v1.coll.count = count;
            d.v1.coll.root = root_or_peer;
            d.v1.coll.datatype = 7; /* ncclFloat32 */
            d.v1.coll.algo = 1;     /* RING */
            d.v1.coll.proto = 2;    /* SIMPLE */
        } else {
            d.v1.p2p.name = "double";
            d.v1.p2p.commHash = comm_hash;
            d.v1.p2p.func = (uint8_t)v1_func(func);
            d.v1.p2p.count = count;
            d.v1.p2p.datatype = 7;
            d.v1.p2p.peer = root_or_peer;
        }
    }
    start(&h, &d);
    return h;
}

static int is_late(int op) { return op >= late_from && op < late_to; }

static void sleep_until(unsigned long long t)
{
    for (unsigned long long now = now_ns(); now < t; now = now_ns()) {
        struct timespec ts = {0, (long)(t - now < 200000 ? t - now : 200000)};
        nanosleep(&ts, NULL);
    }
}

/* --coord: post this rank's kernel start of op `op`, wait for every rank's; the kernel's end. */
static unsigned long long coordinated_end(int op, unsigned long long start, unsigned long long dur_ns)
{
    unsigned long long *row = coord + (size_t)op * (size_t)nranks;
    __atomic_store_n(&row[rank_], start, __ATOMIC_RELEASE);
    unsigned long long last = 0, give_up = now_ns() + 20000000000ULL;
    for (int r = 0; r < nranks; r++) {
        unsigned long long t;
        while (!(t = __atomic_load_n(&row[r], __ATOMIC_ACQUIRE))) {
            if (now_ns() > give_up) {
                fprintf(stderr, "--coord: rank %d never started op %d\n", r, op);
                exit(4);
            }
            usleep(50);
        }
        if (t > last)
            last = t;
    }
    return last + dur_ns;
}

/* The device side of one task: nch kernel channels (v3+) or proxy ops with two steps (v1, v2),
 * plus a PXN proxy op of another process's operation. Returns (through *s, *e) the true host times.
 * coord_op >= 0: the AllReduce of that index under --coord. */
static void run_device(void *task, int nch, unsigned long long dur_ns, unsigned long long *s, unsigned long long *e,
                       int coord_op)
{
    if (coord_op >= 0 && late_gpu_ns && is_late(coord_op))
        sleep_until(now_ns() + late_gpu_ns); /* the GPU still runs this rank's earlier work */
    union descr d;
    *s = ~0ULL;
    *e = 0;
    void *ch[8] = {0};
    unsigned long long lat[8], t_start[8];
    for (int c = 0; c < nch; c++) {
        set_common(&d, version >= 3 ? ncclProfileKernelCh : ncclProfileProxyOp, task, rank_);
        unsigned long long l = latency_ns(), t = now_ns();
        t_start[c] = t; /* the channel starts now on the "GPU"; the proxy thread sees it l later */
        lat[c] = l;
        if (version >= 4 && !bench_mode)
            spin_until(t + l);
        if (version >= 4) {
            d.v4.kernelCh.channelId = (uint8_t)c;
            d.v4.kernelCh.pTimer = gpu_timer(t_start[c]);
        } else if (version == 3) {
            d.v3.kernelCh.channelId = (uint8_t)c;
            t_start[c] = t; /* host-observed: the plugin's own time is the truth it can have */
        } else {
            d.v1.proxyOp.pid = getpid();
            d.v1.proxyOp.channelId = (uint8_t)c;
            d.v1.proxyOp.nSteps = 2;
            t_start[c] = t;
        }
        start(&ch[c], &d);
        if (t_start[c] < *s)
            *s = t_start[c];
    }
    /* PXN: this process's proxy thread serves another rank's operation; its parent pointer is an
     * address in that other process (here: one that is not mapped at all) */
    void *pxn = NULL;
    set_common(&d, ncclProfileProxyOp, (void *)0xdead0000beefULL, (rank_ + 1) % nranks);
    d.v1.proxyOp.pid = getpid() + 100000; /* proxyOp is at the same offset in v1..v3; v4+: below */
    if (version >= 4)
        d.v4.proxyOp.pid = getpid() + 100000;
    start(&pxn, &d);
    for (int c = 0; c < nch && version < 3; c++) {
        for (int step = 0; step < 2; step++) {
            void *sh = NULL;
            set_common(&d, ncclProfileProxyStep, ch[c], rank_);
            d.v1.proxyStep.step = step;
            start(&sh, &d);
            record(sh, ncclProfilerProxyStepSendWait, 0);
            spin_until(now_ns() + dur_ns / 4);
            stop(sh);
        }
    }
    void *pxn_step = NULL;
    set_common(&d, ncclProfileProxyStep, pxn, rank_);
    start(&pxn_step, &d);
    stop(pxn_step);
    stop(pxn);
    unsigned long long coord_end = 0;
    if (coord_op >= 0) {
        /* every channel of every rank started (a channel the proxy saw late started late here) */
        unsigned long long started = 0;
        for (int c = 0; c < nch; c++)
            started = t_start[c] > started ? t_start[c] : started;
        coord_end = coordinated_end(coord_op, started, dur_ns);
        sleep_until(coord_end);
    } else if (version >= 3) {
        spin_until(now_ns() + dur_ns);
    }
    for (int c = 0; c < nch; c++) {
        unsigned long long l = latency_ns(), end = coord_end ? coord_end : now_ns();
        if (version >= 4) {
            if (!bench_mode)
                spin_until(end + l); /* seen l after it ended */
            record(ch[c], ncclProfilerKernelChStop, gpu_timer(end));
        }
        stop(ch[c]);
        if (version < 4)
            end = now_ns();
        if (end > *e)
            *e = end;
        (void)lat;
    }
}

static void *find_api(void *lib, const char *knows)
{
    char list[64];
    snprintf(list, sizeof(list), "%s", knows);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        char name[32];
        snprintf(name, sizeof(name), "ncclProfiler_v%s", tok);
        void *sym = dlsym(lib, name);
        if (sym) {
            version = atoi(tok);
            return sym;
        }
    }
    return NULL;
}

static int do_init(void)
{
    if (version >= 5)
        return ((gp_ncclProfiler_v5_t *)api)->init(&ctx, comm_hash, &mask, "double", 1, nranks, rank_, NULL);
    if (version == 4)
        return ((gp_ncclProfiler_v4_t *)api)->init(&ctx, &mask, "double", comm_hash, 1, nranks, rank_, NULL);
    return ((gp_ncclProfiler_v1_t *)api)->init(&ctx, &mask);
}

static void play(int ops, unsigned long long sleep_us, int bench)
{
    unsigned long long seq_ar = 0;
    int nch = 2;
    for (int i = 0; i < ops; i++) {
        void *group = NULL, *coll_api = NULL;
        union descr d;
        set_common(&d, ncclProfileGroup, NULL, rank_);
        if (!bench)
            start(&group, &d);
        void *parent = group;
        if (version >= 5 && !bench) {
            set_common(&d, ncclProfileCollApi, NULL, rank_);
            d.v6.collApi.func = "AllReduce";
            d.v6.collApi.count = 1024;
            start(&coll_api, &d);
            parent = coll_api;
        }
        if (coord && late_host_ns && is_late(i))
            sleep_until(now_ns() + late_host_ns); /* the host reaches the collective late */
        unsigned long long t0 = now_ns();
        void *task = start_task(0, "AllReduce", 1024, -1, seq_ar++, parent, nch);
        stop(task);
        unsigned long long t1 = now_ns();
        if (coll_api)
            stop(coll_api);
        if (group)
            stop(group);
        unsigned long long s, e;
        /* alone, each rank's kernel takes its own time; under --coord they end together */
        unsigned long long dur = bench ? 0 : coord ? 20000 : 20000 + (unsigned long long)rank_ * 5000;
        run_device(task, nch, dur, &s, &e, coord ? i : -1);
        if (!bench)
            printf("{\"truth\": \"op\", \"op\": \"AllReduce\", \"seq\": %d, \"enqueue_start\": %llu, "
                   "\"enqueue_stop\": %llu, \"dev_start\": %llu, \"dev_end\": %llu}\n",
                   i, t0, t1, s, e);
        if (!bench && i % 4 == 3 && nranks > 1) {
            /* a send to the next rank and a receive from the previous, in one group */
            set_common(&d, ncclProfileGroup, NULL, rank_);
            start(&group, &d);
            void *snd = start_task(1, "Send", 256, (rank_ + 1) % nranks, 0, group, 1);
            void *rcv = start_task(1, "Recv", 256, (rank_ + nranks - 1) % nranks, 0, group, 1);
            stop(snd);
            stop(rcv);
            stop(group);
            run_device(snd, 1, 5000, &s, &e, -1);
            run_device(rcv, 1, 5000, &s, &e, -1);
            printf("{\"truth\": \"p2p\", \"round\": %d}\n", i / 4);
        }
        if (sleep_us)
            usleep((useconds_t)sleep_us);
    }
}

int main(int argc, char **argv)
{
    const char *knows = "7,6,5,4,3,2,1"; /* what NCCL 2.32 looks up, newest first */
    int ops = 10, do_fork = 0, bench = 0;
    const char *coord_path = NULL;
    unsigned long long sleep_us = 0;
    rank_ = 0;
    nranks = 1;
    comm_hash = 0x1234abcdULL;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--knows") && i + 1 < argc)
            knows = argv[++i];
        else if (!strcmp(argv[i], "--rank") && i + 1 < argc)
            rank_ = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--nranks") && i + 1 < argc)
            nranks = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--hash") && i + 1 < argc)
            comm_hash = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--ops") && i + 1 < argc)
            ops = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--sleep-us") && i + 1 < argc)
            sleep_us = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--offset-ns") && i + 1 < argc)
            offset_ns = strtoll(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--drift-ppm") && i + 1 < argc)
            drift_ppm = atof(argv[++i]);
        else if (!strcmp(argv[i], "--fork"))
            do_fork = 1;
        else if (!strcmp(argv[i], "--bench"))
            bench = bench_mode = 1;
        else if (!strcmp(argv[i], "--coord") && i + 1 < argc)
            coord_path = argv[++i];
        else if (!strcmp(argv[i], "--late-gpu-us") && i + 1 < argc)
            late_gpu_ns = strtoull(argv[++i], NULL, 0) * 1000ULL;
        else if (!strcmp(argv[i], "--late-host-us") && i + 1 < argc)
            late_host_ns = strtoull(argv[++i], NULL, 0) * 1000ULL;
        else if (!strcmp(argv[i], "--late-ops") && i + 1 < argc)
            sscanf(argv[++i], "%d:%d", &late_from, &late_to);
    }
    if (coord_path) {
        /* the file is made (zeroed, ops x nranks x 8 bytes) by whoever starts the ranks */
        int fd = open(coord_path, O_RDWR);
        size_t len = (size_t)ops * (size_t)nranks * sizeof(unsigned long long);
        coord = fd < 0 ? MAP_FAILED : mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (coord == MAP_FAILED) {
            perror(coord_path);
            return 2;
        }
        close(fd);
    }
    seed += (unsigned)rank_ * 7919u;
    t_origin = now_ns();
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    api = find_api(lib, knows);
    if (!api) {
        printf("{\"truth\": \"declined\", \"reason\": \"no known ncclProfiler version\"}\n");
        return 3; /* NCCL: "Could not find ncclProfiler symbol": it continues without a profiler */
    }
    int rc = do_init();
    printf("{\"truth\": \"init\", \"version\": %d, \"rc\": %d, \"mask\": %d, \"pid\": %d}\n", version, rc, mask,
           (int)getpid());
    if (rc != 0)
        return 0; /* the plugin declined: NCCL unloads it and goes on */
    if (do_fork) {
        fflush(stdout);
        pid_t child = fork();
        if (child == 0) {
            printf("{\"truth\": \"child\", \"pid\": %d}\n", (int)getpid());
            play(ops, sleep_us, 0);
            fflush(stdout);
            _exit(0);
        }
        play(ops, sleep_us, 0);
        waitpid(child, NULL, 0);
    } else if (bench) {
        unsigned long long t0 = now_ns();
        play(ops, 0, 1);
        unsigned long long t1 = now_ns();
        printf("{\"truth\": \"bench\", \"calls\": %llu, \"ns\": %llu}\n", calls, t1 - t0);
    } else {
        play(ops, sleep_us, 0);
    }
    ((gp_ncclProfiler_v1_t *)api)->finalize(ctx);
    printf("{\"truth\": \"done\", \"calls\": %llu}\n", calls);
    return 0;
}
