"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, and logprobs.

Random rows sample with the exponential race (argmax of p / E, E ~ Exp(1)), which draws exactly
from p. A seeded request draws its noise from a generator seeded by (seed, output position), so
its tokens don't depend on what else is in the batch, and a preempted request recomputes the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scheduler.request import SamplingParams, TokenLogprob


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, built by the runner for the rows that sample."""
    params: list[SamplingParams]
    output_positions: list[int]  # how many tokens each row's sequence has generated so far
    # the rows' parameters on the device (_row_tensors), built by the first sampling: every step of
    # a multi-step round samples the same rows
    _device: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def max_logprobs(self) -> int | None:
        wanted = [p.logprobs for p in self.params if p.logprobs is not None]
        return max(wanted) if wanted else None


_M64 = 2**64 - 1


def _mix64(x: int) -> int:
    """A bijection of 64-bit integers that scatters nearby inputs (SplitMix64's finalizer)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _seed_for(seed: int, position: int) -> int:
    """The generator seed of a request's token at `position` (a non-negative int64): any two seeds
    of the int64 range collide only by chance (a reduction modulo 2**63 - 1 made 0 and 2**63 - 1,
    -1 and 2**63 - 2 the same stream)."""
    return _mix64((_mix64(seed & _M64) + position) & _M64) >> 1


def _sorted_outside(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits sorted by row, descending: (mask of the ranks outside each row's top-k and top-p
    nucleus, the probabilities of the ranks within top-k)."""
    vocab = sorted_logits.shape[-1]
    ranks = torch.arange(vocab, device=sorted_logits.device).unsqueeze(0)
    mask = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked before it already reach top_p; the top token always stays.
    mask |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    mask[:, 0] = False
    return mask, probs


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [N, V] outside each row's top-k and top-p nucleus with -inf.
    top_k [N] long (V = disabled), top_p [N] float (1 = disabled)."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    mask, _ = _sorted_outside(sorted_logits, top_k, top_p)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the GPU (pinned, non-blocking copy):
    a plain torch.tensor(..., device="cuda") would wait for the step in flight."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class HostSlots:
    """Pinned host buffers for the sampled tokens' copies to the host, with their events, reused in
    turn: a new pinned tensor and event every step cost the host more than the copy itself. A slot
    is busy from start_copy() until to_host() has read it; when the next one is still busy (a
    step launched but never collected), a copy takes a fresh buffer instead."""

    def __init__(self, rows: int, slots: int = 4) -> None:
        self.rows = rows
        self.bufs = [torch.empty(rows, dtype=torch.int64, pin_memory=True) for _ in range(slots)]
        self.events = [torch.cuda.Event() for _ in range(slots)]
        self.busy = [False] * slots
        self.next = 0

    def take(self, n: int) -> int | None:
        """A free slot for n tokens (marked busy), or None."""
        i = self.next
        if n > self.rows or self.busy[i]:
            return None
        self.busy[i] = True
        self.next = (i + 1) % len(self.bufs)
        return i


@dataclass
class DeviceSamples:
    """Sampled token ids [N] int64 on the device (the next step may read them there), plus what
    logprobs need; to_host() waits for them."""
    tokens: torch.Tensor
    params: list[SamplingParams]
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # chosen [N], top values/ids [N, k]
    steps: torch.Tensor | None = None  # a multi-step batch's greedy tokens of every step [S, N] (tokens: the last)
    _host: torch.Tensor | None = None
    _ready: torch.cuda.Event | None = None
    _slot: tuple[HostSlots, int] | None = None

    def _ids(self) -> torch.Tensor:
        """What goes to the host: the tokens, or every step's of a multi-step batch."""
        return self.tokens if self.steps is None else self.steps

    def start_copy(self, slots: HostSlots | None = None) -> None:
        """Begin the device-to-host copy of the token ids behind the work already queued (into one
        of `slots` when one is free)."""
        if self.tokens.device.type != "cuda":
            return
        src = self._ids()
        n = src.numel()
        i = slots.take(n) if slots is not None else None
        if i is None:
            self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self._ready = torch.cuda.Event()
        else:
            self._host, self._ready, self._slot = slots.bufs[i][:n].view(src.shape), slots.events[i], (slots, i)
        self._host.copy_(src, non_blocking=True)
        self._ready.record()

    def to_host(self) -> tuple[list, list[TokenLogprob | None]]:
        """(token ids [N], or [S][N] for a multi-step batch; logprobs [N])"""
        if self._ready is not None:
            self._ready.synchronize()
            token_list = self._host.tolist()
            if self._slot is not None:
                slots, i = self._slot
                slots.busy[i] = False
                self._slot = None
        else:
            token_list = self._ids().tolist()
        if self.logprobs is None:
            return token_list, [None] * self.tokens.shape[0]
        chosen, top_vals, top_ids = self.logprobs
        chosen_l, vals_l, ids_l = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
        out: list[TokenLogprob | None] = []
        for i, p in enumerate(self.params):
            if p.logprobs is None:
                out.append(None)
                continue
            top = list(zip(ids_l[i][:p.logprobs], vals_l[i][:p.logprobs]))
            out.append(TokenLogprob(token_list[i], chosen_l[i], top))
        return token_list, out


def _row_tensors(batch: SamplingBatch, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's per-row temperature (0: greedy), top-k (vocab: off) and top-p (1: off) on the
    device, as kernels/sample.py takes them; built once per batch."""
    t = batch._device
    if not t:
        params = batch.params
        t["temps"] = to_device([0.0 if p.greedy else p.temperature for p in params], torch.float32, device)
        t["top_k"] = to_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.int32, device)
        t["top_p"] = to_device([p.top_p for p in params], torch.float32, device)
    return t


def _row_seeds(batch: SamplingBatch, generator: torch.Generator | None, step: int, device: torch.device) -> torch.Tensor:
    """Each row's noise key for kernels/sample.py: a seeded row's from (seed, output position), the
    others' drawn from the engine's generator."""
    seeds = torch.randint(0, 2**62, (len(batch.params),), generator=generator, device=device, dtype=torch.int64)
    seeded = [(i, _seed_for(p.seed, batch.output_positions[i] + step)) for i, p in enumerate(batch.params)
              if p.seed is not None and not p.greedy]
    if seeded:
        rows, values = zip(*seeded)
        seeds[to_device(list(rows), torch.int64, device)] = to_device(list(values), torch.int64, device)
    return seeds


def sample_on_device(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None,
                     step: int = 0, raw: torch.Tensor | None = None) -> DeviceSamples:
    """logits [N, V] (any float dtype) -> one token id per row (and logprobs for the rows that
    asked), on the device, with no host synchronization. Greedy rows read the logits as they are
    (the argmax of a bf16 row is the argmax of its exact float32 copy); temperature, top-k/top-p
    and logprobs work in float32. On a GPU, sampled rows without logprobs take one kernel
    (kernels/sample.py), no sort. step: the how-manieth step of a multi-step round this is (a
    seeded row's output position moves on by it). raw: the logits before engine/logit_adjust.py's
    adjustments, where logits carry them: logprobs are the model's, as vLLM reports them by default."""
    n, vocab = logits.shape
    device = logits.device
    k = batch.max_logprobs
    if k is None and not batch.all_greedy and device.type == "cuda":
        from kernels.sample import sample_rows  # Triton: only on a GPU

        rows = _row_tensors(batch, vocab, device)
        tokens = sample_rows(logits, rows["temps"], rows["top_k"], rows["top_p"], _row_seeds(batch, generator, step, device))
        return DeviceSamples(tokens, batch.params)
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy and k is None:
        return DeviceSamples(greedy_tokens, batch.params)
    logits = logits.float()
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        rows = _row_tensors(batch, vocab, device)
        temps = rows["temps"]
        scaled = logits / torch.where(temps > 0, temps, 1.0).unsqueeze(1)
        # the exponential race, among the nucleus in sorted order where there is one (the order
        # the noise is drawn in is immaterial; sorted, no scatter back is needed)
        idx = None
        if any(p.top_k > 0 or p.top_p < 1.0 for p in batch.params):
            scaled, idx = scaled.sort(dim=-1, descending=True)
            outside, probs = _sorted_outside(scaled, rows["top_k"], rows["top_p"])
            probs = probs.masked_fill_(outside, 0.0)
        else:
            probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for i, p in enumerate(batch.params):
            if p.seed is not None and not p.greedy:
                g = torch.Generator(device=device).manual_seed(_seed_for(p.seed, batch.output_positions[i] + step))
                noise[i].exponential_(generator=g)
        sampled = probs.div_(noise).argmax(dim=-1)
        if idx is not None:
            sampled = idx.gather(1, sampled.unsqueeze(1)).squeeze(1)
        tokens = torch.where(temps == 0, greedy_tokens, sampled)
    if k is None:
        return DeviceSamples(tokens, batch.params)
    logprobs = (logits if raw is None else raw.float()).log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_vals, top_ids = logprobs.topk(max(k, 1), dim=-1)
    return DeviceSamples(tokens, batch.params, (chosen, top_vals, top_ids))


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """sample_on_device, then wait for the result on the host."""
    return sample_on_device(logits, batch, generator).to_host()
