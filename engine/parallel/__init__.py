"""Tensor parallelism: the process group (group.py), its collectives (comm.py), the parallel layers
and weight shards (layers.py), and the workers that follow rank 0's steps (wire.py, worker.py,
executor.py). With one rank nothing here creates a process group and the model runs as before."""
