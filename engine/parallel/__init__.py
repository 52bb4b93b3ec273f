"""Tensor and pipeline parallelism: the process groups (group.py, topology.py), their collectives
(comm.py), the parallel layers and weight shards (layers.py), a stage's layers (stage.py), and the
ranks that follow rank 0's steps (wire.py, channel.py, worker.py, executor.py, pipeline.py). With one
rank nothing here creates a process group and the model runs as before."""
