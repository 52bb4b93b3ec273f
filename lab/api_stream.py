"""What one streamed chunk costs the API process, on the CPU: the real app (serve/api.py under uvicorn,
as `serve run` starts it) in front of a fake engine process that needs no torch and no model.

    python -m lab.api_stream run [--streams 64,128] [--step-ms 8] [--seconds 8] [--out api.json]
    python -m lab.api_stream run --profile DIR      also cProfile the server's event loop (slower)
    python -m lab.api_stream run --stack uvloop     uvicorn on uvloop + httptools (--extra-path DIR
                                                    where they are installed, if not in the venv)
    python -m lab.api_stream app [--streams 128]    the app alone, in this process: ASGI calls without
                                                    uvicorn or sockets, the engine's outputs handed to
                                                    the loop directly; CPU per chunk of the app's own
                                                    path (FastAPI, Starlette, middleware, ours)

The fake engine (FakeCore, in the engine's own child process through scheduler/engine_proc.py's
ProcessCore, as `--engine-loop process` runs) emits one token for every running sequence every
--step-ms, as one step message: ids of the default model's tokenizer (an English text with some
non-ASCII characters, cycled), detokenized in the child as the real core does. The client is
another process: raw HTTP/1.1 over asyncio (uvloop where it imports), N connections, each asking
for one streamed completion of --max-tokens after another (token-id prompts, no tokenizing). It
counts `data: {` events per socket read and keeps each request's arrival times.

Per setting: the server process's CPU time (utime + stime from /proc, all its threads) over the
measurement window divided by the chunks the client received in it; the chunk rate; the client's
inter-chunk gaps (median, p99, within each request, its first chunk excluded) against the fake
engine's own step intervals (written by the child); the client's and engine's CPU share.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.server import free_port, wait_healthy
from scheduler.core import EngineStats

TEXT = ("The quick brown fox jumps over the lazy dog near the riverbank, while a curious cat watches "
        "from the window. Café owners in Zürich serve crème brûlée and naïve jokes; \"quotes\", back\\slashes "
        "and\ttabs stay escaped. 東京の天気は晴れです。 Emoji too: 🚀✨. Numbers 3.14159 and 2,718 follow. ")
HOST = "127.0.0.1"


# -- the fake engine (runs in the engine's child process) ---------------------------------------

@dataclass
class _Scheduler:
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    seqs: dict[int, Any] = field(default_factory=dict)


@dataclass
class _Blocks:
    num_blocks: int = 4096
    num_free_blocks: int = 4096


@dataclass
class _Seq:
    num_prompt_tokens: int
    max_tokens: int
    detok: Any
    num_output_tokens: int = 0


class FakeCore:
    """An EngineCore stand-in: step() waits for the next tick of step_s and emits one token for every
    sequence (ids cycled through TEXT's, each sequence from its own offset)."""

    def __init__(self, step_s: float, model_dir: str, trace_path: str | None) -> None:
        from serve.build import load_tokenizer
        from scheduler.token_bytes import token_bytes_table

        tok = load_tokenizer(Path(model_dir))
        self.table = token_bytes_table(tok)
        # only tokens that are whole characters: one that holds part of a character sends no chunk,
        # and its gap would look like jitter
        self.ids = [i for i in tok.encode(TEXT * 4, add_special_tokens=False) if _whole(self.table[i])]
        self.step_s = step_s
        self.trace_path = trace_path
        self.stats, self.scheduler, self.block_manager = EngineStats(), _Scheduler(), _Blocks()
        self.trace = None
        self.lost = None
        self._next = 0.0
        self._ticks: list[float] = []

    def add_request(self, ids: list[int], params: Any, seq_id: int) -> None:
        from scheduler.detokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(None, list(params.stop), params.skip_special_tokens, self.table)
        self.scheduler.seqs[seq_id] = _Seq(len(ids), params.max_tokens or 16, detok)
        self.scheduler.running.append(seq_id)

    def abort(self, seq_id: int) -> None:
        if self.scheduler.seqs.pop(seq_id, None) is not None:
            self.scheduler.running.remove(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.seqs)

    def hold_wait(self) -> float:
        return 0.0

    def step(self) -> list[Any]:
        from scheduler.request import StepOutput

        now = time.perf_counter()
        if self._next > now:
            time.sleep(self._next - now)
        self._next = max(self._next + self.step_s, time.perf_counter())
        self._ticks.append(time.perf_counter())
        outputs = []
        for sid in list(self.scheduler.running):
            s = self.scheduler.seqs[sid]
            tid = self.ids[(sid * 7 + s.num_output_tokens) % len(self.ids)]
            s.num_output_tokens += 1
            done = s.num_output_tokens >= s.max_tokens
            text = s.detok.add([tid], final=done)
            outputs.append(StepOutput(sid, [tid], done, "length" if done else None, text,
                                      num_prompt_tokens=s.num_prompt_tokens if s.num_output_tokens == 1 else 0,
                                      num_output_tokens=s.num_output_tokens))
            if done:
                self.abort(sid)
        self.stats.num_steps += 1
        self.stats.generation_tokens += len(outputs)
        return outputs

    def close(self) -> None:
        if self.trace_path:
            gaps = [b - a for a, b in zip(self._ticks, self._ticks[1:]) if b - a < 1.0]  # idle spells left out
            Path(self.trace_path).write_text(json.dumps({"steps": len(self._ticks), "gaps_s": gaps[-20000:]}))


def _whole(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def build_fake_core(step_s: float, model_dir: str, trace_path: str | None) -> tuple[FakeCore, Any]:
    """Runs in the engine's child process (ProcessCore's build function)."""
    from serve.engine_process import EngineInfo

    return FakeCore(step_s, model_dir, trace_path), EngineInfo("fake", 32768, 4096, "cpu", "none")


def fake_engine(step_s: float, model_dir: Path, trace_path: str | None) -> Any:
    """A serve.engine_process.ProcessEngine whose child runs a FakeCore."""
    from engine.config import EngineConfig, ModelConfig
    from scheduler.engine_proc import ProcessCore
    from serve.build import load_tokenizer
    from serve.engine_process import ProcessEngine

    core = ProcessCore(build_fake_core, (step_s, str(model_dir), trace_path))
    core.spawn()
    tokenizer = load_tokenizer(model_dir)
    info = core.wait_ready()
    return ProcessEngine(core, tokenizer, ModelConfig.from_path(model_dir), EngineConfig(model=str(model_dir)), info)


def serve(args: argparse.Namespace) -> None:
    """The server process: the app as serve/run_cmd.py runs it, around the fake engine."""
    import uvicorn

    from serve.api import create_app
    from serve import run_cmd
    from serve.run_cmd import GIL_SWITCH_INTERVAL_S, bind_listener
    from serve.server_config import ServerConfig
    from serve.uvicorn_server import DrainingServer

    listener = bind_listener(HOST, args.port)
    engine = fake_engine(args.step_ms / 1e3, Path(args.model), args.engine_trace)
    cfg = ServerConfig(shutdown_timeout_s=2.0)
    app = create_app(engine, cfg)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    stack = {"asyncio": dict(loop="asyncio", http="h11"), "uvloop": dict(loop="uvloop", http="httptools"),
             "auto": {}}[args.stack]
    config = uvicorn.Config(app, host=HOST, port=args.port, log_level="warning", timeout_graceful_shutdown=5, **stack)
    loop = app.state.server.loop
    server = DrainingServer(config, on_exit=lambda: loop.drain(cfg.shutdown_timeout_s))
    from lab.profiling import cprofile_to

    freeze = getattr(run_cmd, "freeze_startup_objects", None)  # absent in older trees
    if freeze is not None:
        freeze()
    pauses = _watch_gc()
    try:
        with cprofile_to(args.profile, limit=60):
            server.run(sockets=[listener])
    finally:
        listener.close()
        engine.shutdown()
        if args.gc_log:
            import collections
            import gc

            kinds = collections.Counter(type(o).__name__ for o in gc.get_objects())
            Path(args.gc_log).write_text(json.dumps({**pauses, "tracked": len(gc.get_objects()),
                                                     "frozen": gc.get_freeze_count(), "top": kinds.most_common(12)}))


def _watch_gc() -> dict[str, list[float]]:
    """The event loop's pauses for the cyclic garbage collector, in seconds, by generation."""
    import gc

    pauses: dict[str, list[float]] = {"0": [], "1": [], "2": []}
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[str(info["generation"])].append(time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)
    return pauses


# -- the client (a process of its own) ----------------------------------------------------------

class _Conn(asyncio.Protocol):
    """One keep-alive connection: a streamed completion, then the next. Counts `data: {` events per read."""

    def __init__(self, client: "_Client") -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.tail = b""
        self.done = False
        self.times: list[float] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.send()

    def send(self) -> None:
        self.tail, self.done, self.times = b"", False, []
        assert self.transport is not None
        self.transport.write(self.client.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        buf = self.tail + data
        n = buf.count(b"data: {")
        if n:
            self.times.extend([now] * n)
        if not self.done and b"data: [DONE]" in buf:
            self.done = True
        self.tail = buf[-12:]
        if self.done and buf.endswith(b"\r\n0\r\n\r\n"):
            self.client.finished(self.times)
            if self.client.running:
                self.send()
            else:
                assert self.transport is not None
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.lost += 1


class _Client:
    def __init__(self, port: int, prompt: list[int], max_tokens: int) -> None:
        body = json.dumps({"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                           "ignore_eos": True}).encode()
        self.request = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        self.running = True
        self.lost = 0
        self.window: tuple[float, float] = (float("inf"), float("inf"))
        self.requests: list[list[float]] = []

    def finished(self, times: list[float]) -> None:
        self.requests.append(times)


def _client_main(args: argparse.Namespace) -> None:
    try:
        import uvloop
        uvloop.install()
        loop_name = "uvloop"
    except ImportError:
        loop_name = "asyncio"
    asyncio.run(_client(args, loop_name))


async def _client(args: argparse.Namespace, loop_name: str) -> None:
    loop = asyncio.get_running_loop()
    client = _Client(args.port, list(range(100, 100 + args.prompt_len)), args.max_tokens)
    conns = []
    for _ in range(args.streams):
        _, conn = await loop.create_connection(lambda: _Conn(client), HOST, args.port)
        conns.append(conn)
    await asyncio.sleep(args.warmup)
    cpu0, t0 = time.process_time(), time.perf_counter()
    print("window-start", flush=True)
    await asyncio.sleep(args.seconds)
    cpu1, t1 = time.process_time(), time.perf_counter()
    print("window-end", flush=True)
    client.running = False
    for c in conns:  # unfinished requests count too: their arrival times so far
        client.requests.append(c.times)
    chunks, gaps = 0, []
    for times in client.requests:
        inside = [t for t in times if t0 <= t < t1]
        chunks += len(inside)
        first = times[0] if times else None
        gaps += [b - a for a, b in zip(inside, inside[1:]) if a != first]
    Path(args.out).write_text(json.dumps({"loop": loop_name, "seconds": t1 - t0, "cpu_s": cpu1 - cpu0,
                                          "chunks": chunks, "gaps_s": gaps, "lost": client.lost}))
    for c in conns:
        if c.transport is not None:
            c.transport.close()


# -- the app alone (no uvicorn, no sockets) ------------------------------------------------------

class _Feed:
    """A CoreClient that only records the sequences; the driver hands their outputs to the loop."""

    def __init__(self) -> None:
        from scheduler.loop import EngineSnapshot

        self.snapshot = EngineSnapshot(num_blocks=4096, num_free_blocks=4096)
        self.events: Any = None
        self.seqs: dict[int, int] = {}  # seq id -> tokens so far
        self.alive = False

    async def start(self, events: Any) -> None:
        self.events, self.alive = events, True

    def notify(self) -> None:
        pass

    async def add(self, seq_ids: list[int], requests: Any) -> None:
        self.seqs.update(dict.fromkeys(seq_ids, 0))

    async def abort(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.seqs.pop(sid, None)

    async def call(self, fn: Any) -> Any:
        return fn(self)

    async def close(self) -> None:
        self.alive = False


async def _app_alone(args: argparse.Namespace) -> dict[str, Any]:
    from types import SimpleNamespace

    from engine.config import ModelConfig
    from scheduler.request import StepOutput
    from scheduler.token_bytes import token_bytes_table
    from serve.api import create_app
    from serve.build import load_tokenizer
    from serve.server_config import ServerConfig

    model = Path(args.model)
    tok = load_tokenizer(model)
    table = token_bytes_table(tok)
    texts = [table[i].decode() for i in tok.encode(TEXT * 4, add_special_tokens=False) if _whole(table[i])]
    feed = _Feed()
    engine = SimpleNamespace(core=feed, tokenizer=tok, model_config=ModelConfig.from_path(model), max_model_len=32768,
                             model_name="fake", config=None)
    app = create_app(engine, ServerConfig())
    life: asyncio.Queue[dict] = asyncio.Queue()
    sent: asyncio.Queue[dict] = asyncio.Queue()
    await life.put({"type": "lifespan.startup"})
    lifespan = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, life.get, sent.put))
    assert (await sent.get())["type"] == "lifespan.startup.complete"
    body = json.dumps({"model": "fake", "prompt": list(range(100, 132)), "max_tokens": 32000, "stream": True,
                       "ignore_eos": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "client": (HOST, 1), "server": (HOST, 8000), "state": {},
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    counts = {"body": 0, "bytes": 0}
    never = asyncio.Event()
    requested = [False] * args.streams

    def receiver(i: int) -> Any:
        async def receive() -> dict:
            if not requested[i]:
                requested[i] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()
            return {"type": "http.disconnect"}
        return receive

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start" and message["status"] != 200:
            raise RuntimeError(f"the app answered {message['status']}")
        if message["type"] == "http.response.body" and message.get("body"):
            counts["body"] += 1
            counts["bytes"] += len(message["body"])

    calls = [asyncio.ensure_future(app(dict(scope), receiver(i), send)) for i in range(args.streams)]
    while len(feed.seqs) < args.streams:
        await asyncio.sleep(0.01)
        for c in calls:
            if c.done():
                c.result()

    async def steps(n: int) -> None:
        for _ in range(n):
            outs = []
            for sid, k in feed.seqs.items():
                feed.seqs[sid] = k + 1
                outs.append(StepOutput(sid, [k], False, None, texts[(sid * 7 + k) % len(texts)], num_output_tokens=k + 1))
            feed.events.on_outputs(outs)
            for _ in range(3):  # every woken stream writes its chunk and waits again
                await asyncio.sleep(0)

    await steps(20)
    from lab.profiling import cprofile_to

    b0, cpu0 = counts["body"], time.process_time()
    with cprofile_to(args.profile, limit=60):
        await steps(args.steps)
    cpu, chunks = time.process_time() - cpu0, counts["body"] - b0
    for c in calls:
        c.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    await life.put({"type": "lifespan.shutdown"})
    await lifespan
    return {"streams": args.streams, "steps": args.steps, "chunks": chunks, "cpu_us_per_chunk": cpu / chunks * 1e6,
            "bytes_per_chunk": counts["bytes"] / max(1, counts["body"])}


def app_alone(args: argparse.Namespace) -> None:
    row = asyncio.run(_app_alone(args))
    print(f"{row['streams']} streams: {row['cpu_us_per_chunk']:.1f} us of CPU per chunk "
          f"({row['chunks']} chunks, {row['bytes_per_chunk']:.0f} bytes each)")
    if args.out:
        Path(args.out).write_text(json.dumps(row))


# -- the driver ---------------------------------------------------------------------------------

def _cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(tree: str, streams: int, step_ms: float, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One server (of the tree label=DIR) and one client for this setting; the figures of its window."""
    label, _, root = tree.rpartition("=")
    root = str(Path(root).resolve())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, args.extra_path) if p)}
    port = free_port()
    tag = f"{label or Path(root).name}-{args.stack}-{streams}x{step_ms:g}"
    trace, client_out, gc_log = tmp / f"engine-{tag}.json", tmp / f"client-{tag}.json", tmp / f"gc-{tag}.json"
    profile = str(Path(args.profile) / f"profile-{tag}.txt") if args.profile else None
    cmd = [sys.executable, "-m", "lab.api_stream", "serve", "--port", str(port), "--step-ms", str(step_ms),
           "--model", args.model, "--stack", args.stack, "--engine-trace", str(trace),
           "--gc-log", str(gc_log)]
    server = subprocess.Popen(cmd + (["--profile", profile] if profile else []), env=env, cwd=root)
    try:
        wait_healthy(server, f"http://{HOST}:{port}", 120)
        engines = _children(server.pid)  # the engine process, and the tokenizing processes (idle here)
        client = subprocess.Popen([sys.executable, "-m", "lab.api_stream", "client", "--port", str(port),
                                   "--streams", str(streams), "--max-tokens", str(args.max_tokens),
                                   "--prompt-len", str(args.prompt_len),
                                   "--warmup", str(args.warmup), "--seconds", str(args.seconds),
                                   "--out", str(client_out)], env=env, cwd=root, stdout=subprocess.PIPE, text=True)
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "window-start"
        s0, e0 = _cpu_s(server.pid), sum(_cpu_s(p) for p in engines)
        assert client.stdout.readline().strip() == "window-end"
        s1, e1 = _cpu_s(server.pid), sum(_cpu_s(p) for p in engines)
        client.wait(60)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    c = json.loads(client_out.read_text())
    steps = json.loads(trace.read_text())["gaps_s"]
    gc_pauses = json.loads(gc_log.read_text())  # over the whole run, not only the window
    heap = {k: gc_pauses.pop(k) for k in ("tracked", "frozen", "top")}  # the collector's objects at exit
    gaps, secs = c["gaps_s"], c["seconds"]
    med, p99 = statistics.median(gaps), _pct(gaps, 0.99)
    emed, ep99 = statistics.median(steps), _pct(steps, 0.99)
    row = {"tree": label or root, "stack": args.stack, "streams": streams, "step_ms": step_ms, "offered_chunks_per_s": streams / step_ms * 1e3,
           "chunks_per_s": c["chunks"] / secs, "server_cpu_us_per_chunk": (s1 - s0) / c["chunks"] * 1e6,
           "server_cpu_share": (s1 - s0) / secs, "engine_cpu_share": (e1 - e0) / secs,
           "client_cpu_share": c["cpu_s"] / secs, "client_cpu_us_per_chunk": c["cpu_s"] / c["chunks"] * 1e6,
           "client_loop": c["loop"], "gap_median_ms": med * 1e3, "gap_p99_ms": p99 * 1e3, "gap_p99_over_median": p99 / med,
           "gaps_coalesced": sum(g < 1e-4 for g in gaps) / len(gaps),
           "engine_step_median_ms": emed * 1e3, "engine_step_p99_ms": ep99 * 1e3,
           "engine_step_p99_over_median": ep99 / emed, "lost_connections": c["lost"],
           "gc_pauses": {g: {"count": len(v), "max_ms": max(v, default=0) * 1e3, "total_ms": sum(v) * 1e3}
                         for g, v in gc_pauses.items()}, "gc_objects_at_exit": heap}
    print(f"{tag:>18}: {row['chunks_per_s']:8.0f} chunks/s (offered {row['offered_chunks_per_s']:.0f}), server "
          f"{row['server_cpu_us_per_chunk']:6.1f} us/chunk, {row['server_cpu_share']:.0%} of a core; client "
          f"{row['client_cpu_share']:.0%}, engine {row['engine_cpu_share']:.0%}; gaps median {row['gap_median_ms']:.2f} ms "
          f"p99 {row['gap_p99_ms']:.2f} ({row['gap_p99_over_median']:.2f}x; engine steps {row['engine_step_p99_over_median']:.2f}x); gc gen2 "
          f"{row['gc_pauses']['2']['count']}x max {row['gc_pauses']['2']['max_ms']:.1f} ms, gen1 max "
          f"{row['gc_pauses']['1']['max_ms']:.1f} ms",
          flush=True)
    return row


def run(args: argparse.Namespace) -> None:
    import tempfile

    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="api-stream-") as tmp:
        for streams in (int(s) for s in args.streams.split(",")):
            for step_ms in (float(s) for s in args.step_ms.split(",")):
                for _ in range(args.repeat):  # trees alternate, so a busy spell of the machine hits each
                    for tree in args.trees.split(","):
                        rows.append(measure(tree, streams, step_ms, args, Path(tmp)))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "max_tokens": args.max_tokens, "seconds": args.seconds,
                                              "cpus": os.cpu_count()}, indent=1))


def _default_model() -> str:
    from engine.default_model import default_model_path

    return str(default_model_path(quiet=True))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--streams", default="64,128", help="concurrent streams, comma-separated")
    r.add_argument("--step-ms", default="8", help="the fake engine's step interval(s), comma-separated")
    r.add_argument("--trees", default=".", help="LABEL=DIR,...: source trees whose server to measure, alternately "
                   "(a baseline: git archive REV | tar -x -C DIR, then copy this file to DIR/lab/)")
    r.add_argument("--repeat", type=int, default=1)
    r.add_argument("--max-tokens", type=int, default=256)
    r.add_argument("--prompt-len", type=int, default=32, help="token ids a request's prompt holds")
    r.add_argument("--warmup", type=float, default=2.0)
    r.add_argument("--seconds", type=float, default=8.0)
    r.add_argument("--stack", default="auto", choices=("auto", "asyncio", "uvloop"),
                   help="uvicorn's loop and HTTP parser: auto (what `serve run` gets: uvloop and httptools where they "
                        "import), asyncio + h11, uvloop + httptools")
    r.add_argument("--extra-path", default=None, help="a folder added to PYTHONPATH (e.g. uvloop and httptools)")
    r.add_argument("--profile", default=None, help="a folder: cProfile of the server process, per setting")
    r.add_argument("--model", default=None, help="tokenizer folder (default: the default model's)")
    r.add_argument("--out", default=None)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--step-ms", type=float, required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--stack", default="auto")
    s.add_argument("--engine-trace", default=None)
    s.add_argument("--profile", default=None)
    s.add_argument("--gc-log", default=None)
    a = sub.add_parser("app")
    a.add_argument("--streams", type=int, default=128)
    a.add_argument("--steps", type=int, default=400)
    a.add_argument("--model", default=None)
    a.add_argument("--profile", default=None, help="a file: cProfile of the measured steps")
    a.add_argument("--out", default=None)
    c = sub.add_parser("client")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--streams", type=int, required=True)
    c.add_argument("--max-tokens", type=int, required=True)
    c.add_argument("--prompt-len", type=int, default=32)
    c.add_argument("--warmup", type=float, required=True)
    c.add_argument("--seconds", type=float, required=True)
    c.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "run":
        args.model = args.model or _default_model()
        run(args)
    elif args.cmd == "serve":
        serve(args)
    elif args.cmd == "app":
        args.model = args.model or _default_model()
        app_alone(args)
    else:
        _client_main(args)


if __name__ == "__main__":
    main()
