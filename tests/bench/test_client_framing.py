"""The load generator splits the stream into lines itself: events cut across reads, several events
in one read, CRLF line endings and comment lines all count the same tokens."""
import asyncio
import json

import aiohttp

from bench.client import CompletionTarget, stream_completion
from bench.workload import BenchRequest


def _event(ids: list[int], usage: dict | None = None, eol: str = "\n") -> bytes:
    body = {"choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids}] if ids else [], "usage": usage}
    return f"data: {json.dumps(body)}{eol}{eol}".encode()


async def _serve(writes: list[bytes]) -> tuple[asyncio.AbstractServer, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # headers; the JSON body is not needed
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        for w in writes:
            writer.write(w)
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_events_split_and_merged_across_reads():
    first, second = _event([1]), _event([2, 3], eol="\r\n")
    writes = [first[:10], first[10:] + second + b": a comment\n\n", _event([4])[:-1],
              b"\n" + _event([], {"completion_tokens": 4, "prompt_tokens": 3}) + b"data: [DONE]\n\n"]

    async def go():
        server, port = await _serve(writes)
        async with server, aiohttp.ClientSession() as session:
            target = CompletionTarget(f"http://127.0.0.1:{port}/v1/completions", "m")
            return await stream_completion(session, target, BenchRequest(0, [1, 2, 3], 4), 0.0)

    r = asyncio.run(go())
    assert r.success, r.error
    assert [k for _, k in r.chunks] == [1, 2, 1] and r.output_tokens == 4 and r.prompt_len == 3
    assert r.chunks[0][0] == r.chunks[1][0] < r.chunks[2][0]  # the first event ends in the second read
