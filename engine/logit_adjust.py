"""What a request's sampling fields do to its logits before it samples, in vLLM's order: every token
but its allowed_token_ids banned (where it names them), its stop and end-of-sequence tokens banned
while fewer than min_tokens are out, logit_bias added, the repetition penalty (tokens of the prompt
or the output: a positive logit divided by it, a negative one multiplied), the frequency penalty
(times each token's count in the output) and the presence penalty (once per token in the output)
subtracted; min_p drops tokens less likely than min_p times the most likely one after the
temperature. Rows that ask for none of it are left as they are.

Everything happens on the device, after the forward and outside any graph. A penalized sequence keeps
a row of output-token counts on the device (and, for the repetition penalty, a row marking its prompt's
tokens), to which each token it samples is added there as it is sampled: no step waits for its
tokens to reach the host, so async scheduling and multi-step decode rounds keep running. The three
penalties take one Triton kernel on a GPU (kernels/penalties.py), torch ops on the CPU.
"""
from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass

import torch

from engine.sampler import to_device as _upload
from kernels.reference import penalize_rows as penalize_reference
from scheduler.request import SamplingParams, ScheduledSeq


@dataclass
class _Counted:
    """A penalized sequence's row of LogitAdjuster's buffers, and how many of its output tokens it
    holds. The sequence is held weakly: a tensor-parallel follower's mirrored copy is never marked
    finished, only dropped."""
    seq: weakref.ref
    slot: int
    counted: int = 0


class _Packed:
    """Lists sent to the device in one upload (none where all are empty); [i] is list i's slice."""

    def __init__(self, device: torch.device, dtype: torch.dtype, *lists: list) -> None:
        self.ends = list(itertools.accumulate(len(x) for x in lists))
        flat = [v for x in lists for v in x]
        self.data = _upload(flat, dtype, device) if flat else None

    def __getitem__(self, i: int) -> torch.Tensor:
        assert self.data is not None
        return self.data[self.ends[i - 1] if i else 0:self.ends[i]]


class _Count:
    """Called with the tokens sampled from LogitAdjuster.apply()'s logits: adds the penalized rows'
    tokens to their counts, with the rows and slots apply() already sent to the device."""

    def __init__(self, counts: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                 slots: torch.Tensor | None = None, states: list[_Counted] | None = None) -> None:
        self.counts, self.rows, self.slots, self.states = counts, rows, slots, states or []

    def __call__(self, tokens: torch.Tensor) -> None:
        if not self.states:
            return
        for state in self.states:
            state.counted += 1
        assert self.counts is not None and self.rows is not None and self.slots is not None
        self.counts.index_put_((self.slots, tokens.index_select(0, self.rows)), self.counts.new_ones(()),
                               accumulate=True)


def _penalize_on_gpu(*args: torch.Tensor) -> None:
    from kernels.penalties import penalize_rows  # Triton: only on a GPU

    penalize_rows(*args)


