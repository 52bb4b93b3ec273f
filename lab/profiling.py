"""cProfile around a block of a benchmark, its top functions written to a file."""
from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def cprofile_to(path: str | None, limit: int = 45) -> Iterator[None]:
    """Profile the block and write its top `limit` functions by own and by cumulative time to
    path; a no-op when path is None."""
    if path is None:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        write_top(prof, path, limit)


def write_top(prof: cProfile.Profile, path: str, limit: int = 45) -> None:
    """prof's top `limit` functions by own and by cumulative time, into path."""
    buf = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(limit)
    Path(path).write_text(buf.getvalue())
