"""A PNG of the run: latency distributions, and output throughput over time against the bound."""
from __future__ import annotations

from pathlib import Path

from bench.client import RequestResult
from bench.metrics import BenchmarkMetrics


def check_available() -> None:
    """Raise ValueError before the run when --plot can't be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None


def write_plot(path: str | Path, title: str, results: list[RequestResult], metrics: BenchmarkMetrics,
               roofline_throughput: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    series = {
        "TTFT (ms)": [r.ttft_s * 1000 for r in ok if r.ttft_s is not None],
        "TPOT (ms)": [r.tpot_s * 1000 for r in ok if r.tpot_s is not None],
        "ITL (ms)": [x * 1000 for r in ok for x in r.itls_s()],
        "E2E latency (ms)": [r.e2el_s * 1000 for r in ok],
    }
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (label, values) in zip(axes.flat, series.items()):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 5)), color="tab:blue", alpha=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    _throughput_over_time(axes.flat[4], ok, roofline_throughput)
    _throughput_bars(axes.flat[5], metrics.output_throughput, roofline_throughput)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _throughput_over_time(ax, ok: list[RequestResult], bound: float | None) -> None:
    times = [r.start_s + t for r in ok for t, _ in r.chunks]
    tokens = [k for r in ok for _, k in r.chunks]
    if times:
        end = max(times)
        bins = max(1, min(50, len(times) // 20))
        width = end / bins if end > 0 else 1.0
        counts = [0.0] * bins
        for t, k in zip(times, tokens):
            counts[min(bins - 1, int(t / width))] += k
        ax.step([i * width for i in range(bins)], [c / width for c in counts], where="post", label="achieved")
    if bound is not None:
        ax.axhline(bound, color="tab:red", linestyle="--", label="roofline bound")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tok/s")
    ax.legend(loc="lower right")


def _throughput_bars(ax, achieved: float, bound: float | None) -> None:
    labels, values = ["achieved"], [achieved]
    if bound is not None:
        labels.append("roofline bound")
        values.append(bound)
    bars = ax.bar(labels, values, color=["tab:blue", "tab:red"][: len(values)])
    for bar, v in zip(bars, values):
        ax.annotate(f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom")
    if bound:
        ax.set_title(f"{achieved / bound:.1%} of the bound")
    ax.set_ylabel("output tok/s")
