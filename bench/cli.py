"""`serve bench`: the load generator.

Against a running OpenAI-compatible server (--url), or one it starts itself (--model, with
`serve run`). Closed loop at --concurrency N, or Poisson arrivals at --request-rate R (both: Poisson
arrivals, at most N in flight). Every request streams random token ids to /v1/completions; the run
reports throughput, TTFT/TPOT/ITL/E2E latency, goodput and the fraction of the roofline bound.
Several rates (--request-rate R1,R2,...): one run per rate, and goodput against rate (bench/sweep.py).
Standalone: python -m bench.cli --help
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.client import CompletionTarget
from bench.gpu_monitor import GpuMonitor
from bench.hardware import Measurement, gpu_name, measure_in_subprocess
from bench.load import (LoadError, LoadPlan, LoadResult, auto_client_processes, client_process_count,
                        discover_model, probe, run_conversations, run_load)
from bench.metrics import SLO, TurnSplit, compute_metrics
from bench.plot import check_available, write_goodput_plot, write_plot
from bench.presets import resolve_model
from bench.report import Roofline, RunInfo, format_report, result_dict
from bench.roofline import HardwareRates, ModelCost, estimate
from bench.server import ManagedServer, ServerError, resolve_command
from bench.sweep import Measured, format_table, run_sweep, sweep_dict
from bench.workload import (BenchRequest, WorkloadSpec, arrival_offsets, as_text, fresh_tokens, make_conversations,
                            make_requests, max_conversation_tokens, warmup_requests)
from engine.config import ModelConfig, ModelConfigError
from serve.build import TokenIdTokenizer, load_tokenizer
from serve.cli_args import OneLineErrorParser

PROG = "serve bench"
DEFAULT_VOCAB = 32000  # token id range for prompts when no --model tells the real vocabulary


def parse_rates(text: str) -> list[float]:
    """--request-rate: one rate or several, comma-separated, in requests/s (inf: all at once)."""
    rates = []
    for part in text.split(","):
        try:
            rates.append(float(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a number of requests per second") from None
    return rates


def _json_object(text: str) -> dict:
    """--extra-body: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object of request fields, such as '{\"min_p\": 0.05}'")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    srv = parser.add_argument_group("server")
    srv.add_argument("--url", help="base URL of a running OpenAI-compatible server, e.g. http://127.0.0.1:8000; "
                                   "without it, the benchmark starts its own server with --model")
    srv.add_argument("--model", help="model folder (with config.json) or preset name "
                                     "(e.g. llama3-8b, qwen2.5-0.5b); served when there is no --url, "
                                     "and with --url it sizes the prompts' token ids and the roofline")
    srv.add_argument("--load-format", help="passed to the server it starts, e.g. dummy (random weights)")
    srv.add_argument("--served-model-name", help="the model name in requests (default: the first of GET "
                                                 "/v1/models); also passed to the server it starts")
    srv.add_argument("--server-args", default="",
                     help='extra arguments for the server it starts, given with =: --server-args="--enforce-eager"')
    srv.add_argument("--server-command", default="serve run",
                     help="the command that starts a server (default: %(default)s)")
    srv.add_argument("--server-timeout", type=float, default=900.0, metavar="S",
                     help="seconds to wait for the started server's GET /health (default: %(default)s)")
    srv.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    srv.add_argument("--endpoint", default="/v1/completions", help="completions path (default: %(default)s)")

    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, metavar="N", help="at most N requests in flight (closed loop "
                                                                   "when there is no --request-rate)")
    load.add_argument("--request-rate", type=parse_rates, metavar="R[,R...]",
                      help="Poisson arrivals at R requests/s (default: all at once; inf: all at once); several "
                           "rates, comma-separated: one run per rate, and a table (and with --plot a plot) of "
                           "goodput against rate")
    load.add_argument("--num-prompts", type=int, default=64, help="number of requests (default: %(default)s)")
    load.add_argument("--input-len", type=int, default=512, help="prompt tokens (default: %(default)s)")
    load.add_argument("--output-len", type=int, default=128, help="max_tokens of each request (default: %(default)s)")
    load.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (default: %(default)s)")
    load.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens tokens (extension field)")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request "
                                                                       "(default: %(default)s, greedy)")
    load.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of every request (default: %(default)s)")
    load.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                      help="more request fields for every request, a JSON object, e.g. '{\"repetition_penalty\": 1.1}'")
    load.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                      help="send prompts as token ids, or as text the server tokenizes (decoded with --model's "
                           "tokenizer; default: %(default)s)")
    load.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                      help="every prompt starts with the same N random tokens (part of --input-len)")
    load.add_argument("--num-warmups", type=int, default=0, metavar="N",
                      help="first send N unmeasured requests of the same shape (other tokens, another shared "
                           "prefix), at the same concurrency: compiles and warms the server (default: %(default)s)")
    load.add_argument("--multi-turn", type=int, default=1, metavar="T",
                      help="conversations of T turns: --num-prompts conversations, each turn's prompt the "
                           "conversation so far (earlier prompts and replies, as token ids) plus new tokens; a "
                           "turn is sent when the previous reply is in. Reports follow-up turns' TTFT apart "
                           "from first turns' (default: 1, single requests)")
    load.add_argument("--turn-len", type=int, default=None, metavar="N",
                      help="new tokens of each follow-up turn with --multi-turn (default: --input-len)")
    load.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals (default: %(default)s)")
    load.add_argument("--client-processes", type=int, metavar="N",
                      help="send the requests from N processes sharing the concurrency cap and the arrival "
                           "schedule, so that the client's CPU does not cap the figures (default: one per 32 "
                           "requests in flight, at most 4 and half the CPUs; 1: this process alone)")

    out = parser.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                     help="SLOs for goodput, KEY one of ttft, tpot, e2el, e.g. --goodput ttft:500 tpot:50")
    out.add_argument("--result-json", metavar="PATH", help="write the results as JSON")
    out.add_argument("--plot", metavar="PATH", help="draw latency distributions and throughput vs bound (PNG)")
    out.add_argument("--chunk-times", action="store_true",
                     help="the result JSON also lists when each token-carrying chunk arrived (chunk_s, seconds "
                          "after the request was sent) and the run's start on the monotonic clock (clock_start_s), "
                          "to line the client's view up with the server's (PAGEDSERVE_STEP_TRACE)")
    out.add_argument("--kv-cache-dtype", default="auto",
                     help="KV storage dtype the roofline assumes: auto, bfloat16, fp8, int8 (default: %(default)s)")
    out.add_argument("--quantization", choices=["fp8"], default=None,
                     help="the weights the roofline assumes: fp8 where the server (--url) runs with --quantization "
                          "fp8 (read from --server-args and from an FP8 checkpoint's config otherwise)")
    out.add_argument("--copy-bandwidth", type=float, metavar="TB/s",
                     help="roofline copy bandwidth instead of measuring it on this machine's GPU")
    out.add_argument("--matmul-tflops", type=float, metavar="TFLOP/s",
                     help="roofline bf16 matmul rate instead of measuring it on this machine's GPU")
    out.add_argument("--num-gpus", type=int, metavar="N",
                     help="GPUs the served model is split over: the roofline sums their copy bandwidth and "
                     "matmul rate (default: the product of the tensor-, pipeline- and data-parallel sizes in "
                     "--server-args, else 1)")


