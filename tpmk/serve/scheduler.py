"""Continuous batching on the driver: requests join and leave the batch between steps.

One engine thread owns the EngineClient (its calls block) and loops:

  1. drop cancelled requests, giving their KV pages back;
  2. admit waiting requests, oldest first, while the batch has room (max_batch)
     and the free KV pages cover prompt + max_tokens (admission control: a
     request whose pages are not free yet waits; nothing is ever preempted);
  3. one Prefill for the newly admitted requests (their first token);
  4. one Decode step for every running request.

The HTTP side (asyncio, another thread) calls `submit` and `cancel`; results go
back through each request's `sink`, called on the engine thread. A WorkerError
(a rank died, a kernel timed out) is fatal: every request in flight or waiting
gets an error event, the scheduler turns unhealthy, and `on_fatal` fires.
"""
from __future__ import annotations

import collections
import math
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from tpmk.config import RuntimeConfig
from tpmk.engine.api import Decode, EngineClient, Prefill, SamplingParams, WorkerError

TOKENS_PER_S_WINDOW_S = 10.0


class QueueFullError(RuntimeError):
    """More requests waiting than --max-queue allows (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine failed earlier; the server takes no new requests (HTTP 503)."""


@dataclass
class Event:
    """New output of one request, handed to its sink on the engine thread."""
    text: str                       # text since the previous event (stop strings cut)
    token_ids: list[int]            # tokens since the previous event
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str | None = None


