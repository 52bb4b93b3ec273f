"""Python objects between two ranks over a gloo group, without waiting for the receiver: rank 0
posts each step to every other rank and goes on (a broadcast would wait for the slowest stage, which
is still busy with an earlier micro-batch), and the last stage posts the sampled tokens back.
A message is its pickle's length (one int64), then the pickle; sends to one rank arrive in order."""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

STEP_TAG = 1  # rank 0 -> every rank: a step, or stop
SAMPLES_TAG = 2  # the last stage's first rank -> rank 0: a step's samples


@dataclass
class Posted:
    """Sends in flight; their tensors stay referenced until they complete."""

    works: list
    tensors: list[torch.Tensor]

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout_s: float | None = None) -> None:
        for w in self.works:
            if timeout_s is None:
                w.wait()
            else:
                w.wait(datetime.timedelta(seconds=timeout_s))


def post(obj: Any, dsts: list[int], group: Any, tag: int) -> Posted:
    """Send obj to each rank of dsts (global ranks) and return at once."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    works = []
    for dst in dsts:
        works.append(dist.isend(size, dst=dst, group=group, tag=tag))
        works.append(dist.isend(data, dst=dst, group=group, tag=tag))
    return Posted(works, [size, data])


def receive(src: int, group: Any, tag: int) -> Any:
    """The next object src posted with tag (blocks until it arrives)."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group, tag=tag)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=group, tag=tag)
    return pickle.loads(data.numpy().tobytes())
