"""LoRA adapters as requests name them: vLLM's LoRARequest offline, the `model` field over HTTP.
An adapter's number (SamplingParams.lora) is its place in the engine's lora_modules (from 1), or
for one loaded later (LoraManager) the next number not given before."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: the adapter is found by its name among those the engine has loaded (lora_modules at
    start-up, or earlier requests); with enable_lora, lora_path loads one that is not. lora_int_id
    is accepted for compatibility (the engine numbers the adapters itself)."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def _same(a: str, b: str) -> bool:
    from pathlib import Path

    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


class LoraManager:
    """An offline engine's adapters by name: those loaded at start-up (SamplingParams.lora 1..n,
    slots 0..n-1) and, with enable_lora, any other that a LoRARequest's path names, loaded on first
    use into a free slot or over the adapter least recently asked for that no unfinished request
    uses (an adapter once loaded is found by its name again)."""

    def __init__(self, config: Any, core: Any) -> None:
        self.core = core
        self.slots = int(getattr(core.executor, "lora_slots", 0))
        self.dynamic = bool(getattr(config, "enable_lora", False))
        self.loaded: dict[str, tuple[int, int]] = {}  # name -> (SamplingParams.lora, slot)
        self.paths: dict[str, str] = {}  # every adapter loaded so far
        for i, (name, path) in enumerate(getattr(config, "lora_modules", ())):
            self.loaded[name] = (i + 1, i)
            self.paths[name] = path
        self._next_id = len(self.loaded) + 1
        self._last_use: dict[str, int] = {}
        self._clock = 0

    def ids(self, requests: list[LoRARequest | str | None]) -> list[int]:
        """Each request's SamplingParams.lora (0: the base model), loading the adapters that are
        not loaded; ValueError says why one can't be served."""
        wanted = {r if isinstance(r, str) else r.lora_name for r in requests if r is not None}
        if self.dynamic and len(wanted) > self.slots:
            raise ValueError(f"these prompts ask for {len(wanted)} LoRA adapters; the engine holds {self.slots} at "
                             "once (max_loras)")
        return [0 if r is None else self._id(r, wanted) for r in requests]

    def _id(self, request: LoRARequest | str, pinned: set[str]) -> int:
        name, path = (request, "") if isinstance(request, str) else (request.lora_name, request.lora_path)
        self._clock += 1
        self._last_use[name] = self._clock
        known = self.paths.get(name)
        if known is not None and path and not _same(path, known):
            raise ValueError(f"LoRA adapter {name!r} was loaded from {known}, not {path}")
        if name in self.loaded:
            return self.loaded[name][0]
        path = path or known or ""
        if not self.dynamic or not path:
            loaded = ", ".join(repr(n) for n in self.loaded) or "none"
            how = ("a LoRARequest with its lora_path loads it" if self.dynamic else
                   "adapters load at start-up (LLM(lora_modules={name: folder}) or serve run --lora-modules "
                   "name=folder), or on first use with LLM(enable_lora=True)")
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded}); {how}")
        slot = self._free_slot(pinned)
        lora_id, self._next_id = self._next_id, self._next_id + 1
        self.core.executor.load_lora(slot, lora_id, name, str(path))
        self.loaded[name] = (lora_id, slot)
        self.paths[name] = str(path)
        self.core.scheduler.loras.add(lora_id)
        return lora_id

    def _free_slot(self, pinned: set[str]) -> int:
        taken = {slot: name for name, (_, slot) in self.loaded.items()}
        free = [s for s in range(self.slots) if s not in taken]
        if free:
            return free[0]
        in_use = {seq.params.lora for seq in self.core.scheduler.seqs.values()}
        idle = [n for n in taken.values() if n not in pinned and self.loaded[n][0] not in in_use]
        if not idle:
            raise ValueError(f"all {self.slots} LoRA adapter slots hold adapters that unfinished requests use; "
                             "raise max_loras")
        victim = min(idle, key=lambda n: self._last_use.get(n, 0))
        lora_id, slot = self.loaded.pop(victim)
        self.core.scheduler.loras.discard(lora_id)
        return slot


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_shape(folders: list[str]) -> Any:
    """kvcache/calc.py's LoraShape of these PEFT adapters, from their adapter_config.json alone
    (the largest rank, rank_pattern's included; the projections their target_modules name), for
    sizing without loading them; ValueError says what is wrong."""
    import json
    import re
    from pathlib import Path

    from kvcache.calc import LoraShape

    rank, targets = 0, set()
    for folder in folders:
        path = Path(folder).expanduser() / "adapter_config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"LoRA adapter {folder}: can't read {path} ({e})") from None
        rank = max([rank, int(config.get("r", 8))] + [int(r) for r in (config.get("rank_pattern") or {}).values()])
        wanted = config.get("target_modules") or []
        for t in TARGETS:
            module = f"model.layers.0.{'mlp' if t in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{t}"
            if (wanted == "all-linear" or (isinstance(wanted, str) and re.fullmatch(wanted, module))
                    or (isinstance(wanted, list) and any(module == w or module.endswith("." + w) for w in wanted))):
                targets.add(t)
    return LoraShape(len(folders), rank, frozenset(targets))
