"""The runner's per-sequence block-table rows follow appends and preemptions."""
import numpy as np

from serve import LLM


def test_table_rows_follow_appends_and_new_tables(tiny_models):
    runner = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", num_kv_blocks=32).engine.runner
    table = [3, 1]
    row = runner._table_row(7, table)
    assert list(row[:3]) == [3, 1, 0]
    table.append(9)  # the block manager extends the same list
    assert list(runner._table_row(7, table)[:4]) == [3, 1, 9, 0]
    fresh = [5]  # preempted and re-admitted: a new list, shorter, other blocks
    row = runner._table_row(7, fresh)
    assert list(row[:3]) == [5, 0, 0]
    assert row.dtype == np.int32 and row.shape == (runner.max_blocks_per_seq,)
