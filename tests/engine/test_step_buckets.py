from engine.piecewise import piecewise_buckets
from engine.step_graph import step_buckets


def test_step_buckets_pad_less_than_an_eighth_from_512_tokens():
    b = step_buckets(2304)
    assert b[0] == 16 and b[-1] == 2304 and b == sorted(set(b))
    assert set(piecewise_buckets(2304)) <= set(b)  # never coarser than the piecewise graphs
    for n in range(513, 2305):
        t = min(x for x in b if x >= n)
        assert (t - n) * 8 < n, (n, t)
    assert 576 in b  # 64 decodes + one 512-token prompt: no padding
    assert step_buckets(100) == [16, 32, 64, 100]
    assert step_buckets(1000)[-3:] == [896, 960, 1000]


def test_piecewise_graphs_take_the_fine_sizes_that_no_whole_step_graph_takes():
    # the prompt budget fills step_buckets' sizes; a mixed step past the whole-step graphs (under TP,
    # on a pipeline stage) replays the piecewise graphs, which then hold those sizes too
    assert piecewise_buckets(1024, fine_above=0) == step_buckets(1024)
    b = piecewise_buckets(1024, fine_above=640)
    assert 576 not in b and {704, 768, 832, 896, 960, 1024} <= set(b)
    assert piecewise_buckets(1024, fine_above=1024) == piecewise_buckets(1024)
