"""Past one device: tensor parallelism (parallel_state: the process group and its collectives; pynccl and
custom_all_reduce: the collectives between GPUs; workers: the processes that follow rank 0's steps) and data
parallelism (data_parallel: engine replicas in processes)."""