@dataclass(frozen=True)
class _Setup:
    """The validated options."""

    workload: WorkloadSpec
    slo: SLO | None
    model_dir: Path | None
    model: ModelConfig | None
    tokenizer: Any  # --prompt-format text: the model folder's tokenizer; else None
    server_command: list[str] | None  # None: use --url
    server_args: list[str]
    url: str | None
    request_rate: float | None  # the first of request_rates
    request_rates: list[float | None]  # None: all at once
    client_processes: int


def _validate(args: argparse.Namespace) -> _Setup:
    if args.url is None and args.model is None:
        raise ValueError("pass --url of a running server, or --model to start one")
    if args.url is not None:
        if not args.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
        for flag, value in (("--load-format", args.load_format), ("--server-args", args.server_args)):
            if value:
                raise ValueError(f"{flag} applies only when serve bench starts the server (drop --url)")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    rates: list[float | None] = []
    for rate in args.request_rate or [None]:
        if rate is not None and (math.isnan(rate) or rate <= 0):
            raise ValueError(f"--request-rate must be > 0, got {rate}")
        rates.append(None if rate is not None and math.isinf(rate) else rate)
    if not 0.0 <= args.temperature <= 100.0:
        raise ValueError(f"--temperature must be in [0, 100], got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    taken = sorted(set(args.extra_body or {}) & set(CompletionTarget.OWN_FIELDS))
    if taken:
        raise ValueError(f"--extra-body sets {', '.join(taken)}, which serve bench sets itself; use its options")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.num_gpus is not None and args.num_gpus < 1:
        raise ValueError(f"--num-gpus must be >= 1, got {args.num_gpus}")
    if args.client_processes is not None and args.client_processes < 1:
        raise ValueError(f"--client-processes must be >= 1, got {args.client_processes}")
    if args.server_timeout <= 0:
        raise ValueError("--server-timeout must be > 0")
    for flag, value in (("--copy-bandwidth", args.copy_bandwidth), ("--matmul-tflops", args.matmul_tflops)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0")
    if (args.copy_bandwidth is None) != (args.matmul_tflops is None):
        raise ValueError("give both --copy-bandwidth and --matmul-tflops, or neither (then they are measured)")
    if not args.endpoint.startswith("/"):
        raise ValueError(f"--endpoint must be a path starting with /, got {args.endpoint!r}")
    for flag, path in (("--result-json", args.result_json), ("--plot", args.plot)):
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag}: the folder of {path} does not exist")
    if args.plot:
        check_available()
    if args.chunk_times and not args.result_json:
        raise ValueError("--chunk-times adds to the result JSON: give --result-json PATH too")
    if args.chunk_times and args.request_rate and len(args.request_rate) > 1:
        raise ValueError("--chunk-times keeps one run's chunks: give one --request-rate")
    if args.multi_turn < 1:
        raise ValueError(f"--multi-turn must be >= 1 turns, got {args.multi_turn}")
    if args.turn_len is not None and args.turn_len < 1:
        raise ValueError(f"--turn-len must be >= 1, got {args.turn_len}")
    if args.multi_turn > 1:
        for flag, bad in (("--request-rate", args.request_rate), ("--prompt-format text", args.prompt_format == "text"),
                          ("--plot", args.plot), ("--client-processes", (args.client_processes or 1) > 1)):
            if bad:
                raise ValueError(f"--multi-turn sends each turn after the previous reply, as token ids, from one "
                                 f"client process: drop {flag}")
    slo = SLO.parse(args.goodput)
    try:
        server_args = shlex.split(args.server_args)
    except ValueError as e:
        raise ValueError(f"--server-args: {e}") from None
    model_dir = model = None
    if args.model is not None:
        model_dir = resolve_model(args.model)
        try:
            model = ModelConfig.from_path(model_dir)
        except ModelConfigError as e:
            raise ValueError(f"--model: {e}") from None
    if model is not None:
        ModelCost.of(model, args.kv_cache_dtype)  # a bad --kv-cache-dtype says so now, not after the run
    tokenizer = None
    if args.prompt_format == "text":
        if model_dir is None:
            raise ValueError("--prompt-format text needs --model: the folder whose tokenizer turns the prompts into text")
        tokenizer = load_tokenizer(model_dir)
        if isinstance(tokenizer, TokenIdTokenizer):
            raise ValueError(f"--prompt-format text: {model_dir} has no tokenizer files (tokenizer.json, ...)")
    workload = WorkloadSpec(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, shared_prefix_len=args.shared_prefix_len,
        vocab_size=model.vocab_size if model else DEFAULT_VOCAB, seed=args.seed)
    return _Setup(
        workload=workload, slo=slo, model_dir=model_dir, model=model, tokenizer=tokenizer,
        server_command=None if args.url else resolve_command(args.server_command),
        server_args=server_args, url=args.url.rstrip("/").removesuffix("/v1") if args.url else None,
        request_rate=rates[0], request_rates=rates,
        client_processes=args.client_processes or auto_client_processes(args.concurrency, workload.num_prompts))


def _hardware(args: argparse.Namespace, setup: _Setup) -> Measurement:
    if args.copy_bandwidth is not None:
        return Measurement(device=gpu_name(), copy_bandwidth=args.copy_bandwidth * 1e12,
                           matmul_flops=args.matmul_tflops * 1e12)
    if setup.model is None:  # no roofline without the model's shape: only name the GPU
        return Measurement(device=gpu_name())
    return measure_in_subprocess()


def roofline_gpus(num_gpus: int | None, server_args: list[str]) -> int:
    """GPUs the roofline counts: --num-gpus, else the tensor-parallel size times the pipeline- and
    data-parallel sizes the started server was given (P + D for --disaggregate P:D). An ideal split: each GPU reads 1/N of the weights and KV and
    does 1/N of the FLOPs; the all-reduces are not counted, so the bound stays a bound."""
    if num_gpus is not None:
        return num_gpus
    for i, arg in enumerate(server_args[:-1]):  # --disaggregate P:D: P + D engines of one GPU each
        if arg == "--disaggregate" and all(x.isdigit() for x in server_args[i + 1].split(":")):
            return sum(int(x) for x in server_args[i + 1].split(":"))
    return (_size_flag(server_args, "--tensor-parallel-size", "-tp") * _size_flag(server_args, "--pipeline-parallel-size", "-pp")
            * _size_flag(server_args, "--data-parallel-size", "-dp"))


def roofline_fp8(quantization: str | None, server_args: list[str]) -> bool:
    """Whether the server quantizes the weights to FP8: --quantization fp8 here, or in server_args."""
    return quantization == "fp8" or _flag(server_args, "--quantization", "-q") == "fp8"


def _size_flag(server_args: list[str], name: str, short: str) -> int:
    """The positive integer given to a `serve run` flag in server_args; 1 when absent or not one."""
    value = _flag(server_args, name, short)
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else 1


def _flag(server_args: list[str], name: str, short: str) -> str | None:
    """The value given to a `serve run` flag in server_args (`--name V`, `-s V` or `--name=V`), None when absent."""
    for i, arg in enumerate(server_args):
        if arg in (name, short) and i + 1 < len(server_args):
            return server_args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def no_roofline_reason(hw: Measurement, model: ModelConfig | None) -> str:
    """Why the report has no roofline, in words a user can act on ('' when it has one)."""
    if model is None:
        return "the model's shape is unknown: pass --model (a folder or preset) with --url"
    if hw.rates() is None:
        return (f"{hw.error}; pass --copy-bandwidth and --matmul-tflops" if hw.error
                else "no CUDA GPU here to measure the copy bandwidth and matmul rate; pass --copy-bandwidth "
                     "and --matmul-tflops (e.g. 3.01 and 790 for an H100)")
    return ""


def _error(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C at any moment: options, GPU measurement, server start, run, report
        _error("interrupted")
        return 130


def _run(args: argparse.Namespace) -> int:
    try:
        setup = _validate(args)
    except ValueError as e:
        _error(str(e))
        return 2
    # measure before our server takes the GPU's memory, and in a subprocess: no CUDA context here
    hw = _hardware(args, setup)
    if hw.error:
        print(f"{PROG}: warning: no roofline: {hw.error}", file=sys.stderr)
    try:
        if setup.url is not None:
            return _bench(args, setup, setup.url, hw)
        server = ManagedServer(command=setup.server_command, model=str(setup.model_dir),
                               load_format=args.load_format, served_model_name=args.served_model_name,
                               extra_args=setup.server_args, startup_timeout_s=args.server_timeout)
        print(f"{PROG}: starting {shlex.join(server.argv())} (log: {server.log_path})", file=sys.stderr)
        with server:
            return _bench(args, setup, server.base_url, hw, server)
    except ServerError as e:
        _error(str(e))
        return 1


def _bench(args: argparse.Namespace, setup: _Setup, base_url: str, hw: Measurement,
           server: ManagedServer | None = None) -> int:
    name = args.served_model_name or asyncio.run(discover_model(base_url, args.api_key))
    if name is None:
        _error(f"no model name from GET {base_url}/v1/models (is the server up?); pass --served-model-name")
        return 1
    target = CompletionTarget(url=base_url + args.endpoint, model=name, ignore_eos=args.ignore_eos,
                              api_key=args.api_key, temperature=args.temperature, top_p=args.top_p,
                              extra_body=args.extra_body)
    requests = ids = make_requests(setup.workload)
    warmups = warmup_requests(setup.workload, max(1, args.num_warmups))
    if setup.tokenizer is not None:
        requests, warmups = as_text(requests, setup.tokenizer), as_text(warmups, setup.tokenizer)
    # The probe and the warm-ups use other tokens than the measured prompts: with prefix caching
    # they would otherwise hand the measured requests a cached prefix.
    first = asyncio.run(probe(target, warmups[0]))
    if not first.success:
        _error(f"the test request to {target.url} failed: {first.error}")
        return 1
    if args.num_warmups > 0:
        print(f"{PROG}: {args.num_warmups} warm-up requests", file=sys.stderr)
        warm = asyncio.run(run_load(target, warmups, LoadPlan(arrivals=[0.0] * len(warmups),
                                                              concurrency=args.concurrency, progress=False)))
        failed = [r for r in warm.results if not r.success]
        if failed:
            _error(f"{len(failed)} of {len(warmups)} warm-up requests failed: {failed[0].error}")
            return 1
    if args.multi_turn > 1:
        return _multi_turn(args, setup, target, hw, base_url)
    processes = client_process_count(setup.client_processes, args.concurrency, len(requests))
    if processes > 1:
        print(f"{PROG}: {processes} client processes", file=sys.stderr)
    if len(setup.request_rates) > 1:
        return _sweep(args, setup, target, hw, base_url, ids)
    try:
        run = _measure(args, setup, target, hw, base_url, setup.request_rate, requests)
    except LoadError as e:
        _error(str(e))
        return 1
    load, metrics, roofline, info = run.load, run.metrics, run.roofline, run.info
    print(format_report(info, metrics, roofline, no_roofline_reason(hw, setup.model), gpu_power=run.gpu_power))
    busy = _warn_if_client_bound(load)
    if args.result_json:
        result = result_dict(info, metrics, load.results, roofline, setup.slo, run.gpu_power)
        result["client_cpu_fraction"] = round(busy, 4)  # the busiest client process's
        result["client_cpu_fractions"] = [round(u.busy, 4) for u in load.usage]
        result["client_processes"] = load.client_processes
        if args.chunk_times:
            _add_chunk_times(result, load)
        if server is not None:  # what the engine budgeted its steps by (lab/sim.py --forward-from)
            result["engine_cost_model"] = server.step_cost_model()
        Path(args.result_json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        title = (f"{info.model or name} on {info.gpu or 'unknown GPU'}: {setup.workload.num_prompts} x "
                 f"({setup.workload.input_len} in, {setup.workload.output_len} out), concurrency "
                 f"{args.concurrency or 'unlimited'}, rate {setup.request_rate or 'inf'}")
        write_plot(args.plot, title, load.results, metrics,
                   roofline.estimate.output_throughput if roofline else None)
    return 0 if metrics.completed else 1


def _measure(args: argparse.Namespace, setup: _Setup, target: CompletionTarget, hw: Measurement, base_url: str,
             rate: float | None, requests: list[BenchRequest]) -> Measured:
    """One run at one request rate (None: all at once). Raises LoadError."""
    arrivals = arrival_offsets(len(requests), rate, setup.workload.seed)
    plan = LoadPlan(arrivals=arrivals, concurrency=args.concurrency, processes=setup.client_processes)
    # the clocks of this machine's GPUs, where they serve the run (a server this command started)
    with GpuMonitor(active=hw.device is not None and setup.url is None) as monitor:
        load = asyncio.run(run_load(target, requests, plan))
    metrics = compute_metrics(load.results, load.duration_s, setup.slo)
    rates = hw.rates()
    roofline = None
    if rates is not None and setup.model is not None:
        lengths = [(r.num_prompt_tokens, r.output_len) for r in requests]
        gpus = roofline_gpus(args.num_gpus, setup.server_args)
        burst = rates.matmul_flops_burst * gpus if rates.matmul_flops_burst else None
        rates = HardwareRates(rates.copy_bandwidth * gpus, rates.matmul_flops * gpus, burst)
        cost = ModelCost.of(setup.model, args.kv_cache_dtype, fp8=roofline_fp8(args.quantization, setup.server_args))
        roofline = Roofline(estimate(cost, lengths, rates, args.concurrency, rate), rates, gpus,
                            estimate(cost, lengths, HardwareRates(rates.copy_bandwidth, burst), args.concurrency, rate)
                            if burst else None)
    info = RunInfo(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"), model=args.model,
        served_model_name=target.model, url=base_url, gpu=hw.device, workload=setup.workload,
        concurrency=args.concurrency, request_rate=rate, ignore_eos=args.ignore_eos,
        kv_cache_dtype=args.kv_cache_dtype, server_args=None if setup.url else shlex.join(setup.server_args),
        temperature=args.temperature, top_p=args.top_p, extra_body=args.extra_body,
        prompt_format=args.prompt_format)
    return Measured(load, metrics, roofline, info, monitor.summary())


def _multi_turn(args: argparse.Namespace, setup: _Setup, target: CompletionTarget, hw: Measurement,
                base_url: str) -> int:
    """--multi-turn T: the conversations, then the report with follow-up turns apart (no roofline:
    the bound needs each request's length before the run, and a turn's length follows the replies)."""
    turn_len = args.turn_len or args.input_len
    convs = make_conversations(setup.workload, args.multi_turn, turn_len)
    print(f"{PROG}: {len(convs)} conversations of {args.multi_turn} turns, up to "
          f"{max_conversation_tokens(convs):,} tokens each", file=sys.stderr)
    load = asyncio.run(run_conversations(target, convs, args.concurrency))
    metrics = compute_metrics(load.results, load.duration_s, setup.slo)
    split = TurnSplit.of(load.results)
    info = RunInfo(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"), model=args.model,
        served_model_name=target.model, url=base_url, gpu=hw.device, workload=setup.workload,
        concurrency=args.concurrency, request_rate=None, ignore_eos=args.ignore_eos,
        kv_cache_dtype=args.kv_cache_dtype, server_args=None if setup.url else shlex.join(setup.server_args),
        temperature=args.temperature, top_p=args.top_p, extra_body=args.extra_body,
        prompt_format=args.prompt_format,
        num_turns=args.multi_turn, turn_len=turn_len)
    print(format_report(info, metrics, None, "not computed for --multi-turn runs", split))
    busy = _warn_if_client_bound(load)
    if args.result_json:
        result = result_dict(info, metrics, load.results, None, setup.slo)
        result["client_cpu_fraction"] = round(busy, 4)
        if args.chunk_times:
            _add_chunk_times(result, load)
        Path(args.result_json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if metrics.completed else 1


def _add_chunk_times(result: dict, load: LoadResult) -> None:
    """--chunk-times: each request's chunk arrivals (seconds after it was sent) and the run's start
    on the monotonic clock that the server's traces read (bench/README.md)."""
    result["clock_start_s"] = load.clock_start
    for r, row in zip(load.results, result["requests"]):
        row["chunk_s"] = [round(t, 6) for t, _ in r.chunks]


def _warn_if_client_bound(load: LoadResult, when: str = "") -> float:
    """Warn when the load generator's own CPU may have capped the figures; returns its busy fraction."""
    busy = load.client_cpu_fraction
    if busy > 0.8:
        which = "the load generator" if load.client_processes == 1 else \
            f"the busiest of the {load.client_processes} client processes"
        print(f"{PROG}: warning: {which} was busy {busy:.0%} of the run{when}; the figures may measure "
              "the client, not the server (more --client-processes?)", file=sys.stderr)
    return busy


def _sweep(args: argparse.Namespace, setup: _Setup, target: CompletionTarget, hw: Measurement, base_url: str,
           ids: list[BenchRequest]) -> int:
    """--request-rate R1,R2,...: one run per rate, then the goodput table (and JSON, plot)."""
    def requests_for(run: int) -> list[BenchRequest]:
        requests = fresh_tokens(ids, setup.workload, run)
        return as_text(requests, setup.tokenizer) if setup.tokenizer is not None else requests

    try:
        runs, points = run_sweep(setup.request_rates, requests_for,
                                 lambda rate, requests: _measure(args, setup, target, hw, base_url, rate, requests),
                                 setup.slo, lambda line: print(f"{PROG}: {line}", file=sys.stderr))
    except LoadError as e:
        _error(str(e))
        return 1
    for run in runs:
        _warn_if_client_bound(run.load, f" at {run.info.request_rate or 'inf'} req/s")
    print(format_table(points, setup.slo))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(sweep_dict(runs, points, setup.slo), indent=1) + "\n")
    if args.plot:
        w, info = setup.workload, runs[0].info
        title = (f"{info.model or target.model} on {info.gpu or 'unknown GPU'}: {w.num_prompts} requests per rate, "
                 f"{w.input_len} in / {w.output_len} out (range ratio {w.range_ratio:g})")
        label = (shlex.join(setup.server_args) or "serve run") if setup.url is None else setup.url
        write_goodput_plot(args.plot, title, {label: points}, setup.slo)
    return 0 if all(p.completed for p in points) else 1


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog=PROG, description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
