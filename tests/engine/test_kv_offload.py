"""The host tier of the prefix cache through LLM (float32, CPU): with a device pool too small for
the working set, greedy outputs equal the run without offload; blocks go down and come back."""
import random

import pytest

from serve import LLM, SamplingParams
from tests.models import VOCAB, build_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BLOCKS = 12  # of 16 tokens: a conversation's history (up to ~7 blocks) and its reply; never all of them


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("offload") / "llama")


def conversations(n=4, turns=3, seed=0):
    """Turn t of conversation c: its history (the earlier prompts and replies), then new tokens."""
    rng = random.Random(seed)
    return [[[rng.randrange(3, VOCAB) for _ in range(rng.randrange(20, 36))] for _ in range(turns)] for _ in range(n)]


def run_turns(llm, convs, params=GREEDY):
    """Every conversation's turn 0, then every turn 1, ...: each prompt repeats its history, which the
    other conversations' turns pushed out of the device cache meanwhile (lab/offload_gpu.py's check
    runs it too)."""
    history = [[] for _ in convs]
    outs = []
    for t in range(len(convs[0])):
        for c, turns in enumerate(convs):
            prompt = history[c] + turns[t]
            out = llm.generate([prompt], params)[0].token_ids
            history[c] = prompt + out
            outs.append(out)
    return outs


def build(path, gib, **kw):
    return LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=BLOCKS, **kw, kv_offload_gib=gib)


@pytest.fixture(scope="module")
def baseline(llama):
    """The no-offload run's outputs and its LLM."""
    base = build(llama, 0)
    return run_turns(base, conversations()), base


def test_offload_equals_no_offload_and_blocks_come_back(llama, baseline):
    convs = conversations()
    want, base = baseline
    llm = build(llama, 0.001)  # ~128 host blocks: all the histories
    got = run_turns(llm, convs)
    assert got == want
    core = llm.engine.core
    bm, sched = core.block_manager, core.scheduler
    assert bm.num_blocks_out > 0 and bm.num_blocks_in > 0
    assert sched.prefix_cache_host_hits > 0
    # recomputed prompt tokens drop: more of each prompt came from a cache
    assert sched.prefix_cache_hits > base.engine.core.scheduler.prefix_cache_hits
    copier = llm.engine.runner.offload
    assert copier.bytes_out == bm.num_blocks_out * bm.host.block_bytes
    assert copier.bytes_in == bm.num_blocks_in * bm.host.block_bytes
    assert bm.num_free_blocks == BLOCKS
    sched.check_integrity()
    bm.host.check_integrity()


def test_offload_batched_with_preemption_and_aborts(llama):
    """All conversations at once per turn: the small pool preempts; then aborts mid-run leave no
    block held in either tier beyond what the cache keeps."""
    convs = conversations(n=5, turns=2, seed=1)
    want_llm = build(llama, 0)
    llm = build(llama, 0.001)
    for t in range(2):
        prompts = [sum(turns[:t + 1], []) for turns in convs]
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == \
            [o.token_ids for o in want_llm.generate(prompts, GREEDY)]
    core = llm.engine.core
    # preempted sequences come back through the cache: their full blocks from either tier
    assert core.stats.num_preemptions > 0 and core.block_manager.num_blocks_in > 0
    # aborts: start some long requests, step a little, abort them all
    seqs = [core.add_request(sum(turns, []), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            for turns in convs]
    for _ in range(3):
        core.step()
    for s in seqs:
        core.abort(s.seq_id)
    while core.has_unfinished():
        core.step()
    bm = core.block_manager
    assert bm.num_free_blocks == BLOCKS
    core.scheduler.check_integrity()
    bm.host.check_integrity()
    assert not bm.host.pinned


def test_offload_moves_int8_scales(llama):
    convs = conversations(n=4, turns=2, seed=2)
    want = run_turns(build(llama, 0, kv_cache_dtype="int8", block_size=16), convs)
    llm = build(llama, 0.001, kv_cache_dtype="int8", block_size=16)
    assert run_turns(llm, convs) == want
    assert llm.engine.core.block_manager.num_blocks_in > 0


def test_offload_bad_sizes(llama):
    with pytest.raises(ValueError, match="kv_offload_gib must be"):
        build(llama, -1)
    with pytest.raises(ValueError, match="RAM"):
        build(llama, 1 << 20)
    with pytest.raises(ValueError, match="prefix caching"):
        build(llama, 0.001, enable_prefix_caching=False)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_offload_with_parallel_ranks(llama, baseline, parallel):
    """Each rank keeps its shard of the host tier (gloo on the CPU); the outputs are one GPU's."""
    with build(llama, 0.001, **parallel) as llm:
        assert run_turns(llm, conversations()) == baseline[0]
        bm = llm.engine.core.block_manager
        assert bm.num_blocks_in > 0
        assert bm.num_free_blocks == BLOCKS
