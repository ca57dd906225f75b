"""A known mix of MPI calls, for the collectives tests and the benchmark (run under mpirun).

Every rank makes exactly the calls of PLAN (tests/test_bpf_collectives.py counts them): on
MPI_COMM_WORLD, on a communicator split by rank parity, on a dup of that split, then frees both.
Buffers are numpy arrays so that mpi4py calls the C functions (its lower-case pickle forms do not).
Usage: mpi_collectives.py [--repeat N] [--completions] [--burst] [--create] [--persistent]

--completions adds, on MPI_COMM_WORLD, a ring exchange per completion call of COMPLETION_PLAN: each
rank posts an Irecv from its left and an Isend to its right, completed by that call (Waitany and
Testany one request per call until both are done, Waitsome and Testsome some at a time; and again
Testany on a list of one request, each polled until it completes, as hpcc's RandomAccess polls).

--burst adds, on MPI_COMM_WORLD, a burst per call of BURST_PLAN: an Irecv per tag from the left,
then an Isend of one number per tag to the right, all completed by that call. MPI completes such
small sends at once and may return one handle for all of them (Open MPI's ompi_request_empty, MPICH's
builtin request), as MEEP's halo exchange shows.

--create adds MPI_Comm_create on MPI_COMM_WORLD with disjoint groups (the lower and the upper half of
the ranks: one communicator per group from one call) and CREATE_PLAN on each.

--persistent adds, on MPI_COMM_WORLD, a ring exchange through persistent requests (MPI_Send_init and
MPI_Recv_init once, then PERSISTENT_STARTS rounds of MPI_Startall and MPI_Waitall), tag PERSISTENT_TAG.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing

import numpy as np

if typing.TYPE_CHECKING:
    from mpi4py import MPI

# op -> (calls per repeat on WORLD, elements, numpy dtype); bytes = elements * itemsize
WORLD_PLAN = {
    "MPI_Allreduce": (3, 10, np.float64),
    "MPI_Reduce": (2, 7, np.int32),  # root 1: arguments 6 (root) and 7 (comm, on the stack)
    "MPI_Bcast": (2, 5, np.float64),
    "MPI_Barrier": (2, 0, None),
    "MPI_Allgather": (1, 3, np.float64),  # comm is argument 7 (stack)
    "MPI_Gather": (1, 4, np.int64),  # root 2 (stack), comm (stack)
    "MPI_Alltoall": (1, 2, np.float32),
    "MPI_Scan": (1, 6, np.int32),
    "MPI_Iallreduce": (1, 8, np.float64),  # + one MPI_Wait row naming it
}
SPLIT_PLAN = {"MPI_Allreduce": (4, 16, np.float32), "MPI_Bcast": (1, 3, np.int32)}
DUP_PLAN = {"MPI_Barrier": (2, 0, None), "MPI_Allreduce": (1, 1, np.float64)}
CREATE_PLAN = {"MPI_Allreduce": (3, 4, np.float64)}
PERSISTENT_STARTS, PERSISTENT_TAG = 5, 21
SENDRECV_TAG = 7
# (completion call, tag of its ring exchange, each request alone: the interposer's one-request path)
COMPLETION_PLAN = (("MPI_Waitany", 21, False), ("MPI_Waitsome", 22, False), ("MPI_Testany", 23, False),
                   ("MPI_Testsome", 24, False), ("MPI_Testany", 25, True))
BURST_PLAN = (("MPI_Waitall", (31, 32, 33)), ("MPI_Waitsome", (34, 35, 36)))


def run_plan(comm: MPI.Intracomm, plan: dict, repeat: int) -> None:
    from mpi4py import MPI

    size = comm.Get_size()
    for _ in range(repeat):
        for op, (n, elems, dt) in plan.items():
            for _ in range(n):
                buf = np.arange(elems, dtype=dt) if dt is not None else None
                out = np.zeros(elems, dtype=dt) if dt is not None else None
                if op == "MPI_Allreduce":
                    comm.Allreduce(buf, out, op=MPI.SUM)
                elif op == "MPI_Reduce":
                    comm.Reduce(buf, out, op=MPI.SUM, root=1 % size)
                elif op == "MPI_Bcast":
                    comm.Bcast(buf, root=0)
                elif op == "MPI_Barrier":
                    comm.Barrier()
                elif op == "MPI_Allgather":
                    comm.Allgather(buf, np.zeros(elems * size, dtype=dt))
                elif op == "MPI_Gather":
                    comm.Gather(buf, np.zeros(elems * size, dtype=dt), root=2 % size)
                elif op == "MPI_Alltoall":
                    comm.Alltoall(np.arange(elems * size, dtype=dt), np.zeros(elems * size, dtype=dt))
                elif op == "MPI_Scan":
                    comm.Scan(buf, out, op=MPI.SUM)
                elif op == "MPI_Iallreduce":
                    comm.Iallreduce(buf, out, op=MPI.SUM).Wait()
                else:
                    raise ValueError(op)


def complete_some(world: MPI.Intracomm, right: int, left: int) -> None:
    from mpi4py import MPI

    for call, tag, alone in COMPLETION_PLAN:
        got = np.zeros(5, dtype=np.int64)
        reqs = [world.Irecv(got, source=left, tag=tag), world.Isend(np.full(5, tag, dtype=np.int64), dest=right, tag=tag)]
        done = 0
        if alone:
            for req in reqs:
                index, flag = MPI.Request.Testany([req])
                while not (flag and index != MPI.UNDEFINED):
                    index, flag = MPI.Request.Testany([req])
            done = len(reqs)
        while done < len(reqs):
            if call == "MPI_Waitany":
                done += MPI.Request.Waitany(reqs) != MPI.UNDEFINED
            elif call == "MPI_Testany":
                index, flag = MPI.Request.Testany(reqs)
                done += bool(flag) and index != MPI.UNDEFINED
            elif call == "MPI_Waitsome":
                done += len(MPI.Request.Waitsome(reqs) or [])
            else:
                done += len(MPI.Request.Testsome(reqs) or [])
        assert int(got[0]) == tag


def burst(world: MPI.Intracomm, right: int, left: int) -> None:
    from mpi4py import MPI

    for call, tags in BURST_PLAN:
        got = np.zeros(len(tags), dtype=np.int64)
        reqs = [world.Irecv(got[k:k + 1], source=left, tag=tag) for k, tag in enumerate(tags)]
        reqs += [world.Isend(np.full(1, tag, dtype=np.int64), dest=right, tag=tag) for tag in tags]
        if call == "MPI_Waitall":
            MPI.Request.Waitall(reqs)
        else:
            done = 0
            while done < len(reqs):
                done += len(MPI.Request.Waitsome(reqs) or [])
        assert got.tolist() == list(tags)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--completions", action="store_true")
    ap.add_argument("--burst", action="store_true")
    ap.add_argument("--create", action="store_true")
    ap.add_argument("--persistent", action="store_true")
    args = ap.parse_args()
    from mpi4py import MPI  # imported here so that tests can read the plan without starting MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    run_plan(world, WORLD_PLAN, args.repeat)
    # Point to point: a ring of MPI_Sendrecv (12 arguments: 7..12 on the stack), then Send/Recv.
    right, left = (rank + 1) % size, (rank - 1) % size
    send = np.full(9, rank, dtype=np.int32)
    recv = np.zeros(9, dtype=np.int32)
    world.Sendrecv(send, dest=right, sendtag=SENDRECV_TAG, recvbuf=recv, source=left, recvtag=SENDRECV_TAG)
    if rank == 0:
        world.Send(np.zeros(11, dtype=np.float64), dest=1 % size, tag=3)
    elif rank == 1:
        world.Recv(np.zeros(11, dtype=np.float64), source=0, tag=3)
    if args.completions:
        complete_some(world, right, left)
    if args.burst:
        burst(world, right, left)
    if args.persistent:
        out, inb = np.full(6, rank, dtype=np.int32), np.zeros(6, dtype=np.int32)
        reqs = [world.Send_init(out, dest=right, tag=PERSISTENT_TAG), world.Recv_init(inb, source=left, tag=PERSISTENT_TAG)]
        for _ in range(PERSISTENT_STARTS):
            MPI.Prequest.Startall(reqs)
            MPI.Request.Waitall(reqs)
            assert int(inb[0]) == left
        for r in reqs:
            r.Free()
    split = world.Split(color=rank % 2, key=rank)
    split.Get_rank(), split.Get_size()
    run_plan(split, SPLIT_PLAN, args.repeat)
    dup = split.Dup()
    run_plan(dup, DUP_PLAN, args.repeat)
    dup.Free()
    split.Free()
    if args.create:
        half = list(range(size // 2)) if rank < size // 2 else list(range(size // 2, size))
        group = world.Get_group().Incl(half)
        created = world.Create(group)
        group.Free()
        run_plan(created, CREATE_PLAN, args.repeat)
        created.Free()
    print(json.dumps({"rank": rank, "size": size}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
