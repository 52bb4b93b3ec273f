"""A uvicorn.Server that drains the engine on SIGTERM/SIGINT and then exits 0."""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    """The first signal starts on_exit() (the engine's drain) beside uvicorn's own graceful
    shutdown. Unlike uvicorn.Server, the signal is not re-raised once the server has stopped:
    that would turn a clean drain into death by SIGTERM (exit status 143)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], Awaitable[Any]]) -> None:
        super().__init__(config)
        self.on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._interrupted = False  # a SIGINT has come

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit and self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.on_exit()))
        if sig == signal.SIGINT and not self._interrupted:
            # The first Ctrl-C drains even after a SIGTERM: one Ctrl-C reaches every API process
            # while the server process sends them SIGTERM, in either order, and uvicorn would take a
            # SIGINT after it for a second Ctrl-C and skip the app's shutdown. A second one forces.
            self._interrupted = True
            self.should_exit = True
            return
        super().handle_exit(sig, frame)
