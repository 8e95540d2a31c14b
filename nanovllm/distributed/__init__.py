"""Past one device: tensor parallelism (parallel_state: the process group and its collectives; workers: the processes
that follow rank 0's steps)."""
