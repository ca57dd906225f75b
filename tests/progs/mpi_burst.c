/* Program of tests/test_fastpath.py: a burst of small sends completed one at a time.
 * Each rank posts three MPI_Isend of one int to its right neighbour, tags 41, 42, 43 in that order,
 * into reqs[2], reqs[0] and reqs[1]: MPI completes such sends at once and may return one handle for
 * all three (Open MPI's ompi_request_empty). Then three MPI_Irecv from its left into reqs[3..5], and
 * MPI_Waitany until all six are done. Prints one JSON line per rank: its pid, rank, and the tags of
 * its sends in the order MPI_Waitany completed them, which the interposer's completion rows must
 * name in the same order (it takes a request back by the array element that held it). */
#include <mpi.h>
#include <stdio.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int right = (rank + 1) % size, left = (rank + size - 1) % size;
    static const int slot_of_tag[3] = {2, 0, 1}; /* tag 41 + k goes to reqs[slot_of_tag[k]] */
    int tag_of_slot[3], out[3] = {41, 42, 43}, in[3] = {0, 0, 0};
    MPI_Request reqs[6];
    for (int k = 0; k < 3; k++) {
        MPI_Isend(&out[k], 1, MPI_INT, right, 41 + k, MPI_COMM_WORLD, &reqs[slot_of_tag[k]]);
        tag_of_slot[slot_of_tag[k]] = 41 + k;
    }
    for (int k = 0; k < 3; k++)
        MPI_Irecv(&in[k], 1, MPI_INT, left, 41 + k, MPI_COMM_WORLD, &reqs[3 + k]);
    int sent[3], nsent = 0;
    for (int done = 0; done < 6; done++) {
        int index;
        MPI_Waitany(6, reqs, &index, MPI_STATUS_IGNORE);
        if (index >= 0 && index < 3)
            sent[nsent++] = tag_of_slot[index];
    }
    printf("{\"pid\": %d, \"rank\": %d, \"right\": %d, \"send_tags\": [%d, %d, %d]}\n", (int)getpid(), rank, right,
           sent[0], sent[1], sent[2]);
    MPI_Finalize();
    return in[0] == 41 && in[1] == 42 && in[2] == 43 ? 0 : 1;
}
