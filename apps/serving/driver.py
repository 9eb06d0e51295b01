"""The one task that drives a ServingEngine for an asyncio server, and its metrics.

The engine is not thread-safe, and a step is tens of milliseconds of tensor work that must
not stall the event loop. So one coroutine owns it: between steps it applies what the
handlers asked (submissions, each answered through a future; cancellations), then runs
``engine.step()`` on a worker thread and hands every event to the queue of the request it
belongs to. The engine is never touched while a step runs, and handlers never touch it.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from apps.serving.engine import ServingEngine
from apps.serving.requests import CANCELLED, Refused, Request, TokenEvent

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """The Prometheus series of one server, in its own registry (no process globals)."""

    def __init__(self, kv_blocks: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.waiting = Gauge("meshtron_queue_depth", "Requests waiting for a slot", registry=r)
        self.running = Gauge("meshtron_running_sequences", "Sequences in the batch", registry=r)
        self.generated = Counter(
            "meshtron_generated_tokens", "Tokens generated (rate(): tokens/s)", registry=r
        )
        self.prompt = Counter("meshtron_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.ttft = Histogram(
            "meshtron_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.blocks_used = Gauge("meshtron_kv_blocks_in_use", "KV blocks held", registry=r)
        Gauge("meshtron_kv_blocks", "KV blocks in the pool", registry=r).set(kv_blocks)
        self.refused = Counter(
            "meshtron_requests_refused", "Requests refused, by reason", ["reason"], registry=r
        )
        self.finished = Counter(
            "meshtron_requests_finished", "Requests ended, by reason", ["reason"], registry=r
        )


class EngineLoop:
    """Runs ``engine`` for many concurrent handlers: :meth:`submit`, :meth:`cancel`, and
    :meth:`run` as the server's one background task."""

    def __init__(self, engine: ServingEngine, metrics: ServerMetrics) -> None:
        self.engine, self.metrics = engine, metrics
        self._submissions: list[tuple[list[Request], float, asyncio.Future]] = []
        self._cancels: list[str] = []
        self._queues: dict[str, asyncio.Queue] = {}  # request id → its submission's queue
        self._arrival: dict[str, float] = {}  # until the first token: for time to first token
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self.failure: BaseException | None = None  # set when a step raised: /health says so

    async def submit(self, requests: list[Request]) -> tuple[list[str], asyncio.Queue]:
        """Queue ``requests`` together (all or none): their ids, and the one queue their
        TokenEvents arrive on (or the exception that stopped the engine). Raises
        :class:`Refused` as the engine does."""
        if self.failure is not None:
            raise Refused("unavailable", f"the engine stopped: {self.failure}")
        future = asyncio.get_running_loop().create_future()
        self._submissions.append((requests, time.perf_counter(), future))
        self._wake.set()
        return await future

    def cancel(self, request_id: str) -> None:
        """End ``request_id`` before the next step (its blocks go back to the pool); its
        queue gets no more events."""
        self._queues.pop(request_id, None)
        self._cancels.append(request_id)
        self._wake.set()

    def _take_requests(self) -> None:
        """Apply the submissions and cancellations that came in since the last step."""
        for rid in self._cancels:
            self.engine.cancel(rid)  # False: it had already ended
            self._arrival.pop(rid, None)
        self._cancels.clear()
        for requests, arrival, future in self._submissions:
            accepted = []
            try:
                for request in requests:
                    accepted.append(self.engine.submit(request))
            except Refused as refused:
                for rid in accepted:
                    self.engine.cancel(rid)
                self.metrics.refused.labels(refused.code).inc()
                if not future.cancelled():
                    future.set_exception(refused)
                continue
            queue = asyncio.Queue()
            for rid in accepted:
                self._queues[rid], self._arrival[rid] = queue, arrival
            self.metrics.prompt.inc(sum(len(r.prompt) for r in requests))
            if future.cancelled():  # the handler is gone already
                for rid in accepted:
                    self.cancel(rid)
            else:
                future.set_result((accepted, queue))
        self._submissions.clear()

    def _deliver(self, events: list[TokenEvent]) -> None:
        now = time.perf_counter()
        for event in events:
            rid = event.request_id
            if event.token is not None:
                self.metrics.generated.inc()
                if rid in self._arrival:
                    self.metrics.ttft.observe(now - self._arrival.pop(rid))
            if event.finish_reason is not None:
                self._arrival.pop(rid, None)
                if event.finish_reason != CANCELLED:
                    self.metrics.finished.labels(event.finish_reason).inc()
                queue = self._queues.pop(rid, None)
            else:
                queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(event)
        engine, m = self.engine, self.metrics
        m.waiting.set(len(engine.waiting))
        m.running.set(len(engine.running))
        m.blocks_used.set(engine.cache.used_blocks)

    async def run(self) -> None:
        """Step while there is work, sleep while there is none; forever (cancel to stop)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._take_requests()
                if not self.engine.has_work:
                    self._deliver([])
                    self._wake.clear()
                    if not (self._submissions or self._cancels):
                        await self._wake.wait()
                    continue
                events = await loop.run_in_executor(self._executor, self.engine.step)
                self._deliver(events)
        except Exception as err:  # a bug in a step: fail every request, say so in /health
            self.failure = err
            for queue in set(self._queues.values()):
                queue.put_nowait(err)
            raise
        finally:
            self._executor.shutdown(wait=True, cancel_futures=True)
