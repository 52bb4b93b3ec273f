"""Per-step timeline of the engine loop, for benchmarks: PAGEDSERVE_STEP_TRACE=path makes the
EngineCore append one JSON line per step (host timestamps in ms, the batch's shape; on a GPU also
the device time of the step it collected, prev_gpu_ms / prev_idle_ms), in batches of 256 lines and
when the trace is closed; `python -m bench.trace_summary` summarizes it. Off (no cost beyond one
attribute test) otherwise."""
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
    def from_env(cls) -> "StepTrace | None":
        path = os.environ.get("PAGEDSERVE_STEP_TRACE")
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

    def annotate_last(self, name: str) -> None:
        """Stamp the last finished step with the time now (e.g. when its outputs were sent)."""
        if self.rows:
            self.rows[-1][name] = time.perf_counter() * 1e3

    def flush(self) -> None:
        if self.rows:
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in self.rows))
            self.rows.clear()
