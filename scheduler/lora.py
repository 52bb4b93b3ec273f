"""The engine's LoRA adapters by name (torch-free): which are loaded, each one's number
(SamplingParams.lora, which roots its sequences' prefix-cache chains) and slot. Those of
lora_modules are numbers 1..n in slots 0..n-1; with runtime loading, another one loads into a free
slot, or over the adapter least recently asked for that no unfinished request uses, and takes the
next number not given before (its cached blocks can't be another's). The executor writes the weights."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from scheduler.policy import RequestRejected
from scheduler.request import startup_lora_slots


class UnknownAdapter(RequestRejected):
    """A request names a LoRA adapter the engine has not loaded."""


class LoraRegistry:
    def __init__(self, modules: tuple[tuple[str, str], ...], slots: int, runtime: bool,
                 write: Callable[[int, int, str, str], None], numbers: set[int]) -> None:
        """write(slot, number, name, path): the executor's load; numbers: the scheduler's set of the
        numbers requests may use, kept here."""
        self.slots, self.runtime = slots, runtime
        self._write, self._numbers = write, numbers
        self.loaded: dict[str, tuple[int, int]] = {}  # name -> (number, slot)
        self.paths: dict[str, str] = {}  # every adapter loaded so far, by name
        self.loaded_by: dict[str, str] = {}  # name -> the token of the load that brought it in (undo_load)
        for (name, path), (number, slot) in zip(modules, startup_lora_slots(len(modules)).items()):
            self.loaded[name] = (number, slot)
            self.paths[name] = path
            numbers.add(number)
        self._next = len(modules) + 1
        self._last_use: dict[str, int] = {}
        self._clock = 0

    def number(self, name: str) -> int:
        """A loaded adapter's number (and it counts as used now); UnknownAdapter if not loaded."""
        hit = self.loaded.get(name)
        if hit is None:
            loaded = ", ".join(repr(n) for n in self.loaded) or "none"
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        self._clock += 1
        self._last_use[name] = self._clock
        return hit[0]

    def load(self, name: str, path: str, in_use: set[int], pinned: frozenset[str] = frozenset(),
             token: str = "") -> int:
        """name's number, loading it from path (or the path it was loaded from before) where it is not
        loaded; in_use: the numbers unfinished requests use (their slots stay); pinned: names not to
        evict; token: names this load, for undo_load. ValueError (LoraError) says why it can't be."""
        known = self.paths.get(name)
        if known is not None and path and not _same(path, known):
            raise ValueError(f"LoRA adapter {name!r} was loaded from {known}, not {path}")
        if name in self.loaded:
            return self.number(name)
        path = path or known or ""
        if not self.runtime:
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded (loaded: "
                                 f"{', '.join(repr(n) for n in self.loaded) or 'none'}); adapters load at start-up "
                                 "(--lora-modules), or while serving with --enable-lora / LLM(enable_lora=True)")
        if not path:
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded; give its path to load it")
        slot, evicted = self._free_slot(in_use, pinned)
        number = self._next
        self._write(slot, number, name, str(path))  # raises before anything here changes
        self._next += 1
        if evicted is not None:
            self._drop(evicted)
        self.loaded[name] = (number, slot)
        self.paths[name] = str(path)
        self.loaded_by[name] = token
        self._numbers.add(number)
        return self.number(name)

    def unload(self, name: str, in_use: set[int]) -> None:
        """Forget name (its slot is free); ValueError while unfinished requests use it."""
        hit = self.loaded.get(name)
        if hit is None:
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded")
        if hit[0] in in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by unfinished requests; unload it once they end")
        self._drop(name)

    def undo_load(self, name: str, token: str, in_use: set[int]) -> bool:
        """Unload name if the load named token brought it in and no unfinished request uses it (a load
        that failed on another engine is taken back here); whether it was."""
        hit = self.loaded.get(name)
        if not token or hit is None or self.loaded_by.get(name) != token or hit[0] in in_use:
            return False
        self._drop(name)
        return True

    def _drop(self, name: str) -> None:
        self.loaded_by.pop(name, None)
        number, _ = self.loaded.pop(name)
        self._numbers.discard(number)

    def _free_slot(self, in_use: set[int], pinned: frozenset[str]) -> tuple[int, str | None]:
        """(a slot to load into, the adapter it evicts or None)."""
        taken = {slot: name for name, (_, slot) in self.loaded.items()}
        free = [s for s in range(self.slots) if s not in taken]
        if free:
            return free[0], None
        idle = [n for n in taken.values() if n not in pinned and self.loaded[n][0] not in in_use]
        if not idle:
            raise ValueError(f"all {self.slots} LoRA adapter slots hold adapters that unfinished requests use; "
                             "raise max_loras")
        victim = min(idle, key=lambda n: self._last_use.get(n, 0))
        return self.loaded[victim][1], victim


def _same(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


# What the server runs on each engine core (module-level: picklable into an engine process)
def load_lora(name: str, path: str, token: str, core) -> int:
    return core.load_lora(name, path, token=token)


def undo_lora_load(name: str, token: str, core) -> bool:
    return core.loras.undo_load(name, token, core.loras_in_use())


def unload_lora(name: str, core) -> None:
    core.unload_lora(name)


def loaded_adapters(core) -> list[tuple[str, str]]:
    """(name, folder) of each loaded adapter, in slot order."""
    registry = core.loras
    return [(name, registry.paths[name]) for name, _ in sorted(registry.loaded.items(), key=lambda kv: kv[1][1])]
