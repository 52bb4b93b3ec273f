"""A fake OpenAI-compatible streaming server with known timing, for the load generator's tests.

Each completion streams its tokens in chunks of `tokens_per_chunk` (cycled) after `ttft_s`, one
chunk every `chunk_interval_s`, each chunk naming its token ids; the last chunk carries usage.
It records the request bodies and the most streams open at once. Request number n (0 = the first
one the server sees) fails with HTTP 500 when fail_every > 0 and n % fail_every == 0 and n > 0.

Run as a script it stands in for `serve run`:
  python tests/bench/fake_server.py --model DIR --host H --port P [--served-model-name N] [...]
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeBehaviour:
    ttft_s: float = 0.05
    chunk_interval_s: float = 0.02
    tokens_per_chunk: tuple[int, ...] = (1,)
    fail_every: int = 0
    model_name: str = "fake-model"
    serial_first_tokens: bool = False  # one request's ttft_s at a time: later arrivals queue, like a saturated server
    seen: list[dict] = field(default_factory=list)  # request bodies, with their arrival time "t"
    streaming: int = 0  # streams open now
    max_streaming: int = 0  # the most streams open at once


def create_app(b: FakeBehaviour) -> FastAPI:
    app = FastAPI()
    counter = itertools.count()
    first_tokens = asyncio.Lock()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": b.model_name, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        n = next(counter)
        b.seen.append({**body, "t": time.perf_counter(), "n": n})
        if body.get("model") != b.model_name:
            return JSONResponse({"error": {"message": f"no model {body.get('model')!r}"}}, status_code=404)
        if b.fail_every and n > 0 and n % b.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        b.streaming += 1  # the app runs on one event loop: no lock needed
        b.max_streaming = max(b.max_streaming, b.streaming)
        return StreamingResponse(_counted(b, _stream(b, body, first_tokens)), media_type="text/event-stream")

    return app


async def _counted(b: FakeBehaviour, events):
    try:
        async for event in events:
            yield event
    finally:
        b.streaming -= 1


async def _stream(b: FakeBehaviour, body: dict, first_tokens: asyncio.Lock):
    max_tokens = int(body["max_tokens"])
    prompt_tokens = len(body["prompt"])
    sizes = itertools.cycle(b.tokens_per_chunk)
    sent = 0
    if b.serial_first_tokens:
        async with first_tokens:
            await asyncio.sleep(b.ttft_s)
    else:
        await asyncio.sleep(b.ttft_s)
    while sent < max_tokens:
        k = min(next(sizes), max_tokens - sent)
        ids = list(range(sent, sent + k))
        sent += k
        choice = {"index": 0, "text": "x" * k, "token_ids": ids, "logprobs": None,
                  "finish_reason": "length" if sent == max_tokens else None}
        yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"
        if sent < max_tokens:
            await asyncio.sleep(b.chunk_interval_s)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sent, "total_tokens": prompt_tokens + sent}
    yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


class ThreadedServer:
    """Serve the app on 127.0.0.1 from a background thread (a free port is picked)."""

    def __init__(self, behaviour: FakeBehaviour) -> None:
        self.behaviour = behaviour
        config = uvicorn.Config(create_app(behaviour), host="127.0.0.1", port=0, log_level="error")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def base_url(self) -> str:
        sock = self._server.servers[0].sockets[0]
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def __enter__(self) -> "ThreadedServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--load-format")
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--exit-at-once", action="store_true", help="exit with code 3 instead of serving")
    args = p.parse_args()
    if args.exit_at_once:
        print("fake server: refusing to start")
        raise SystemExit(3)
    behaviour = FakeBehaviour(ttft_s=args.ttft, model_name=args.served_model_name or args.model)
    uvicorn.run(create_app(behaviour), host=args.host, port=args.port, log_level="error")


if __name__ == "__main__":
    main()
