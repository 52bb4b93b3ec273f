"""What a request's sampling fields do to its logits before it samples, in vLLM's order: its stop and
end-of-sequence tokens banned while fewer than min_tokens are out, logit_bias added, the repetition
penalty (tokens of the prompt or the output: a positive logit divided by it, a negative one
multiplied), the frequency penalty (times each token's count in the output) and the presence penalty
(once per token in the output) subtracted; min_p drops tokens less likely than min_p times the most
likely one after the temperature. Rows that ask for none of it are left as they are.

Everything happens on the device, after the forward and outside any graph. The penalties read a row's
output tokens: those the host knows, plus the one its previous step sampled if that is still on the
device (async scheduling), read there from that step's samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.sampler import to_device as _upload
from scheduler.request import SamplingParams, ScheduledSeq, Sequence


@dataclass
class PendingTokens:
    """The previous step's sampled tokens on the device, and each sequence's row in them."""
    tokens: torch.Tensor
    rows: dict[int, int]


class LogitAdjuster:
    """Applies the adjustments; keeps each penalized sequence's prompt tokens on the device (sent once,
    dropped when the sequence is finished)."""

    def __init__(self) -> None:
        self._prompts: dict[int, tuple[Sequence, torch.Tensor]] = {}

    @staticmethod
    def needed(items: list[ScheduledSeq]) -> bool:
        return any(it.seq.params.adjusts_logits for it in items)

    def apply(self, logits: torch.Tensor, items: list[ScheduledSeq], pending: PendingTokens | None) -> torch.Tensor:
        """logits [N, V] of the sampling rows `items`, in order -> float32 logits with every row's
        adjustments (a new tensor; logits is not changed)."""
        device = logits.device
        out = logits.to(torch.float32, copy=True)
        vocab = out.shape[1]
        rows = [j for j, it in enumerate(items) if it.seq.params.adjusts_logits]
        ban_r: list[int] = []
        ban_t: list[int] = []
        bias_r: list[int] = []
        bias_t: list[int] = []
        bias_v: list[float] = []
        for j in rows:
            seq = items[j].seq
            p = seq.params
            if p.min_tokens and items[j].end - seq.num_prompt_tokens < p.min_tokens:
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
        if ban_r:
            out.index_put_((_upload(ban_r, torch.int64, device), _upload(ban_t, torch.int64, device)),
                           out.new_full((), float("-inf")))
        if bias_r:
            out.index_put_((_upload(bias_r, torch.int64, device), _upload(bias_t, torch.int64, device)),
                           _upload(bias_v, torch.float32, device), accumulate=True)
        penalized = [j for j in rows if items[j].seq.params.penalizes]
        if penalized:
            self._penalize(out, [items[j] for j in penalized], _upload(penalized, torch.int64, device), pending)
        min_p = [j for j in rows if items[j].seq.params.min_p > 0.0 and items[j].seq.params.temperature > 0.0]
        if min_p:
            index = _upload(min_p, torch.int64, device)
            sub = out.index_select(0, index)
            # p_t < min_p * p_max  <=>  l_t / T < l_max / T + ln(min_p)
            floor = _upload([items[j].seq.params.temperature * math.log(items[j].seq.params.min_p) for j in min_p],
                            torch.float32, device)
            sub.masked_fill_(sub < sub.amax(dim=1, keepdim=True) + floor.unsqueeze(1), float("-inf"))
            out.index_copy_(0, index, sub)
        return out

    def _penalize(self, out: torch.Tensor, items: list[ScheduledSeq], index: torch.Tensor,
                  pending: PendingTokens | None) -> None:
        device, vocab = out.device, out.shape[1]
        self._drop_finished()
        r = len(items)
        # each row's output tokens before the one it samples: the host's, then a pending one
        known: list[int] = []
        known_rows: list[int] = []
        pend_rows: list[int] = []  # (row, row of pending.tokens)
        pend_at: list[int] = []
        for k, it in enumerate(items):
            seq = it.seq
            toks = seq.token_ids
            have = min(len(toks), it.end)
            outputs = toks[seq.num_prompt_tokens:have]
            known += outputs
            known_rows += [k] * len(outputs)
            missing = it.end - have
            if missing:
                if missing > 1 or pending is None or seq.seq_id not in pending.rows:
                    raise RuntimeError("a penalized row's earlier tokens are neither on the host nor in the step "
                                       "before")
                pend_rows.append(k)
                pend_at.append(pending.rows[seq.seq_id])
        counts = torch.zeros((r, vocab), dtype=torch.float32, device=device)
        if known:
            counts.index_put_((_upload(known_rows, torch.int64, device), _upload(known, torch.int64, device)),
                              torch.ones((), device=device), accumulate=True)
        if pend_rows:
            toks = pending.tokens.index_select(0, _upload(pend_at, torch.int64, device))
            counts.index_put_((_upload(pend_rows, torch.int64, device), toks), torch.ones((), device=device),
                              accumulate=True)
        params = [it.seq.params for it in items]
        sub = out.index_select(0, index)
        rep = [p.repetition_penalty for p in params]
        if any(x != 1.0 for x in rep):
            seen = counts > 0
            prompt_rows = [k for k, p in enumerate(params) if p.repetition_penalty != 1.0]
            prompts = [self._prompt(items[k].seq, device) for k in prompt_rows]
            sizes = [t.numel() for t in prompts]
            seen[torch.repeat_interleave(_upload(prompt_rows, torch.int64, device),
                                         _upload(sizes, torch.int64, device), output_size=sum(sizes)),
                 torch.cat(prompts)] = True
            penalty = _upload(rep, torch.float32, device).unsqueeze(1).expand(r, vocab)
            scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
            sub = torch.where(seen, scaled, sub)
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        if any(freq):
            sub -= _upload(freq, torch.float32, device).unsqueeze(1) * counts
        if any(pres):
            sub -= _upload(pres, torch.float32, device).unsqueeze(1) * (counts > 0)
        out.index_copy_(0, index, sub)

    def _prompt(self, seq: Sequence, device: torch.device) -> torch.Tensor:
        """The distinct tokens of seq's prompt on the device (sent once per sequence)."""
        kept = self._prompts.get(seq.seq_id)
        if kept is None or kept[0] is not seq:
            ids = sorted(set(seq.token_ids[:seq.num_prompt_tokens]))
            kept = self._prompts[seq.seq_id] = (seq, _upload(ids, torch.int64, device))
        return kept[1]

    def _drop_finished(self) -> None:
        done = [sid for sid, (seq, _) in self._prompts.items() if seq.is_finished]
        for sid in done:
            del self._prompts[sid]


def adjust_reference(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                     outputs: list[list[int]], eos: list[frozenset[int]]) -> torch.Tensor:
    """LogitAdjuster.apply, row by row and token by token in plain Python over float32 (tests)."""
    out = logits.float().clone()
    vocab = out.shape[1]
    for i, p in enumerate(params):
        row = out[i]
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
