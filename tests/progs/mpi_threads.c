/* Program of tests/test_fastpath.py: requests started and completed by several threads of a rank at
 * once (MPI_THREAD_MULTIPLE). Each of THREADS threads sends ROUNDS messages of one int to the right
 * neighbour and receives as many from the left, all on its own tag (100 + thread), each round an
 * MPI_Isend and an MPI_Irecv completed by MPI_Wait. A small send is completed at once, and Open MPI
 * then returns one handle (ompi_request_empty) for all of them: the threads' sends share one handle
 * and so one window of the interposer's request table, which they write at the same time. Prints one
 * JSON line per rank: its pid, rank, neighbours and the kernel thread ids of its threads in tag order;
 * every completion row a thread makes must name its own tag, its own peer and its rounds in order. */
#define _GNU_SOURCE
#include <mpi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define THREADS 4

static int rounds, right, left;
static int tids[THREADS];
static int failed;

static void *exchange(void *arg)
{
    int t = (int)(long)arg, tag = 100 + t;
    tids[t] = (int)syscall(SYS_gettid);
    for (int i = 0; i < rounds; i++) {
        int out = i, in = -1;
        MPI_Request send, recv;
        MPI_Isend(&out, 1, MPI_INT, right, tag, MPI_COMM_WORLD, &send);
        MPI_Irecv(&in, 1, MPI_INT, left, tag, MPI_COMM_WORLD, &recv);
        MPI_Wait(&send, MPI_STATUS_IGNORE);
        MPI_Wait(&recv, MPI_STATUS_IGNORE);
        if (in != i)
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    int provided, rank, size;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    if (provided != MPI_THREAD_MULTIPLE) {
        printf("{\"provided\": %d}\n", provided);
        MPI_Finalize();
        return 3;
    }
    rounds = argc > 1 ? atoi(argv[1]) : 2000;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    right = (rank + 1) % size;
    left = (rank + size - 1) % size;
    pthread_t threads[THREADS];
    for (long t = 0; t < THREADS; t++)
        pthread_create(&threads[t], NULL, exchange, (void *)t);
    for (int t = 0; t < THREADS; t++)
        pthread_join(threads[t], NULL);
    printf("{\"pid\": %d, \"rank\": %d, \"right\": %d, \"left\": %d, \"tids\": [%d, %d, %d, %d]}\n", (int)getpid(),
           rank, right, left, tids[0], tids[1], tids[2], tids[3]);
    MPI_Finalize();
    return failed;
}
