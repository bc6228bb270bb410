"""A small asyncio TCP proxy on 127.0.0.1 for fault tests: it adds a delay to
every chunk in both directions, can cut all connections, and can freeze them
(stop forwarding either way while keeping the sockets open: a peer that has
vanished without closing its connection)."""

from __future__ import annotations

import asyncio
import contextlib


class DelayProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream``; ``delay_s`` is added to each chunk."""

    def __init__(self, upstream_host: str, upstream_port: int, delay_s: float = 0.0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = delay_s
        self.port = 0
        self.chunks_forwarded = 0
        self.connections = 0  # accepted so far
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._thawed = asyncio.Event()
        self._thawed.set()

    async def start(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                await self._thawed.wait()
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(chunk)
                await writer.drain()
                self.chunks_forwarded += 1
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        for task in (
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def freeze(self) -> None:
        """Stop forwarding in both directions; the connections stay open and nothing is read any more."""
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    def cut(self) -> None:
        """Close every open connection (new ones are still accepted)."""
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.close()
        self._writers.clear()

    async def stop(self) -> None:
        self.thaw()
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
