"""Every environment variable clusterfit itself passes from the launching side to the workers.

The workers also read torch.distributed's standard variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), which torchrun sets on every engine; those are read in one place, `worker/dist.py`."""

RANK_LOG_ENV = "CLUSTERFIT_RANK_LOG"  # this rank's logs/rank-N.log: the worker points its stderr there too
ATTEMPT_ENV = "CLUSTERFIT_ATTEMPT"  # which run of the job this is, from 1 (set by the job service)
STORAGE_SAS_TOKEN_ENV = "CLUSTERFIT_STORAGE_SAS_TOKEN"  # storage.sas_token, never written into job.yaml
FAULT_ENV = "CLUSTERFIT_FAULT"  # a failure to inject for tests: KIND:rank=R:step=S[:attempt=A]
SPEC_ENV = "CLUSTERFIT_SPEC"  # a command job's resolved job.yaml, for clusterfit.session in the user's script
LIVENESS_ENV = "CLUSTERFIT_LIVENESS"  # PID:START_TIME of the command wrapper's liveness heartbeat process
MPI_LAUNCHES_ENV = "CLUSTERFIT_MPI_LAUNCHES"  # an mpi job on Ray: where node 0's mpirun leaves its daemons' commands
