"""One streamed completion request against an OpenAI-compatible server, timed chunk by chunk.

Token counting per chunk, best source first:
  1. the chunk's choice carries `token_ids` (a vLLM-style extension): their number;
  2. the chunk carries cumulative `usage.completion_tokens` (continuous usage stats): the increase;
  3. the choice carries `logprobs.tokens`: their number;
  4. otherwise one token per chunk with non-empty text.
The output token count of a request is the final usage's completion_tokens when the server sends
it (we ask with stream_options.include_usage), else the sum of the chunk counts.

Latency attribution (see RequestResult): TTFT is the arrival of the first chunk that carries a
token. A later chunk carrying k tokens that arrives g seconds after the previous token-carrying
chunk contributes k inter-token latencies of g / k each; the extra tokens of the first chunk have
no measurable gap and contribute none.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from bench.workload import BenchRequest


@dataclass
class RequestResult:
    index: int
    prompt_len: int
    start_s: float = 0.0  # when the request was sent, seconds after the run started
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    # (seconds after the request was sent, tokens in that chunk), token-carrying chunks only
    chunks: list[tuple[float, int]] = field(default_factory=list)
    e2el_s: float = 0.0  # until the stream ended
    turn: int = 0  # a multi-turn run's turn (0: the first, or a single-turn run)
    conversation: int | None = None  # a multi-turn run's conversation
    output_ids: list[int] | None = None  # the generated token ids, when asked for (keep_ids)

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for single-token outputs."""
        if not self.chunks or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.chunks[0][0]) / (self.output_tokens - 1)

    def chunk_gaps_s(self) -> list[float]:
        """Time between consecutive token-carrying chunks: the stalls a reader of the stream sees."""
        return [t - prev_t for (prev_t, _), (t, _) in zip(self.chunks, self.chunks[1:])]

    def itls_s(self) -> list[float]:
        out: list[float] = []
        for (prev_t, _), (t, k) in zip(self.chunks, self.chunks[1:]):
            out.extend([(t - prev_t) / k] * k)
        return out


@dataclass(frozen=True)
class CompletionTarget:
    """Where and how to send the requests."""

    url: str  # the full endpoint, e.g. http://127.0.0.1:8000/v1/completions
    model: str
    ignore_eos: bool = False
    api_key: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    extra_body: dict | None = None  # more request fields (serve bench --extra-body)

    # the fields payload() sets, which extra_body may not
    OWN_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "stream", "stream_options",
                  "return_token_ids", "ignore_eos")

    def payload(self, request: BenchRequest, max_tokens: int | None = None) -> dict:
        body = {
            "model": self.model,
            "prompt": request.prompt,
            "max_tokens": max_tokens if max_tokens is not None else request.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            # extension (pagedserve, vLLM): each chunk lists its token ids, so merged chunks count right;
            # servers that don't know the field ignore it
            "return_token_ids": True,
        }
        if self.top_p != 1.0:
            body["top_p"] = self.top_p
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.extra_body:
            body.update(self.extra_body)
        return body

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class _ChunkCounter:
    """Counts the tokens in each chunk; remembers the cumulative usage to take differences."""

    usage_tokens: int = 0

    def count(self, chunk: dict) -> int:
        choices = chunk.get("choices") or []
        usage = chunk.get("usage") or {}
        if not choices:
            return 0
        choice = choices[0]
        if isinstance(choice.get("token_ids"), list):
            return len(choice["token_ids"])
        if isinstance(usage.get("completion_tokens"), int):
            new = usage["completion_tokens"] - self.usage_tokens
            self.usage_tokens = usage["completion_tokens"]
            return max(0, new)
        logprobs = choice.get("logprobs") or {}
        if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
            return len(logprobs["tokens"])
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        return 1 if text else 0


async def stream_completion(session: aiohttp.ClientSession, target: CompletionTarget, request: BenchRequest,
                            run_start: float, max_tokens: int | None = None, keep_ids: bool = False) -> RequestResult:
    """Send one request and time its stream. Never raises for a server or network failure: the
    result says success=False and why. keep_ids: collect the output's token ids (result.output_ids)
    from the chunks' token_ids (a multi-turn run sends them back as the next turn's history)."""
    result = RequestResult(index=request.index, prompt_len=request.num_prompt_tokens)
    ids: list[int] | None = [] if keep_ids else None
    counter = _ChunkCounter()
    counted = 0
    usage_output: int | None = None
    sent = time.perf_counter()
    result.start_s = sent - run_start
    try:
        async with session.post(target.url, json=target.payload(request, max_tokens), headers=target.headers()) as resp:
            if resp.status != 200:
                body = (await resp.text())[:200].replace("\n", " ")
                result.error = f"HTTP {resp.status}: {body}"
                return result
            # whatever the socket has, split into lines here: iterating aiohttp's lines costs the
            # client ~2x more per event, and at ~50k events/s (64 streams of a small model) the
            # load generator must not be what is measured
            pending = b""
            done = False
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                if b"\r" in data:
                    data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        err = chunk["error"]
                        result.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                        return result
                    k = counter.count(chunk)
                    if ids is not None and chunk.get("choices"):
                        ids.extend(chunk["choices"][0].get("token_ids") or ())
                    if k:
                        result.chunks.append((now - sent, k))
                        counted += k
                    usage = chunk.get("usage") or {}
                    if isinstance(usage.get("completion_tokens"), int):
                        usage_output = usage["completion_tokens"]
                        if isinstance(usage.get("prompt_tokens"), int):
                            result.prompt_len = usage["prompt_tokens"]
                if done:
                    break
        result.e2el_s = time.perf_counter() - sent
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: bad JSON or UTF-8
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.output_tokens = usage_output if usage_output is not None else counted
    result.output_ids = ids
    if not result.chunks:
        result.error = "the stream carried no tokens"
        return result
    result.success = True
    return result


async def list_models(session: aiohttp.ClientSession, base_url: str, api_key: str | None = None) -> list[str]:
    """The model ids of GET /v1/models; empty when the server doesn't say."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
            if resp.status != 200:
                return []
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return []
    return [m["id"] for m in body.get("data", []) if isinstance(m, dict) and "id" in m]
