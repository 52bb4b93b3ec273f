"""Per-step timeline of the engine loop, for benchmarks: PAGEDSERVE_STEP_TRACE=path makes the
EngineCore append one JSON line per step (host timestamps in ms, the batch's shape; on a GPU also
the device time of the step it collected, prev_gpu_ms / prev_idle_ms), in batches of 256 lines and
when the trace is closed; `python -m bench.trace_summary` summarizes it. In an engine process
(`--engine-loop process`) the trace also has a line per request it took in (added: the sequence
ids, t0). PAGEDSERVE_API_TRACE=path makes the API side (scheduler/loop.py's AsyncEngine) write a
line per step's outputs it takes in (t0: taken in, t_end: handed to the streams) and one per
finished sequence (t0: its arrival, added: its add returned, after the engine's acknowledgement,
first: its first token taken in, t_end: its last). A stream's delay then splits between the
engine, the API process and the client (`serve bench --chunk-times`, lab/chunk_delay.py):
time.perf_counter and time.monotonic read the system's monotonic clock on Linux, the same in every
process. Off (no cost beyond one attribute test) otherwise."""
from __future__ import annotations

import atexit
import json
import os
import time


class StepTrace:
    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: list[dict] = []
        self.row: dict | None = None

    @classmethod
    def from_env(cls, var: str = "PAGEDSERVE_STEP_TRACE") -> "StepTrace | None":
        path = os.environ.get(var)
        if not path:
            return None
        trace = cls(path)
        atexit.register(trace.flush)
        return trace

    def begin(self) -> None:
        if len(self.rows) >= 256:
            self.flush()
        self.row = {"t0": time.perf_counter() * 1e3}

    def mark(self, name: str, **fields: float) -> None:
        if self.row is not None:
            self.row[name] = time.perf_counter() * 1e3
            self.row.update(fields)

    def end(self) -> None:
        if self.row is not None:
            self.mark("t_end")
            self.rows.append(self.row)
            self.row = None

    def record(self, row: dict) -> None:
        """A row of its own (not a step's), e.g. one request's times."""
        if len(self.rows) >= 256:
            self.flush()
        self.rows.append(row)

    def annotate_last(self, name: str) -> None:
        """Stamp the last finished step with the time now (e.g. when its outputs were sent)."""
        if self.rows:
            self.rows[-1][name] = time.perf_counter() * 1e3

    def flush(self) -> None:
        if self.rows:
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in self.rows))
            self.rows.clear()
