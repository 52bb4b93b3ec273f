"""serve/router.py: the longest cached prefix wins unless its replica is too busy; else the least
loaded replica; bounded memory; failed replicas get nothing."""
from __future__ import annotations

import pytest

from kvcache.block_manager import BlockManager, lora_root
from serve.router import Load, NoReplica, Router, RouterConfig, prompt_block_hashes

B = 4  # block size
IDLE = [Load(), Load()]


def router(n: int = 2, capacity: int = 64, **kw) -> Router:
    return Router(RouterConfig(B, (capacity,) * n, **kw))


def prompt(seed: int, length: int = 12) -> list[int]:
    return [seed * 1000 + i for i in range(length)]


def test_hashes_are_the_engines():
    ids = prompt(1, 11)  # two full blocks and a partial one
    bm = BlockManager(8, B)
    assert prompt_block_hashes(ids, B) == bm.prefix_hashes(ids, [])
    assert len(prompt_block_hashes(ids, B)) == 2 and prompt_block_hashes(ids[:3], B) == []
    # a LoRA adapter's chain: the engine's, and none of the base model's
    root = lora_root(2)
    assert prompt_block_hashes(ids, B, root) == bm.prefix_hashes(ids, [], root=root)
    assert not set(prompt_block_hashes(ids, B, root)) & set(prompt_block_hashes(ids, B))
    r = router()
    first = r.route(ids, IDLE, root).replica
    assert r.route(ids, IDLE).reason == "load"  # the base model's prompt is not where the adapter's went
    assert r.route(ids, IDLE, root) == r.route(ids, IDLE, root) and r.route(ids, IDLE, root).replica == first


def test_idle_replicas_take_turns():
    r = router(3)
    loads = [Load()] * 3
    assert [r.route(prompt(i), loads).replica for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert r.routed == [2, 2, 2]


def test_least_loaded_by_sequences_then_prompt_tokens():
    r = router()
    assert r.route(prompt(1), [Load(3, 10), Load(2, 5000)]).replica == 1
    assert r.route(prompt(2), [Load(2, 900), Load(2, 800)]).replica == 1
    route = r.route(prompt(3), [Load(2, 700), Load(2, 800)])
    assert (route.replica, route.reason, route.cached_tokens) == (0, "load", 0)


def test_a_repeated_prompt_goes_where_its_prefix_is():
    r = router()
    first = r.route(prompt(7), IDLE)
    again = r.route(prompt(7), IDLE)  # the round robin alone would pick the other replica
    assert again.replica == first.replica
    assert (again.reason, again.cached_tokens) == ("prefix", 12)


def test_the_longest_match_wins():
    r = router()
    shared = prompt(5, 8)  # two blocks
    assert r.route(shared + [1, 2, 3, 4], IDLE).replica == 0
    assert r.route(shared[:4] + [9] * 8, IDLE).replica == 0  # one block matches there
    # replica 0 is too busy for its two blocks: replica 1 gets the prompt, four blocks of it
    longer = shared + [7] * 4 + [8] * 4
    assert r.route(longer, [Load(5), Load(0)]).replica == 1
    route = r.route(longer + [6], IDLE)
    assert (route.replica, route.reason, route.cached_tokens) == (1, "prefix", 16)


def test_a_partial_block_does_not_match():
    r = router()
    assert r.route([1, 2, 3], IDLE).replica == 0
    route = r.route([1, 2, 3], IDLE)
    assert (route.replica, route.reason) == (1, "load")


def test_a_busy_holder_loses_to_the_least_loaded():
    r = router(balance_abs=4, balance_rel=1.25)
    assert r.route(prompt(1), IDLE).replica == 0
    # within 1.25 x 8 + 4 = 14 sequences: the cache wins
    assert r.route(prompt(1), [Load(14), Load(8)]).reason == "prefix"
    route = r.route(prompt(1), [Load(15), Load(8)])
    assert (route.replica, route.reason) == (1, "load")
    # both hold it now: the less loaded holder
    assert r.route(prompt(1), [Load(5), Load(3)]).replica == 1


def test_memory_is_bounded_and_prefixes_outlive_their_continuations():
    r = router(1, capacity=4)
    r.route(prompt(1, 16), [Load()])  # 4 blocks
    assert r.num_remembered(0) == 4
    r.route(prompt(2, 8), [Load()])  # 2 more: the two deepest blocks of prompt 1 go
    assert r.num_remembered(0) == 4
    assert r.route(prompt(2, 8), [Load()]).cached_tokens == 8
    assert r.route(prompt(1, 16), [Load()]).cached_tokens == 8


def test_a_failed_replica_gets_nothing():
    r = router()
    assert r.route(prompt(1), IDLE).replica == 0
    r.remove(0)
    assert r.num_remembered(0) == 0
    assert [r.route(prompt(1), IDLE).replica for _ in range(3)] == [1, 1, 1]
    r.remove(1)
    with pytest.raises(NoReplica):
        r.route(prompt(1), IDLE)


def test_bad_config():
    with pytest.raises(ValueError, match="capacity_blocks"):
        RouterConfig(16, ())
    with pytest.raises(ValueError, match="balance"):
        RouterConfig(16, (8,), balance_rel=0.5)
    with pytest.raises(ValueError, match="loads"):
        router().route([1], [Load()])


def test_a_replica_that_takes_nothing_now_is_skipped_but_remembered():
    r = router()
    assert r.route(prompt(1), IDLE).replica == 0
    assert r.route(prompt(1), [None, Load()]).replica == 1  # replica 0 is stopping: not removed, skipped
    assert r.route(prompt(1), [Load(), None]).reason == "prefix"
    with pytest.raises(NoReplica, match="no replica is accepting"):
        r.route(prompt(1), [None, None])
