"""A PNG of the run: latency distributions, and output throughput over time against the bound."""
from __future__ import annotations

from pathlib import Path

from bench.client import RequestResult
from bench.metrics import SLO, BenchmarkMetrics
from bench.sweep import SweepPoint


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


def write_goodput_plot(path: str | Path, title: str, curves: dict[str, list[SweepPoint]],
                       slo: SLO | None) -> None:
    """Goodput and throughput, TTFT and TPOT against the offered request rate; one line per curve
    (a server setup). Rows of rate inf (all at once) are left out: they have no place on the axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_good, ax_ttft, ax_tpot) = plt.subplots(1, 3, figsize=(17, 5))
    top = 0.0
    for k, (label, points) in enumerate(curves.items()):
        pts = [p for p in points if p.request_rate is not None]
        if not pts:
            continue
        color = f"C{k}"
        rates = [p.request_rate for p in pts]
        top = max(top, *rates)
        ax_good.plot(rates, [p.request_throughput for p in pts], color=color, linestyle=":", marker=".",
                     label=f"{label}: throughput")
        if all(p.goodput is not None for p in pts):
            ax_good.plot(rates, [p.goodput for p in pts], color=color, marker="o", label=f"{label}: goodput")
        for ax, med, p99 in ((ax_ttft, "median_ttft_ms", "p99_ttft_ms"), (ax_tpot, "median_tpot_ms", "p99_tpot_ms")):
            ax.plot(rates, [getattr(p, med) for p in pts], color=color, marker="o", label=f"{label}: median")
            ax.plot(rates, [getattr(p, p99) for p in pts], color=color, linestyle="--", marker="x", label=f"{label}: p99")
    if top:
        ax_good.plot([0, top], [0, top], color="gray", linewidth=0.8, label="offered")
    ax_good.set_ylabel("requests/s")
    ax_good.set_title("goodput" + (f" ({', '.join(f'{k} <= {v:g}' for k, v in slo.as_dict().items())})" if slo else ""))
    for ax, name, limit in ((ax_ttft, "TTFT (ms)", slo.ttft_ms if slo else None),
                            (ax_tpot, "TPOT (ms)", slo.tpot_ms if slo else None)):
        if limit is not None:
            ax.axhline(limit, color="tab:red", linewidth=0.8, label="objective")
        ax.set_yscale("log")
        ax.set_ylabel(name)
        ax.set_title(name)
    for ax in (ax_good, ax_ttft, ax_tpot):
        ax.set_xlabel("offered request rate (req/s)")
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
