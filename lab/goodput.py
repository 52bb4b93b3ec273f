"""Goodput against request rate for several server setups, from `serve bench --request-rate R1,R2,...`
result files: one table per objective (recomputed from each request's latencies, so one sweep
serves any objective), the throughput at saturation of each setup against the first, and a plot.

    python -m lab.goodput one-gpu.json=1xH100 dp2.json=dp2 --slo loose=ttft:2000,tpot:50 \
        --slo tight=ttft:500,tpot:1.25x --markdown goodput.md --plot goodput.png

An objective's limit "1.25x" means 1.25 times the roofline decode step of the first (baseline)
file's first run (its roofline_decode_step_ms: a GPU, or --copy-bandwidth and --matmul-tflops, gave
it a roofline). One number for every setup: an objective is the user's, whatever serves it (a
data-parallel run's own roofline splits the step over its GPUs as if one model were).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}


@dataclass(frozen=True)
class Objective:
    name: str
    limits: dict[str, tuple[float, bool]]  # request field -> (limit, relative to the roofline decode step)

    @classmethod
    def parse(cls, text: str) -> "Objective":
        name, sep, spec = text.partition("=")
        if not sep:
            raise ValueError(f"--slo takes NAME=KEY:MS,KEY:MS; got {text!r}")
        limits = {}
        for item in spec.split(","):
            key, sep, value = item.partition(":")
            if not sep or key not in KEYS:
                raise ValueError(f"--slo {text!r}: {item!r} is not KEY:MS with KEY one of {', '.join(KEYS)}")
            relative = value.endswith("x")
            try:
                limits[KEYS[key]] = (float(value.rstrip("x")), relative)
            except ValueError:
                raise ValueError(f"--slo {text!r}: {value!r} is not a number of ms, or NUMBERx") from None
        return cls(name, limits)

    def describe(self, step_ms: float | None = None) -> str:
        parts = []
        for field, (limit, relative) in self.limits.items():
            key = field.removesuffix("_ms")
            if relative:
                parts.append(f"{key} <= {limit:g}x roofline step" + (f" ({limit * step_ms:.1f} ms)" if step_ms else ""))
            else:
                parts.append(f"{key} <= {limit:g} ms")
        return ", ".join(parts)

    def goodput(self, run: dict, step_ms: float | None) -> float:
        """Requests/s of the run that met every limit (a missing latency meets its limit, as in
        bench/metrics.py: a one-token request has no TPOT); step_ms: the roofline decode step that
        relative limits multiply."""
        step = step_ms or 0.0
        if any(rel for _, rel in self.limits.values()) and not step:
            raise ValueError(f"objective {self.name!r} is relative to the roofline decode step, and the "
                             "baseline's result has none (no GPU measured: pass --copy-bandwidth and --matmul-tflops)")
        good = 0
        for r in run["requests"]:
            if r.get("error"):
                continue
            ok = True
            for field, (limit, relative) in self.limits.items():
                value = r.get(field)
                if value is not None and value > (limit * step if relative else limit):
                    ok = False
            good += ok
        return good / run["duration_s"] if run["duration_s"] > 0 else 0.0


def _read(spec: str) -> tuple[str, str, dict]:
    """FILE[=LABEL] -> (label, path, the result JSON); the label defaults to the file's stem."""
    path, _, label = spec.partition("=")
    return label or Path(path).stem, path, json.loads(Path(path).read_text())


def load(spec: str) -> tuple[str, dict]:
    label, path, data = _read(spec)
    if "runs" not in data:
        raise ValueError(f"{path} is not a rate sweep's result (serve bench --request-rate R1,R2,... --result-json)")
    return label, data


def load_closed_loop(spec: str) -> tuple[str, dict]:
    """A closed-loop run's result (serve bench --concurrency C, no --request-rate): throughput at saturation."""
    label, path, data = _read(spec)
    if "runs" in data or "output_throughput" not in data:
        raise ValueError(f"{path} is not one closed-loop run's result (serve bench --concurrency C --result-json)")
    return label, data


def rate_label(rate: float | None) -> str:
    return "inf" if rate is None else f"{rate:g}"


def baseline_step_ms(setups: dict[str, dict]) -> float | None:
    return next(iter(setups.values()))["runs"][0].get("roofline_decode_step_ms")


