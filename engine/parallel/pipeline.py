"""Rank 0's executor for several pipeline stages: a batch queue (scheduler/core.py) of up to one
micro-batch per stage, so that every stage has work.

launch() posts the step to every other rank (channel.py: without waiting for the stages still busy
with earlier micro-batches), runs stage 0's layers and sends the carry on; collect() takes the
step's samples from the last stage's first rank, in launch order. The lifecycle (spawned ranks,
a rank that dies -> ExecutorLost, stop) is TPExecutor's; the other ranks run worker.py's
follow_stages()."""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from engine.parallel.channel import SAMPLES_TAG, STEP_TAG, Posted, post, receive
from engine.parallel.executor import STOP_TIMEOUT_S, TPExecutor, TPLaunched, Workers
from engine.parallel.topology import Topology
from engine.runner import ModelRunner
from scheduler.request import Batch, SampleOutput


@dataclass
class _Posted:
    step: int
    sends: Posted


class PipelineExecutor(TPExecutor):
    def __init__(self, runner: ModelRunner, topo: Topology, workers: Workers | None) -> None:
        assert topo.pipe is not None and topo.is_driver
        super().__init__(runner, topo.world, workers)
        self.topo = topo
        self.overlap = True  # launch() returns before the step's tokens exist, on any device
        self.max_concurrent_batches = topo.pipe.stage.size
        self._others = list(range(1, topo.world.size))
        self._last = topo.world.size - topo.tp.size  # the last stage's first rank: it sends the samples
        self._posted: deque[_Posted] = deque()
        self._steps = itertools.count()

    def launch(self, batch: Batch, prev: TPLaunched | None = None) -> TPLaunched:
        assert prev is None, "a pipeline's micro-batches are of disjoint sequences"
        step = next(self._steps)
        self._send(("launch", step, self._encoder.encode(batch)))
        return TPLaunched(step, self._run(self.runner.launch, batch))

    def collect(self, handle: TPLaunched) -> list[SampleOutput | None]:
        self._run(self.runner.collect, handle.inner)  # stage 0's carry has left
        step, samples = self._run(receive, self._last, self.group.control, SAMPLES_TAG)
        assert step == handle.step, f"samples of step {step} came back for step {handle.step}"
        # every rank has read this step's message once its samples exist: those sends are done
        while self._posted and self._posted[0].step <= step:
            self._posted.popleft().sends.wait()
        return samples

    def execute(self, batch: Batch) -> list[SampleOutput | None]:
        return self.collect(self.launch(batch))

    def _post(self, msg: tuple) -> None:
        self._posted.append(_Posted(msg[1] if msg[0] == "launch" else -1, post(msg, self._others, self.group.control,
                                                                                STEP_TAG)))

    def _stop_ranks(self) -> None:
        sends = post(("stop",), self._others, self.group.control, STEP_TAG)
        sends.wait(STOP_TIMEOUT_S)  # before the group goes: an unsent stop would leave the ranks waiting
