"""An MPI program as users write them (mpi4py): every rank contributes its rank + 1 to one allreduce."""

from mpi4py import MPI

world = MPI.COMM_WORLD
total = world.allreduce(world.Get_rank() + 1, op=MPI.SUM)
print(f"rank {world.Get_rank()} of {world.Get_size()}: the sum over the world is {total}", flush=True)
