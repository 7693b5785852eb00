"""The job service: a store of jobs, their one truthful state, and the processes that run them."""