@dataclass(eq=False)  # identity: two requests with equal fields are still two requests
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    sink: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    id: str = ""
    # Engine-thread state.
    output_ids: list[int] = field(default_factory=list)
    text: str = ""                  # text already handed out
    decoded: str = ""               # detokenized output that later tokens cannot change
    prefix_offset: int = 0          # incremental detokenization windows (output_ids indices)
    read_offset: int = 0
    finish_reason: str | None = None
    pages: list[int] = field(default_factory=list)
    cancelled: bool = False
    arrival: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the request may write: its pages cover them all up front."""
        return len(self.prompt_ids) + self.max_tokens


@dataclass
class Stats:
    """Counters the engine thread updates and /metrics reads (plain ints under the GIL)."""
    requests_total: int = 0
    finished: collections.Counter = field(default_factory=collections.Counter)  # by reason
    rejected_total: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    prefill_steps: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    decode_sequences_total: int = 0  # summed batch sizes: / decode_steps = mean batch
    last_step_seconds: float = 0.0
    last_batch_size: int = 0
    recent_tokens: collections.deque = field(default_factory=collections.deque)  # (t, n)

    def tokens_per_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        recent = [(t, n) for t, n in list(self.recent_tokens) if now - t <= TOKENS_PER_S_WINDOW_S]
        return sum(n for _, n in recent) / TOKENS_PER_S_WINDOW_S


class Scheduler:
    def __init__(self, client: EngineClient, runtime: RuntimeConfig,
                 detokenize: Callable[[list[int]], str], eos_token_ids: tuple[int, ...] = (),
                 max_queue: int = 64, on_fatal: Callable[[BaseException], None] | None = None):
        from tpmk.engine.kv_cache import PageAllocator
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue} must be >= 0")
        self.client, self.runtime = client, runtime
        self.detokenize, self.eos = detokenize, frozenset(eos_token_ids)
        self.max_queue, self.on_fatal = max_queue, on_fatal
        self.allocator = PageAllocator(runtime.num_pages, runtime.page_size)
        self.pages_in_use = 0
        self.stats = Stats()
        self.error: str | None = None        # set once, when the engine fails
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._admitted: list[Request] = []   # the batch in prefill (off both lists meanwhile)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="tpmk-engine", daemon=True)

    # ---- called from the HTTP side ------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.error is None and not self._stopping

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def engine_busy(self) -> bool:
        """The engine thread is still alive (e.g. inside a step after stop() gave up)."""
        return self._thread.is_alive()

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.runtime.page_size)

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Request) -> None:
        """Queue `req`; raises QueueFullError past max_queue waiting requests (429)."""
        if self.pages_for(req.num_tokens) > self.runtime.num_pages:
            raise ValueError(f"the request needs {self.pages_for(req.num_tokens)} KV pages "
                             f"({req.num_tokens} tokens) but the cache has "
                             f"{self.runtime.num_pages}; lower max_tokens or raise --num-pages")
        with self._cv:
            if self.error is not None:
                raise EngineDeadError(f"the engine failed: {self.error}")
            if self._stopping:
                raise EngineDeadError("the server is shutting down")
            # Requests that can start at the next step (free batch slots) do not count
            # as queued: only those beyond them.
            free_slots = max(0, self.runtime.max_batch - len(self._running))
            if len(self._waiting) >= self.max_queue + free_slots:
                self.stats.rejected_total += 1
                raise QueueFullError(
                    f"{len(self._waiting)} requests are waiting and --max-queue is "
                    f"{self.max_queue}; retry later")
            self.stats.requests_total += 1
            self._waiting.append(req)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        """The client went away: drop it now if waiting, at the next step if running."""
        with self._cv:
            req.cancelled = True
            if req in self._waiting:
                self._waiting.remove(req)
                self.stats.finished["cancelled"] += 1
                req.finish_reason = "cancelled"
            self._cv.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Fail what is left with 'server shutting down' and end the engine thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- engine thread ------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._waiting or self._running):
                        self._cv.wait()
                    if self._stopping:
                        break
                    self._reap_cancelled()
                    new = self._admit()
                if new:
                    self._prefill(new)
                if self._running:
                    self._decode()
        except BaseException as e:  # noqa: BLE001 - any failure leaves ranks in an unknown state
            self._fail_all(e)
            return
        self._fail_all(None)

    def _reap_cancelled(self) -> None:
        for req in [r for r in self._running if r.cancelled]:
            self._finish(req, "cancelled", emit=False)

    def _admit(self) -> list[Request]:
        """FIFO: the oldest waiting request blocks younger ones, so none starves."""
        new: list[Request] = []
        while self._waiting and len(self._running) + len(new) < self.runtime.max_batch:
            req = self._waiting[0]
            need = self.pages_for(req.num_tokens)
            if self.pages_in_use + need > self.runtime.num_pages:
                break
            self._waiting.popleft()
            req.pages = self.allocator.allocate(req.num_tokens)
            self.pages_in_use += need
            new.append(req)
        return new

    def _prefill(self, new: list[Request]) -> None:
        t0 = time.perf_counter()
        self._admitted = new   # neither waiting nor running: _fail_all must still answer them
        res = self.client.execute(Prefill(tokens=[r.prompt_ids for r in new],
                                          pages=[r.pages for r in new],
                                          sampling=[r.sampling for r in new]))
        self._admitted = []
        dt = time.perf_counter() - t0
        s = self.stats
        s.prefill_steps += 1
        s.prefill_seconds += dt
        s.last_step_seconds = dt
        s.prompt_tokens_total += sum(len(r.prompt_ids) for r in new)
        self._running.extend(new)
        self._append_tokens(new, res.tokens)

    def _decode(self) -> None:
        batch = list(self._running)
        t0 = time.perf_counter()
        res = self.client.execute(Decode(
            tokens=[r.output_ids[-1] for r in batch],
            positions=[len(r.prompt_ids) + len(r.output_ids) - 1 for r in batch],
            pages=[r.pages for r in batch],
            sampling=[r.sampling for r in batch]))
        dt = time.perf_counter() - t0
        s = self.stats
        s.decode_steps += 1
        s.decode_seconds += dt
        s.last_step_seconds = dt
        s.last_batch_size = len(batch)
        s.decode_sequences_total += len(batch)
        self._append_tokens(batch, res.tokens)

    def _append_tokens(self, batch: list[Request], tokens: list[int]) -> None:
        if len(tokens) != len(batch):
            raise RuntimeError(f"the engine returned {len(tokens)} tokens for a batch of "
                               f"{len(batch)} sequences")
        now = time.monotonic()
        self.stats.generated_tokens_total += len(tokens)
        self.stats.recent_tokens.append((now, len(tokens)))
        while self.stats.recent_tokens and now - self.stats.recent_tokens[0][0] > TOKENS_PER_S_WINDOW_S:
            self.stats.recent_tokens.popleft()
        for req, tok in zip(batch, tokens):
            if req.cancelled:  # cancelled during the step: its output is dropped
                self._finish(req, "cancelled", emit=False)
                continue
            req.output_ids.append(int(tok))
            reason = None
            if int(tok) in self.eos and not req.ignore_eos:
                reason = "stop"
            elif len(req.output_ids) >= req.max_tokens:
                reason = "length"
            delta, hit_stop = self._new_text(req, final=reason is not None)
            if hit_stop:
                reason = "stop"
            event = Event(text=delta, token_ids=[int(tok)], finish_reason=reason)
            if reason is None:
                req.sink(event)
            else:
                self._finish(req, reason, event)

    def _new_text(self, req: Request, final: bool) -> tuple[str, bool]:
        """Text to hand out now, and whether a stop string ended the request.

        Detokenization is incremental (two short windows per token, not the whole
        output): `decoded` grows only by text that no later token can change, i.e.
        not ending in an incomplete UTF-8 character (U+FFFD). With stop strings the
        last len(longest stop) - 1 decoded characters are held back too, since they
        may begin a stop string; the stop string itself is never handed out (OpenAI)."""
        ids = req.output_ids
        prefix = self.detokenize(ids[req.prefix_offset:req.read_offset])
        window = self.detokenize(ids[req.prefix_offset:])
        if len(window) > len(prefix) and (final or not window.endswith("\ufffd")):
            req.decoded += window[len(prefix):]
            req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        full = req.decoded
        if req.stop:
            starts = [i for i in (full.find(s, max(0, len(req.text) - len(s) + 1))
                                  for s in req.stop) if i >= 0]
            if starts:
                delta = full[len(req.text):max(min(starts), len(req.text))]
                req.text += delta
                return delta, True
        end = len(full)
        if req.stop and not final:
            end -= max(len(s) for s in req.stop) - 1
        delta = full[len(req.text):max(end, len(req.text))]
        req.text += delta
        return delta, False

    def _finish(self, req: Request, reason: str, event: Event | None = None,
                emit: bool = True) -> None:
        if req in self._running:
            self._running.remove(req)
        if req.pages:
            self.allocator.free(req.pages)
            self.pages_in_use -= self.pages_for(req.num_tokens)
            req.pages = []
        req.finish_reason = reason
        self.stats.finished[reason] += 1
        if emit:
            req.sink(event or Event(text="", token_ids=[], finish_reason=reason))

    def _fail_all(self, exc: BaseException | None) -> None:
        """Error every request left; on an engine failure, turn unhealthy and tell the app."""
        if exc is not None:
            msg = (str(exc).splitlines() or [type(exc).__name__])[0]
            if not isinstance(exc, WorkerError):
                msg = f"{type(exc).__name__}: {msg}"
                traceback.print_exception(exc)
            self.error = msg
        else:
            msg = "the server is shutting down"
        with self._cv:
            left = list(self._admitted) + list(self._running) + list(self._waiting)
            self._admitted = []
            self._running.clear()
            self._waiting.clear()
        for req in left:
            if req.pages:
                self.allocator.free(req.pages)
                self.pages_in_use -= self.pages_for(req.num_tokens)
                req.pages = []
            req.finish_reason = "error"
            self.stats.finished["error"] += 1
            try:
                req.sink(Event(text="", token_ids=[], finish_reason="error", error=msg))
            except Exception:  # noqa: BLE001 - a broken sink must not hide the others
                traceback.print_exc()
        if exc is not None and self.on_fatal is not None:
            self.on_fatal(exc)
