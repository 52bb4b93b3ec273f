"""The engine core's batch queue (pipeline parallelism) with a fake executor, torch-free: up to
max_concurrent_batches batches in flight, each of sequences in no other one and none chained to an
earlier launch; the same tokens as one batch at a time; a chunked prompt and preemption under it."""
import pytest

from scheduler.core import EngineCore
from scheduler.policy import SchedulerConfig
from scheduler.request import SampleOutput, SamplingParams
from serve.build import TokenIdTokenizer


def sample(batch):
    """The token sampled at position p is 1000 + p + 1: the same whatever batch a sequence is in."""
    return [SampleOutput(1000 + it.end) if it.samples else None for it in batch.items]


class SyncExecutor:
    def execute(self, batch):
        return sample(batch)


class QueueExecutor:
    overlap = True

    def __init__(self, depth):
        self.max_concurrent_batches = depth
        self.in_flight = {}  # handle -> seq ids
        self.launches = 0
        self.sizes = []

    def launch(self, batch, prev):
        assert prev is None
        ids = {it.seq.seq_id for it in batch.items}
        for other in self.in_flight.values():
            assert not ids & other, "a sequence in two batches in flight"
        assert len(self.in_flight) < self.max_concurrent_batches
        assert all(it.seq.num_pending == it.samples for it in batch.items)  # nothing pending from before
        self.launches += 1
        self.sizes.append(len(ids))
        self.in_flight[self.launches] = ids
        return self.launches, batch

    def collect(self, handle):
        key, batch = handle
        assert key == min(self.in_flight), "collected out of launch order"
        del self.in_flight[key]
        return sample(batch)


def run(executor, num_blocks=64, budget=64, n=5):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=128)
    core = EngineCore(executor, TokenIdTokenizer(2000), cfg, num_blocks, 4, frozenset())
    seqs = [core.add_request(list(range(10, 13 + 7 * i)), SamplingParams(max_tokens=6 + 3 * i, temperature=0.0,
                                                                          ignore_eos=True)) for i in range(n)]
    streamed = {s.seq_id: [] for s in seqs}
    for _ in range(2000):
        if not core.has_unfinished():
            break
        for out in core.step():
            assert out.error is None
            streamed[out.seq_id] += out.new_token_ids
    core.scheduler.check_integrity()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return [streamed[s.seq_id] for s in seqs], core


@pytest.mark.parametrize("kw", [{}, {"budget": 8}, {"num_blocks": 16, "budget": 8}], ids=["plain", "chunked", "preempt"])
@pytest.mark.parametrize("depth", [2, 3])
def test_queue_gives_the_tokens_of_one_batch_at_a_time(kw, depth):
    want, _ = run(SyncExecutor(), **kw)
    ex = QueueExecutor(depth)
    got, core = run(ex, **kw)
    assert got == want
    assert core.stats.max_in_flight == depth  # the queue filled: every stage had a micro-batch
    assert not ex.in_flight
    if "num_blocks" in kw:
        assert core.stats.num_preemptions > 0


def test_micro_batches_share_the_sequences():
    ex = QueueExecutor(2)
    run(ex, n=4)
    assert max(ex.sizes) == 2  # four sequences, two in each batch, not all in the first


def test_one_batch_at_a_time_keeps_its_single_slot():
    """Without a queue (and without overlap) a step runs and is processed before the next."""
    _, core = run(SyncExecutor())
    assert core.stats.max_in_flight == 0
