"""lab/spawn.py on the CPU (gloo): two spawned ranks, rank 0's result back; a failing rank's
traceback back instead of a hang."""
from __future__ import annotations

from lab.spawn import rank0_result


def _agree(rank: int, port: int, base: int):
    from engine.parallel.comm import Comm
    from engine.parallel.group import connect_store, init_group, rank_env

    env = rank_env("127.0.0.1", port, rank, 2)
    comm = Comm(init_group(env, "cpu", store=connect_store(env)))
    return {"rank": rank, "smallest": comm.min_int(base + rank)}, comm


def _fail(rank: int, port: int):
    raise ValueError(f"rank {rank} gives up")


def test_rank_zero_result_then_the_ranks_leave():
    assert rank0_result(_agree, 2, (5,), timeout_s=120) == {"rank": 0, "smallest": 5}


def test_a_failing_rank_sends_its_traceback():
    got = rank0_result(_fail, 2, (), timeout_s=120)
    assert "ValueError" in got["error"] and "gives up" in got["error"]