class LogitAdjuster:
    """Applies the adjustments, and keeps the penalized sequences' counts ([slots, V] on the device,
    grown as needed; a slot is free again once its sequence is finished or gone)."""

    def __init__(self) -> None:
        self._rows: dict[int, _Counted] = {}
        self._free: list[int] = []
        self._counts: torch.Tensor | None = None  # float32 [slots, V]: each output token's count
        self._prompt: torch.Tensor | None = None  # bool [slots, V]: the prompt's tokens (repetition penalty)

    @staticmethod
    def needed(items: list[ScheduledSeq]) -> bool:
        return any(it.seq.params.adjusts_logits for it in items)

    def apply(self, logits: torch.Tensor, items: list[ScheduledSeq], step: int = 0) -> tuple[torch.Tensor, _Count]:
        """logits [N, V] of the sampling rows `items`, in order -> (float32 logits with every row's
        adjustments, a new tensor; count, to be called with the tokens sampled from them). step: the
        how-manieth step of a multi-step round (each row's output position moves on by it)."""
        device = logits.device
        out = logits.to(torch.float32, copy=True)
        vocab = out.shape[1]
        rows = [j for j, it in enumerate(items) if it.seq.params.adjusts_logits]
        ban_r: list[int] = []
        ban_t: list[int] = []
        bias_r: list[int] = []
        bias_t: list[int] = []
        bias_v: list[float] = []
        allow_rows: list[int] = []
        allow_r: list[int] = []
        allow_t: list[int] = []
        for j in rows:
            seq = items[j].seq
            p = seq.params
            if p.allowed_token_ids:
                if p.allowed_token_ids[-1] >= vocab:  # sorted
                    raise ValueError(f"allowed_token_ids: {p.allowed_token_ids[-1]} is outside the vocabulary")
                allow_r += [len(allow_rows)] * len(p.allowed_token_ids)
                allow_t += p.allowed_token_ids
                allow_rows.append(j)
            if p.min_tokens and items[j].end + step - seq.num_prompt_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
                stops = [t for t in stops if t < vocab]
                ban_r += [j] * len(stops)
                ban_t += stops
            if p.logit_bias:
                for t, b in p.logit_bias.items():
                    if t >= vocab:
                        raise ValueError(f"logit_bias: token {t} is outside the vocabulary (0..{vocab - 1})")
                    bias_r.append(j)
                    bias_t.append(t)
                    bias_v.append(b)
        penalized = [j for j in rows if items[j].seq.params.penalizes]
        states: list[_Counted] = []
        if penalized:
            self._drop_finished()
            states = [self._sync(items[j], step, vocab, device) for j in penalized]
        slots = [state.slot for state in states]
        min_p = [j for j in rows if items[j].seq.params.min_p > 0.0 and items[j].seq.params.temperature > 0.0]
        # every row list in one upload, every value in another: each upload costs the host more than
        # a launch (a small model's decode step is host-bound)
        ints = _Packed(device, torch.int64, ban_r, ban_t, bias_r, bias_t, penalized, slots, min_p, allow_rows, allow_r,
                       allow_t)
        pen = [items[j].seq.params for j in penalized]
        # p_t < min_p * p_max  <=>  l_t / T < l_max / T + ln(min_p)
        floats = _Packed(device, torch.float32, bias_v,
                         [x for p in pen for x in (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)],
                         [items[j].seq.params.temperature * math.log(items[j].seq.params.min_p) for j in min_p])
        if allow_rows:
            keep = torch.zeros((len(allow_rows), vocab), dtype=torch.bool, device=device)
            keep.index_put_((ints[8], ints[9]), keep.new_ones(()))
            out.index_copy_(0, ints[7], out.index_select(0, ints[7]).masked_fill_(~keep, float("-inf")))
        if ban_r:
            out.index_put_((ints[0], ints[1]), out.new_full((), float("-inf")))
        if bias_r:
            out.index_put_((ints[2], ints[3]), floats[0], accumulate=True)
        count = _Count()
        if penalized:
            assert self._counts is not None and self._prompt is not None
            penalize = _penalize_on_gpu if device.type == "cuda" else penalize_reference
            penalize(out, ints[4], ints[5], floats[1].view(-1, 3), self._counts, self._prompt)
            count = _Count(self._counts, ints[4], ints[5], states)
        if min_p:
            sub = out.index_select(0, ints[6])
            sub.masked_fill_(sub < sub.amax(dim=1, keepdim=True) + floats[2].unsqueeze(1), float("-inf"))
            out.index_copy_(0, ints[6], sub)
        return out, count

    def _sync(self, it: ScheduledSeq, step: int, vocab: int, device: torch.device) -> _Counted:
        """it's sequence's state, its slot's counts holding every output token before the one it samples now.
        Those sampled here were counted as they were sampled; a sequence seen first (or whose tokens
        were taken back) is counted from the tokens the host has."""
        seq = it.seq
        before = it.end + step - seq.num_prompt_tokens
        state = self._rows.get(seq.seq_id)
        if state is None or state.seq() is not seq or state.counted > before:
            if state is None:
                state = self._rows[seq.seq_id] = _Counted(weakref.ref(seq), self._take_slot(vocab, device))
            state.seq, state.counted = weakref.ref(seq), 0
            assert self._counts is not None and self._prompt is not None
            self._counts[state.slot].zero_()
            self._prompt[state.slot].zero_()
            if seq.params.repetition_penalty != 1.0:  # the only penalty that reads the prompt's tokens
                prompt = sorted(set(seq.token_ids[:seq.num_prompt_tokens]))
                self._prompt[state.slot].index_fill_(0, _upload(prompt, torch.int64, device), True)
        if state.counted < before:
            first = seq.num_prompt_tokens + state.counted
            known = seq.token_ids[first:seq.num_prompt_tokens + before]
            if len(known) < before - state.counted:
                raise RuntimeError("a penalized sequence's earlier output tokens are neither counted nor on the host")
            assert self._counts is not None
            self._counts[state.slot].index_put_((_upload(known, torch.int64, device),),
                                                self._counts.new_ones(()), accumulate=True)
            state.counted = before
        return state

    def _take_slot(self, vocab: int, device: torch.device) -> int:
        if not self._free:
            old = 0 if self._counts is None else self._counts.shape[0]
            size = max(8, 2 * old)
            counts = torch.zeros((size, vocab), dtype=torch.float32, device=device)
            prompt = torch.zeros((size, vocab), dtype=torch.bool, device=device)
            if self._counts is not None and self._prompt is not None:
                counts[:old].copy_(self._counts)
                prompt[:old].copy_(self._prompt)
            self._counts, self._prompt = counts, prompt
            self._free = list(range(size - 1, old - 1, -1))
        return self._free.pop()

    def _drop_finished(self) -> None:
        done = [sid for sid, st in self._rows.items() if (seq := st.seq()) is None or seq.is_finished]
        for sid in done:
            self._free.append(self._rows.pop(sid).slot)

    @property
    def num_slots(self) -> int:
        """Slots held by penalized sequences (tests)."""
        return len(self._rows)


def adjust_reference(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                     outputs: list[list[int]], eos: list[frozenset[int]]) -> torch.Tensor:
    """LogitAdjuster.apply, row by row and token by token in plain Python over float32 (tests)."""
    out = logits.float().clone()
    vocab = out.shape[1]
    for i, p in enumerate(params):
        row = out[i]
        if p.allowed_token_ids:
            for t in range(vocab):
                if t not in p.allowed_token_ids:
                    row[t] = float("-inf")
        if len(outputs[i]) < p.min_tokens:
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos[i])):
                row[t] = float("-inf")
        for t, b in p.logit_bias.items():
            row[t] += b
        for t in range(vocab):
            count = outputs[i].count(t)
            if p.repetition_penalty != 1.0 and (count or t in prompts[i]):
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
            row[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        if p.min_p > 0.0 and p.temperature > 0.0:
            probs = (row / p.temperature).softmax(dim=0)
            row[probs < p.min_p * probs.max()] = float("-inf")
    return out