def tables(setups: dict[str, dict], objectives: list[Objective], saturated: dict[str, dict] | None = None) -> str:
    labels = list(setups)
    lines = []
    first = setups[labels[0]]
    step = baseline_step_ms(setups)
    lines.append(f"{first.get('model')} on {first.get('gpu')}, {first['runs'][0]['num_prompts']} requests per rate, "
                 f"{first['runs'][0]['input_len']} in / {first['runs'][0]['output_len']} out, range ratio "
                 f"{first['runs'][0]['range_ratio']}, temperature {first['runs'][0]['temperature']}, "
                 f"{first['date'][:10]}")
    lines.append("")
    # a sweep's highest rate is mostly the tail of its last streams: a closed-loop run measures saturation
    lines.append("| setup | server args | the sweep's highest output tok/s | vs " + labels[0] + " | peak req/s |")
    lines.append("|---|---|---|---|---|")
    base = max(r["output_throughput"] for r in first["runs"])
    for label, data in setups.items():
        top = max(r["output_throughput"] for r in data["runs"])
        lines.append(f"| {label} | `{data.get('server_args') or ''}` | {top:,.0f} | {top / base:.2f}x | "
                     f"{max(r['request_throughput'] for r in data['runs']):.2f} |")
    if saturated:
        first_sat = next(iter(saturated.values()))["output_throughput"]
        lines += ["", "| setup | server args | clients | saturated output tok/s (closed loop) | vs "
                  + next(iter(saturated)) + " |",
                  "|---|---|---|---|---|"]
        for label, data in saturated.items():
            lines.append(f"| {label} | `{data.get('server_args') or ''}` | {data.get('concurrency')} | "
                         f"{data['output_throughput']:,.0f} | {data['output_throughput'] / first_sat:.2f}x |")
    for obj in objectives:
        lines += ["", f"Goodput (req/s), {obj.name}: {obj.describe(step)}", ""]
        lines.append("| rate (req/s) | " + " | ".join(f"{label} goodput | {label} req/s" for label in labels) + " |")
        lines.append("|---|" + "---|---|" * len(labels))
        rates = sorted({run["request_rate"] for d in setups.values() for run in d["runs"]},
                       key=lambda r: float("inf") if r is None else r)
        for rate in rates:
            cells = []
            for data in setups.values():
                run = next((r for r in data["runs"] if r["request_rate"] == rate), None)
                cells += ["", ""] if run is None else [f"{obj.goodput(run, step):.2f}", f"{run['request_throughput']:.2f}"]
            lines.append(f"| {rate_label(rate)} | " + " | ".join(cells) + " |")
        best = {label: max(obj.goodput(r, step) for r in d["runs"]) for label, d in setups.items()}
        lines.append("")
        lines.append("Best goodput: " + ", ".join(f"{label} {g:.2f} req/s" for label, g in best.items()))
    return "\n".join(lines) + "\n"


def plot(path: str, setups: dict[str, dict], objectives: list[Objective]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(objectives) + 1, figsize=(6 * (len(objectives) + 1), 5), squeeze=False)
    ax_tput = axes[0][-1]
    step = baseline_step_ms(setups)
    for k, (label, data) in enumerate(setups.items()):
        runs = [r for r in data["runs"] if r["request_rate"] is not None]
        rates = [r["request_rate"] for r in runs]
        for ax, obj in zip(axes[0], objectives):
            ax.plot(rates, [obj.goodput(r, step) for r in runs], marker="o", color=f"C{k}", label=label)
            ax.plot(rates, [r["request_throughput"] for r in runs], linestyle=":", color=f"C{k}")
        ax_tput.plot(rates, [r["output_throughput"] for r in runs], marker="o", color=f"C{k}", label=label)
    for ax, obj in zip(axes[0], objectives):
        ax.set_title(f"goodput, {obj.name}: {obj.describe(step)}", fontsize="small")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel("req/s (dotted: throughput)")
        ax.legend()
    ax_tput.set_title("output tokens/s")
    ax_tput.set_xlabel("offered request rate (req/s)")
    ax_tput.legend()
    first = next(iter(setups.values()))
    fig.suptitle(f"{first.get('model')} on {first.get('gpu')}, {first['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.goodput", description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", metavar="FILE[=LABEL]", help="sweep result JSONs; the first is the baseline")
    p.add_argument("--slo", action="append", metavar="NAME=KEY:MS,...", default=[],
                   help="an objective, e.g. loose=ttft:2000,tpot:50 or tight=ttft:500,tpot:1.25x (repeatable)")
    p.add_argument("--saturated", action="append", metavar="FILE[=LABEL]", default=[],
                   help="a closed-loop run's result: the throughput at saturation (repeatable; the first is the baseline)")
    p.add_argument("--markdown", metavar="PATH", help="write the tables here too")
    p.add_argument("--plot", metavar="PATH")
    args = p.parse_args(argv)
    try:
        objectives = [Objective.parse(s) for s in args.slo] or [Objective("loose", {"ttft_ms": (2000.0, False),
                                                                                   "tpot_ms": (50.0, False)})]
        setups = dict(load(spec) for spec in args.results)
        text = tables(setups, objectives, dict(load_closed_loop(spec) for spec in args.saturated))
    except (ValueError, OSError, KeyError) as e:
        print(f"lab.goodput: error: {e}", file=sys.stderr)
        return 2
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.plot:
        plot(args.plot, setups, objectives)
    return 0


if __name__ == "__main__":
    sys.exit(main())
