"""A user's MPI program (mpi4py): every rank adds its rank + 1 in one allreduce and checks MPI's view of the
world against the names clusterfit promises (RANK, WORLD_SIZE). Exits 1 on any mismatch."""

from __future__ import annotations

import os
import sys

from mpi4py import MPI


def main() -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    total = world.allreduce(rank + 1, op=MPI.SUM)
    expected = size * (size + 1) // 2
    if (str(rank), str(size)) != (os.environ.get("RANK"), os.environ.get("WORLD_SIZE")) or total != expected:
        print(f"mismatch: MPI rank {rank}/{size}, RANK={os.environ.get('RANK')}, sum {total} != {expected}", flush=True)
        sys.exit(1)
    print(f"mpi world of {size}: rank {rank} agrees on the sum {total}", flush=True)


if __name__ == "__main__":
    main()
