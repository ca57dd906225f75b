/* Fault injector "one node's collectives slowed" (tests/realapps): an LD_PRELOAD library that wraps
 * the blocking MPI collectives and, on the chosen rank only, busy-waits REALAPPS_DELAY_US
 * microseconds AFTER the real call has returned, as a slow link or NIC on that node would make the
 * collective return late there. Ground truth: that rank, cause network.
 *
 * Both MPI_X and PMPI_X are defined: an application without an interposer calls MPI_X (ours), and
 * the profiler's PMPI interposer (earlier in LD_PRELOAD) calls PMPI_X, which then resolves to ours,
 * so the delay lies inside the call it records. Either way the real function is PMPI_X of the next
 * object (dlsym(RTLD_NEXT)), and a thread-local depth keeps a nested collective from adding twice.
 *
 * Environment: REALAPPS_SLOW_RANK (rank in MPI_COMM_WORLD, from OMPI_COMM_WORLD_RANK or PMI_RANK),
 * REALAPPS_DELAY_US (default 2000). Nothing happens on the other ranks or when they are unset.
 * Build: mpicc -shared -fPIC -O2 -o libslow_collectives.so slow_collectives.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int slow = -1; /* -1 unknown, 0 no, 1 yes */
static long delay_ns;
static __thread int depth;

static void decide(void)
{
    const char *want = getenv("REALAPPS_SLOW_RANK");
    const char *me = getenv("OMPI_COMM_WORLD_RANK");
    const char *us = getenv("REALAPPS_DELAY_US");
    if (!me)
        me = getenv("PMI_RANK");
    delay_ns = (us ? atol(us) : 2000) * 1000L;
    slow = (want && me && atoi(want) == atoi(me) && delay_ns > 0) ? 1 : 0;
    if (slow)
        fprintf(stderr, "slow_collectives: rank %s: +%ld us after every collective\n", me, delay_ns / 1000);
}

static void busy_wait(void)
{
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < delay_ns);
}

static void *next(const char *name)
{
    void *p = dlsym(RTLD_NEXT, name);
    if (!p) {
        fprintf(stderr, "slow_collectives: %s not found after this library\n", name);
        abort();
    }
    return p;
}

#define WRAP(NAME, PARAMS, ARGS)                                        \
    static int call_##NAME PARAMS                                       \
    {                                                                   \
        static int (*real) PARAMS;                                      \
        if (!real)                                                      \
            real = (int (*) PARAMS)next("PMPI_" #NAME);                 \
        if (slow < 0)                                                   \
            decide();                                                   \
        depth++;                                                        \
        int ret_ = real ARGS;                                           \
        depth--;                                                        \
        if (slow == 1 && depth == 0)                                    \
            busy_wait();                                                \
        return ret_;                                                    \
    }                                                                   \
    int MPI_##NAME PARAMS { return call_##NAME ARGS; }                  \
    int PMPI_##NAME PARAMS { return call_##NAME ARGS; }

WRAP(Allreduce, (const void *s, void *r, int n, MPI_Datatype dt, MPI_Op op, MPI_Comm c), (s, r, n, dt, op, c))
WRAP(Reduce, (const void *s, void *r, int n, MPI_Datatype dt, MPI_Op op, int root, MPI_Comm c),
     (s, r, n, dt, op, root, c))
WRAP(Bcast, (void *b, int n, MPI_Datatype dt, int root, MPI_Comm c), (b, n, dt, root, c))
WRAP(Barrier, (MPI_Comm c), (c))
WRAP(Allgather, (const void *s, int sn, MPI_Datatype st, void *r, int rn, MPI_Datatype rt, MPI_Comm c),
     (s, sn, st, r, rn, rt, c))
WRAP(Allgatherv,
     (const void *s, int sn, MPI_Datatype st, void *r, const int *rc, const int *d, MPI_Datatype rt, MPI_Comm c),
     (s, sn, st, r, rc, d, rt, c))
WRAP(Alltoall, (const void *s, int sn, MPI_Datatype st, void *r, int rn, MPI_Datatype rt, MPI_Comm c),
     (s, sn, st, r, rn, rt, c))
WRAP(Alltoallv,
     (const void *s, const int *sc, const int *sd, MPI_Datatype st, void *r, const int *rc, const int *rd,
      MPI_Datatype rt, MPI_Comm c),
     (s, sc, sd, st, r, rc, rd, rt, c))
WRAP(Reduce_scatter, (const void *s, void *r, const int *rc, MPI_Datatype dt, MPI_Op op, MPI_Comm c),
     (s, r, rc, dt, op, c))
WRAP(Gather, (const void *s, int sn, MPI_Datatype st, void *r, int rn, MPI_Datatype rt, int root, MPI_Comm c),
     (s, sn, st, r, rn, rt, root, c))
WRAP(Scatter, (const void *s, int sn, MPI_Datatype st, void *r, int rn, MPI_Datatype rt, int root, MPI_Comm c),
     (s, sn, st, r, rn, rt, root, c))
