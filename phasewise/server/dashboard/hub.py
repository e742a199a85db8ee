"""Fans the feed out to the pages that watch it: ``Hub``, and, for the router, ``WorkerRelay``.

One broadcaster task builds a frame from the feed every ``interval_s`` (0.2 s: five updates a
second) while at least one page is connected, encodes it once, and offers it to every page.
Each page has its own bounded queue: a page that cannot keep up is dropped (its stream ends
with a ``reset`` event and the browser reconnects with a fresh ``hello``), so a slow viewer
never holds up the engine, the other pages or the event loop, and gives its slot back (at
most ``MAX_PAGES``, and half of them from one address).

Behind a router, each worker's own ``/dashboard/events`` is relayed (while a page watches),
tagged with the worker's URL and role, so one page shows every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from phasewise.server.dashboard.feed import Cursor, DashboardFeed

log = logging.getLogger("phasewise.dashboard")

MAX_PAGES = 32
MAX_PAGES_PER_CLIENT = 16  # so one address cannot take every slot
PAGE_QUEUE = 64  # frames a page may fall behind by before it is dropped


def encode(event: str | None, payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


class Page:
    """One connected page's queue (None ends its stream)."""

    def __init__(self, client: str = "-") -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=PAGE_QUEUE)
        self.dropped = False
        self.client = client

    def offer(self, text: str) -> None:
        if self.dropped:
            return
        try:
            self.queue.put_nowait(text)
        except asyncio.QueueFull:  # too slow: empty it, tell it, end its stream
            self.dropped = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(encode("reset", {"reason": "this page fell behind"}))
            self.queue.put_nowait(None)

    def end(self) -> None:
        """End its stream now (what it has not read yet is dropped: it reconnects)."""
        self.dropped = True
        while not self.queue.empty():
            self.queue.get_nowait()
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(None)


class Hub:
    """The pages of one server and the broadcaster that feeds them."""

    def __init__(self, feed: DashboardFeed, *, interval_s: float = 0.2,
                 max_pages: int = MAX_PAGES,
                 max_pages_per_client: int = MAX_PAGES_PER_CLIENT) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.feed = feed
        self.interval_s = interval_s
        self.max_pages = max_pages
        self.max_pages_per_client = max_pages_per_client
        self.pages: set[Page] = set()  # those frames are offered to
        self.open: set[Page] = set()  # every page whose stream is open (the limit's count)
        self.relays: list[WorkerRelay] = []
        self.closed = False
        self._task: asyncio.Task | None = None

    @property
    def full(self) -> bool:
        return len(self.open) >= self.max_pages

    def pages_of(self, client: str) -> int:
        return sum(1 for p in self.open if p.client == client)

    def join(self, client: str = "-") -> tuple[Page, str]:
        """A new page and its first events (on the loop): the hello, and each relayed
        worker's latest hello."""
        cursor = Cursor()
        first = encode("hello", self.hello(cursor))
        for relay in self.relays:
            first += relay.hello_text or encode("worker", relay.status_payload())
        page = Page(client)
        self.pages.add(page)
        self.open.add(page)
        if self._task is None or self._task.done():  # frames go on from that hello
            self._task = asyncio.get_running_loop().create_task(self._broadcast(cursor))
        for relay in self.relays:
            relay.start()
        return page, first

    def status(self) -> dict[str, Any]:
        return {"closed": self.closed, "pages": len(self.open), "max_pages": self.max_pages,
                "workers": [relay.status_payload() for relay in self.relays]}

    def hello(self, cursor: Cursor | None = None) -> dict[str, Any]:
        h = self.feed.hello(cursor=cursor)
        h["interval_s"] = self.interval_s
        h["workers"] = [{"url": r.url, "role": r.role} for r in self.relays]
        return h

    def leave(self, page: Page) -> None:
        self.pages.discard(page)
        self.open.discard(page)
        if not self.open:
            for relay in self.relays:
                relay.stop()

    def offer(self, text: str) -> None:
        for page in list(self.pages):
            page.offer(text)
            if page.dropped:  # its slot is free now; its stream ends when it reads on, or
                self.pages.discard(page)  # when a write to it times out (PageStream)
                self.open.discard(page)

    def close(self) -> None:
        """End every page's stream (the server is draining): nothing holds shutdown up."""
        self.closed = True
        for page in list(self.open):
            page.end()
        self.pages.clear()
        for relay in self.relays:
            relay.stop()

    async def _broadcast(self, cursor: Cursor) -> None:
        f = self.feed
        try:
            while self.pages:
                frame = f.frame(cursor)
                frame["pages"] = len(self.pages)
                self.offer(encode(None, frame))
                await asyncio.sleep(self.interval_s)
        except Exception:  # noqa: BLE001 - a dashboard bug must not take anything else down
            log.exception("dashboard broadcaster failed")
            for page in list(self.pages):
                page.end()

    async def stream(self, page: Page, first: str) -> AsyncIterator[str]:
        try:
            yield "retry: 1000\n\n" + first
            while True:
                item = await page.queue.get()
                if item is None:
                    return
                yield item
        finally:
            self.leave(page)


class WorkerRelay:
    """Relays one worker's ``/dashboard/events`` into a router's hub while pages watch."""

    def __init__(self, hub: Hub, url: str, role: str, headers: dict[str, str],
                 retry_s: float = 1.0) -> None:
        self.hub = hub
        self.url = url
        self.role = role
        self.headers = headers
        self.retry_s = retry_s
        self.hello_text: str | None = None
        self.state = "not connected"
        self._task: asyncio.Task | None = None

    def status_payload(self) -> dict[str, Any]:
        return {"src": self.url, "role": self.role, "state": self.state}

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.hello_text, self.state = None, "not connected"  # nothing stale for the next

    def _wrap(self, data: str) -> str:
        # The worker's frame is passed on as it came (no parse, no re-encode).
        return encode("worker", f'{{"src":{json.dumps(self.url)},"role":'
                                f'{json.dumps(self.role)},"state":"up","frame":{data}}}')

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.hello_text = None
            self.hub.offer(encode("worker", self.status_payload()))

    async def _run(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=10.0)) as client:
            while True:
                try:
                    async with client.stream("GET", self.url + "/dashboard/events",
                                             headers=self.headers) as r:
                        if r.status_code != 200:
                            self._set_state(f"its /dashboard/events answered {r.status_code}")
                        else:
                            await self._pump(r)
                            self._set_state("its stream ended")
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - shown on the page, retried
                    self._set_state(f"unreachable: {type(e).__name__}")
                await asyncio.sleep(self.retry_s)

    async def _pump(self, r: Any) -> None:
        event = None
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                text = self._wrap(line[5:].strip())
                if event == "hello":
                    self.state = "up"
                    self.hello_text = text
                if event in (None, "hello"):
                    self.hub.offer(text)
                event = None
            elif not line:
                event = None


def relays_for(hub: Hub, workers: Sequence[Any], headers: dict[str, str]) -> None:
    """Give a router's hub one relay per worker (``Worker`` objects: ``url``, ``role``)."""
    hub.relays = [WorkerRelay(hub, w.url, w.role, headers) for w in workers]
