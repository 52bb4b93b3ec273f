"""serve bench --multi-turn: conversations whose turns repeat the history, TTFT split by turn."""
from __future__ import annotations

from bench.client import RequestResult
from bench.metrics import TurnSplit, compute_metrics
from bench.report import RunInfo, format_report
from bench.workload import WorkloadSpec, make_conversations, max_conversation_tokens


def test_conversations_are_seeded_and_sized():
    spec = WorkloadSpec(num_prompts=3, input_len=20, output_len=5, shared_prefix_len=4, seed=7)
    convs = make_conversations(spec, 4, 6)
    assert convs == make_conversations(spec, 4, 6)
    assert len(convs) == 3 and all(c.num_turns == 4 for c in convs)
    assert all(len(c.turns[0]) == 20 and all(len(t) == 6 for t in c.turns[1:]) for c in convs)
    assert convs[0].turns[0][:4] == convs[1].turns[0][:4]  # the shared prefix (a system prompt)
    assert max_conversation_tokens(convs) == 20 + 3 * 6 + 4 * 5
    r = convs[1].request(2, [9, 9, 9])
    assert r.prompt == [9, 9, 9] + convs[1].turns[2] and r.index == 1 * 4 + 2 and r.output_len == 5


def test_turn_split_and_report():
    def result(turn, ttft):
        r = RequestResult(index=turn, prompt_len=10 * (turn + 1), success=True, output_tokens=2, e2el_s=ttft + 0.01)
        r.chunks = [(ttft, 1), (ttft + 0.01, 1)]
        r.turn = turn
        return r

    results = [result(0, 0.5), result(0, 0.7), result(1, 0.1), result(2, 0.2), result(1, 0.3)]
    split = TurnSplit.of(results)
    assert split.first_ttft.median == 600.0 and round(split.follow_up_ttft.median, 6) == 200.0
    assert split.first_prompt_tokens == 10 and split.follow_up_prompt_tokens == 23
    info = RunInfo(date="d", model=None, served_model_name="m", url="u", gpu=None,
                   workload=WorkloadSpec(2, 10, 2), concurrency=None, request_rate=None, ignore_eos=True,
                   kv_cache_dtype="auto", num_turns=3, turn_len=5)
    text = format_report(info, compute_metrics(results, 1.0), None, "", split)
    assert "Multi-turn: 2 conversations x 3 turns" in text
    assert "Median follow-up TTFT (ms):" in text and "P99 first-turn TTFT (ms):" in text


def test_multi_turn_against_fake_server(fake_server, bench):
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.001, tokens_per_chunk=(2,))
    code, res = bench("--url", srv.base_url, "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                      "--multi-turn", "3", "--turn-len", "5", "--ignore-eos", "--concurrency", "2", "--chunk-times")
    assert code == 0
    assert res["multi_turn"] and res["num_turns"] == 3 and res["num_conversations"] == 3
    assert res["clock_start_s"] > 0 and all(len(r["chunk_s"]) == 2 for r in res["requests"])  # 4 tokens, 2 a chunk
    assert (res["completed"], res["failed"]) == (9, 0)
    assert res["median_follow_up_ttft_ms"] is not None and res["median_first_turn_ttft_ms"] is not None
    assert sorted(r["turn"] for r in res["requests"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # each turn's prompt is the previous prompt, the reply's ids (the fake sends 0, 1, 2, 3), then 5 new tokens
    bodies = [b for b in srv.behaviour.seen if len(b["prompt"]) > 0]
    by_len = sorted(bodies, key=lambda b: len(b["prompt"]))
    lens = sorted({len(b["prompt"]) for b in bodies})
    assert lens[-3:] == [8, 8 + 4 + 5, 8 + 2 * (4 + 5)]
    longest = by_len[-1]["prompt"]
    assert longest[8:12] == [0, 1, 2, 3] and longest[17:21] == [0, 1, 2, 3]
    assert any(b["prompt"] == longest[:17] for b in bodies)  # its turn 1


def test_multi_turn_refuses_rate_sweeps(bench, capsys):
    code, _ = bench("--url", "http://127.0.0.1:9", "--multi-turn", "2", "--request-rate", "5")
    assert code == 2
    assert "--multi-turn" in capsys.readouterr().err
