"""The runner's per-sequence block-table rows follow appends and preemptions."""
import numpy as np

from serve import LLM


def test_table_rows_follow_appends_and_new_tables(tiny_models):
    runner = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", num_kv_blocks=32).engine.runner
    runner._reserve_rows(1)

    def row(seq_id: int, table: list[int]) -> np.ndarray:
        return runner._row_store[runner._table_row(seq_id, table)]

    table = [3, 1]
    assert list(row(7, table)[:3]) == [3, 1, 0]
    table.append(9)  # the block manager extends the same list
    assert list(row(7, table)[:4]) == [3, 1, 9, 0]
    fresh = [5]  # preempted and re-admitted: a new list, shorter, other blocks
    r = row(7, fresh)
    assert list(r[:3]) == [5, 0, 0]
    assert r.dtype == np.int32 and r.shape == (runner.max_blocks_per_seq,)


def test_a_full_row_store_drops_finished_rows_before_a_step(tiny_models):
    runner = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", num_kv_blocks=32,
                 max_num_seqs=2).engine.runner
    runner._reserve_rows(2)
    capacity = len(runner._row_store)
    for seq_id in range(capacity):  # finished sequences fill the store
        runner._table_row(seq_id, [seq_id])
    runner._reserve_rows(2)  # the next step's two sequences need room: the store starts over
    a, b = runner._table_row(100, [4, 2]), runner._table_row(101, [6])
    assert a != b
    assert list(runner._row_store[a][:3]) == [4, 2, 0] and list(runner._row_store[b][:2]) == [6, 0]
