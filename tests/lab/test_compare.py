import json

from lab.compare import compare, main


def test_speedup_direction():
    res = compare("median_ttft_ms", {"median_ttft_ms": 400.0}, {"on": {"median_ttft_ms": 80.0}}, lower_is_better=True)
    assert res["runs"][0]["speedup"] == 5.0
    res = compare("output_throughput", {"output_throughput": 100.0}, {"fp8": {"output_throughput": 150.0}}, False)
    assert res["runs"][0]["speedup"] == 1.5


def test_cli_writes_json(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"x": 2.0, "gpu": "G"}))
    (tmp_path / "b.json").write_text(json.dumps({"x": 3.0}))
    assert main(["--key", "x", "--baseline", str(tmp_path / "a.json"), "--out", str(tmp_path / "o.json"),
                 str(tmp_path / "b.json")]) == 0
    out = json.loads((tmp_path / "o.json").read_text())
    assert out["gpu"] == "G" and out["runs"][0]["speedup"] == 1.5
