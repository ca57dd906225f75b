/* Benchmark program of tests/bench/bench_probes.py.
 *   mpi_bench paced N PERIOD_US : N MPI_Allreduce of one double on MPI_COMM_WORLD, each after
 *                                 PERIOD_US of busy computation (so any time added to a call
 *                                 adds to the run time), like a tightly coupled code
 *   mpi_bench tight N           : N MPI_Allreduce on MPI_COMM_SELF back to back (the cost of the
 *                                 call itself, to measure what instrumentation adds per call)
 *   mpi_bench selfpaced N PERIOD_US : as paced, on MPI_COMM_SELF: every rank busy and calling
 *                                 collectives at its own pace, none waiting for another (the
 *                                 busy job of tests/bench/bench_collector.py, oversubscribed)
 *   mpi_bench poll N            : N MPI_Testany on one receive that never completes (hpcc's
 *                                 RandomAccess polls so millions of times between its updates):
 *                                 what instrumentation adds to a test that completes nothing
 *   mpi_bench wait SECONDS      : rank 0 waits in one MPI_Recv while rank 1 sleeps SECONDS before
 *                                 sending: a rank that has nothing to do but poll (the control of
 *                                 tests/bench/displaced.py)
 * Prints one JSON line from rank 0: {"calls": N, "seconds": wall time of the loop}.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (argc < 3) {
        fprintf(stderr, "usage: mpi_bench paced|selfpaced N PERIOD_US | tight N | poll N | wait SECONDS\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (strcmp(argv[1], "wait") == 0) {
        double secs = atof(argv[2]), t0 = now();
        int x = 0;
        if (rank == 1) {
            struct timespec ts = {(time_t)secs, (long)((secs - (time_t)secs) * 1e9)};
            nanosleep(&ts, NULL);
            MPI_Send(&x, 1, MPI_INT, 0, 0, MPI_COMM_WORLD);
        } else if (rank == 0) {
            MPI_Recv(&x, 1, MPI_INT, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            printf("{\"calls\": 1, \"seconds\": %.6f}\n", now() - t0);
        }
        MPI_Finalize();
        return 0;
    }
    long n = atol(argv[2]);
    if (strcmp(argv[1], "poll") == 0) {
        int x = 0, index = 0, flag = 0;
        MPI_Request req;
        MPI_Irecv(&x, 1, MPI_INT, 0, 4242, MPI_COMM_SELF, &req); /* nobody sends tag 4242 */
        double t0 = now();
        for (long i = 0; i < n; i++)
            MPI_Testany(1, &req, &index, &flag, MPI_STATUS_IGNORE);
        double t1 = now();
        MPI_Cancel(&req);
        MPI_Wait(&req, MPI_STATUS_IGNORE);
        if (rank == 0)
            printf("{\"calls\": %ld, \"seconds\": %.6f}\n", n, t1 - t0);
        MPI_Finalize();
        return 0;
    }
    int self_paced = strcmp(argv[1], "selfpaced") == 0;
    int paced = self_paced || strcmp(argv[1], "paced") == 0;
    double period = paced && argc > 3 ? atof(argv[3]) * 1e-6 : 0;
    MPI_Comm comm = paced && !self_paced ? MPI_COMM_WORLD : MPI_COMM_SELF;
    double in = 1, out = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = now();
    for (long i = 0; i < n; i++) {
        if (paced) {
            double until = now() + period;
            while (now() < until)
                ;
        }
        MPI_Allreduce(&in, &out, 1, MPI_DOUBLE, MPI_SUM, comm);
    }
    double t1 = now();
    if (rank == 0)
        printf("{\"calls\": %ld, \"seconds\": %.6f}\n", n, t1 - t0);
    MPI_Finalize();
    return 0;
}
