"""bench/gpu_monitor.py: nvidia-smi's samples beside a run, summarized per GPU."""
from __future__ import annotations

import stat
import sys
import time

from bench.client import RequestResult
from bench.gpu_monitor import GpuMonitor, summarize
from bench.metrics import compute_metrics
from bench.report import RunInfo, format_report
from bench.workload import WorkloadSpec

# what `nvidia-smi --query-gpu=index,clocks.sm,power.draw,clocks_event_reasons.active
# --format=csv,noheader,nounits` printed on an H100 host (2026-11-27), and a field it could not read
LINES = """0, 1980, 210.50, 0x0000000000000000
1, 1965, 205.10, 0x0000000000000000
0, 1395, 698.31, 0x0000000000000004
1, 1470, 692.43, 0x0000000000000004
0, 1305, 701.04, 0x0000000000000004
1, [N/A], 690.00, 0x0000000000000004
"""


def test_summary_per_gpu():
    s = summarize(LINES)
    assert [g["index"] for g in s] == [0, 1]
    g0, g1 = s
    assert (g0["samples"], g0["sm_mhz_median"], g0["sm_mhz_min"]) == (3, 1395.0, 1305.0)
    assert g0["power_capped_fraction"] == round(2 / 3, 3) and g0["power_w_median"] == 698.3
    assert (g1["samples"], g1["power_capped_fraction"]) == (2, 0.5)  # the unreadable sample left out
    assert summarize("") is None and summarize("NVIDIA-SMI has failed\n") is None


def test_samples_a_running_command(tmp_path):
    fake, printed = tmp_path / "nvidia-smi", tmp_path / "printed"
    fake.write_text(f"#!{sys.executable}\nimport pathlib, time\nprint({LINES.splitlines()[2]!r}, flush=True)\n"
                    f"pathlib.Path({str(printed)!r}).touch()\ntime.sleep(30)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with GpuMonitor(command=str(fake), interval_ms=100) as m:
        deadline = time.monotonic() + 20
        while not printed.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert m.summary() == [{"index": 0, "samples": 1, "sm_mhz_median": 1395.0, "sm_mhz_min": 1395.0,
                            "power_w_median": 698.3, "power_capped_fraction": 1.0}]


def test_no_command_or_inactive_gives_nothing(tmp_path):
    with GpuMonitor(command=str(tmp_path / "missing")) as m:
        pass
    assert m.summary() is None
    with GpuMonitor(active=False, command="false") as m:
        pass
    assert m.summary() is None


def test_the_report_names_each_gpus_clock():
    r = RequestResult(index=0, prompt_len=10, success=True, output_tokens=2, e2el_s=0.2)
    r.chunks = [(0.1, 1), (0.2, 1)]
    info = RunInfo(date="d", model=None, served_model_name="m", url="u", gpu="GPU", workload=WorkloadSpec(1, 10, 2),
                   concurrency=1, request_rate=None, ignore_eos=True, kv_cache_dtype="auto")
    text = format_report(info, compute_metrics([r], 1.0), None, "", gpu_power=summarize(LINES))
    assert "GPU 0 SM clock, median (MHz):" in text and "GPU 1 samples at the power cap:" in text
    assert "1,395" in text and "0.67" in text
