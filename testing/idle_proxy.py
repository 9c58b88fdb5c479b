"""A TCP proxy that cuts idle connections, as load balancers and reverse proxies do (nginx's
`proxy_read_timeout`, a cloud load balancer's idle timeout): a connection through which no byte has passed
in either direction for `idle_s` seconds is closed on both sides.

A test tool: it stands between a client and the frontend so a test can show that a request waiting
longer than the idle timeout for its first token survives (the frontend's SSE keep-alive comments count
as traffic) or, without keep-alive, is cut.

    with IdleProxy("127.0.0.1", 8000, idle_s=2.0) as proxy:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", ...)
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Link:
    last_traffic: float = field(default_factory=time.monotonic)
    cut: bool = False


class IdleProxy:
    """Forwards 127.0.0.1:`port` to `target_host:target_port` on a thread of its own (changes nothing
    else); `cuts` counts connections closed for idleness."""

    def __init__(self, target_host: str, target_port: int, idle_s: float) -> None:
        self.target = (target_host, target_port)
        self.idle_s = idle_s
        self.cuts = 0
        self.connections = 0
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port: int = sock.getsockname()[1]
        self._sock = sock
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="idle-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> IdleProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self._sock)

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        link = _Link()
        pumps = [asyncio.ensure_future(self._pump(client_r, up_w, link)),
                 asyncio.ensure_future(self._pump(up_r, client_w, link))]
        watch = asyncio.ensure_future(self._watch(link))
        try:
            await asyncio.wait([*pumps, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (*pumps, watch):
                task.cancel()
            for w in (client_w, up_w):
                w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, link: _Link) -> None:
        while data := await src.read(65536):
            link.last_traffic = time.monotonic()
            dst.write(data)
            await dst.drain()

    async def _watch(self, link: _Link) -> None:
        while True:
            idle = time.monotonic() - link.last_traffic
            if idle >= self.idle_s:
                link.cut = True
                self.cuts += 1
                return
            await asyncio.sleep(self.idle_s - idle)  # until the link would have idled out
