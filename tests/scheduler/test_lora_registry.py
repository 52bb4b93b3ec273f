"""scheduler/lora.py's registry: a load over HTTP runs on every engine, and where it fails on one the
server takes it back on the others by its token: only an adapter that load brought in, and no
unfinished request uses, goes; one loaded before (at start-up, by an earlier load) stays."""
from __future__ import annotations

from scheduler.lora import LoraRegistry


def registry(modules=(("base", "/adapters/base"),), slots: int = 3) -> tuple[LoraRegistry, list]:
    writes: list = []
    return LoraRegistry(tuple(modules), slots, True, lambda *args: writes.append(args), set()), writes


def test_a_failed_load_is_taken_back_by_its_token_only():
    r, writes = registry()
    number = r.load("sql", "/adapters/sql", set(), token="t1")
    assert "sql" in r.loaded and len(writes) == 1
    assert not r.undo_load("sql", "t2", set())  # another load's token
    assert not r.undo_load("sql", "t1", {number})  # a request uses it meanwhile: it stays
    assert r.load("sql", "/adapters/sql", set(), token="t3") == number  # loaded already: t3 brought nothing
    assert not r.undo_load("sql", "t3", set())
    assert r.undo_load("sql", "t1", set()) and "sql" not in r.loaded and number not in r._numbers
    assert not r.undo_load("base", "", set()) and "base" in r.loaded  # start-up adapters have no token
    assert not r.undo_load("missing", "t1", set())
