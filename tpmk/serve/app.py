"""`tpmk serve`: an OpenAI-compatible HTTP server on the driver.

Two threads: the asyncio loop (HTTP, request checking, tokenization, SSE) and
the scheduler's engine thread (blocking EngineClient calls). Requests cross
with `Scheduler.submit` / `cancel`; tokens come back as events posted onto
the loop with call_soon_threadsafe.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with
"stream": true), GET /v1/models, GET /health (503 once the engine failed),
GET /metrics (Prometheus text). With --api-key, /v1/* needs
"Authorization: Bearer KEY" (401 otherwise); /health and /metrics stay open
for probes. When a worker dies or a kernel times out, requests in flight get
an error, /health turns 503 and the process exits with status 1.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from tpmk.serve.http import (HttpError, HttpRequest, read_request, response, sse_event, sse_head,
                             wait_disconnect, MAX_HEADER_BYTES)
from tpmk.serve.protocol import (APIError, GenerationRequest, ModelInfo, chunk, full_response,
                                 new_id, parse_generation, usage_chunk)
from tpmk.serve.scheduler import EngineDeadError, Event, QueueFullError, Request, Scheduler

DRAIN_GRACE_S = 3.0   # after a fatal error or a signal: time for responses to go out
FATAL_LINGER_S = 1.0  # after a fatal error, /health answers 503 this long before the exit


class Server:
    def __init__(self, scheduler: Scheduler, model: ModelInfo, api_key: str | None = None):
        self.scheduler, self.model, self.api_key = scheduler, model, api_key
        self.created = int(time.time())
        self.active: set[asyncio.Task] = set()
        # Request parsing (JSON, tokenization) off the event loop, one at a time: a fast
        # tokenizer's encode is not safe from two threads at once ("Already borrowed").
        self.parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpmk-parse")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.active.add(task)
        try:
            try:
                req = await read_request(reader, writer)
            except HttpError as e:
                writer.write(response(e.status, APIError(e.status, str(e), code="bad_http").body()))
                return
            if req is not None:
                await self.route(req, reader, writer)
        except APIError as e:
            writer.write(response(e.status, e.body(), headers=_extra_headers(e)))
        except (ConnectionError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - a bug must cost this request only, with an answer
            traceback.print_exception(e)
            err = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error",
                           code="internal_error")
            writer.write(response(500, err.body()))
        finally:
            self.active.discard(task)
            try:
                await writer.drain()
                writer.close()
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    async def route(self, req: HttpRequest, reader, writer) -> None:
        routes = {"/health": ("GET", self.health), "/metrics": ("GET", self.metrics),
                  "/v1/models": ("GET", self.models),
                  "/v1/completions": ("POST", None), "/v1/chat/completions": ("POST", None)}
        if req.path not in routes:
            raise APIError(404, f"no route {req.method} {req.path}; see /v1/models, "
                                f"/v1/completions, /v1/chat/completions, /health, /metrics",
                           code="not_found")
        method, handler = routes[req.path]
        if req.path.startswith("/v1/"):
            self.authorize(req)
        if req.method != method:
            raise APIError(405, f"{req.path} takes {method}, not {req.method}",
                           code="method_not_allowed")
        if handler is not None:
            writer.write(handler())
            return
        await self.generate(req, reader, writer, chat=req.path == "/v1/chat/completions")

    def authorize(self, req: HttpRequest) -> None:
        if self.api_key is None:
            return
        scheme, _, token = req.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' "
                                "with the key given to --api-key", code="invalid_api_key")

    def health(self) -> bytes:
        if self.scheduler.healthy:
            return response(200, {"status": "ok"})
        return response(503, {"status": "unhealthy",
                              "error": self.scheduler.error or "shutting down"})

    def models(self) -> bytes:
        return response(200, {"object": "list", "data": [{
            "id": self.model.name, "object": "model", "created": self.created,
            "owned_by": "tpmk", "max_model_len": self.model.max_seq_len}]})

    def metrics(self) -> bytes:
        return response(200, render_metrics(self.scheduler), "text/plain; version=0.0.4")

    async def generate(self, http_req: HttpRequest, reader, writer, chat: bool) -> None:
        loop = asyncio.get_running_loop()
        # off the event loop: a long prompt's JSON and tokenization must not stall other clients
        gen = await loop.run_in_executor(self.parser, parse_generation, http_req.body, chat, self.model)
        events: asyncio.Queue[Event | None] = asyncio.Queue()
        rid = new_id(chat)
        def sink(ev: Event) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the loop is closed: the server is exiting
                pass
        req = Request(prompt_ids=gen.prompt_ids, max_tokens=gen.max_tokens, sampling=gen.sampling,
                      sink=sink, stop=gen.stop, ignore_eos=gen.ignore_eos, id=rid)
        try:
            self.scheduler.submit(req)
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_exceeded", code="queue_full") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
        except ValueError as e:
            raise APIError(400, str(e), param="max_tokens", code="invalid_value") from None

        def on_disconnect(t: asyncio.Task) -> None:
            if not t.cancelled():
                self.scheduler.cancel(req)
                events.put_nowait(None)
        watcher = asyncio.create_task(wait_disconnect(reader))
        watcher.add_done_callback(on_disconnect)
        try:
            if gen.stream:
                await self.stream(gen, rid, events, writer)
            else:
                await self.respond(gen, rid, events, writer)
        except (ConnectionError, OSError):
            self.scheduler.cancel(req)
        finally:
            watcher.cancel()

    def failed(self, ev: Event) -> APIError:
        """The error a request ended with: the engine failed (500), or the server is shutting
        down with the engine healthy (503, as a request refused then gets)."""
        if self.scheduler.error is None:
            return APIError(503, ev.error, type="server_error", code="engine_unavailable")
        return APIError(500, f"the engine failed: {ev.error}", type="server_error", code="engine_error")

    async def respond(self, gen: GenerationRequest, rid: str, events: asyncio.Queue,
                      writer) -> None:
        text, ids = [], []
        while True:
            ev = await events.get()
            if ev is None:  # the client went away
                return
            if ev.error:
                raise self.failed(ev)
            text.append(ev.text)
            ids += ev.token_ids
            if ev.finish_reason:
                break
        writer.write(response(200, full_response(gen, rid, self.model.name, "".join(text), ids,
                                                 ev.finish_reason)))

    async def stream(self, gen: GenerationRequest, rid: str, events: asyncio.Queue,
                     writer) -> None:
        created, name, n_out = int(time.time()), self.model.name, 0
        writer.write(sse_head())
        if gen.chat:
            writer.write(sse_event(chunk(gen, rid, name, created, None, None, first=True)))
        await writer.drain()
        while True:
            ev = await events.get()
            if ev is None:
                return
            if ev.error:
                err = self.failed(ev)
                writer.write(sse_event(err.body()) + sse_event("[DONE]"))
                return
            n_out += len(ev.token_ids)
            if ev.text or ev.finish_reason or gen.return_token_ids:
                writer.write(sse_event(chunk(gen, rid, name, created, ev.text, ev.finish_reason,
                                             token_ids=ev.token_ids)))
            if ev.finish_reason:
                if gen.include_usage:
                    writer.write(sse_event(usage_chunk(gen, rid, name, created, n_out)))
                writer.write(sse_event("[DONE]"))
                return
            await writer.drain()


def _extra_headers(e: APIError) -> dict:
    if e.status == 401:
        return {"WWW-Authenticate": "Bearer"}
    if e.status == 429:
        return {"Retry-After": "1"}
    return {}


def render_metrics(s: Scheduler) -> str:
    st, rt = s.stats, s.runtime
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value:g}" if isinstance(value, float) else
                     f"{name}{labels} {value}" for labels, value in samples)

    metric("tpmk_requests_total", "counter", "requests accepted", [("", st.requests_total)])
    metric("tpmk_requests_rejected_total", "counter", "requests refused with 429 (queue full)",
           [("", st.rejected_total)])
    metric("tpmk_requests_finished_total", "counter", "finished requests by reason",
           [(f'{{reason="{r}"}}', st.finished[r])
            for r in ("stop", "length", "cancelled", "error")])
    metric("tpmk_requests_running", "gauge", "requests in the decode batch", [("", s.num_running)])
    metric("tpmk_queue_depth", "gauge", "requests waiting to be admitted", [("", s.num_waiting)])
    metric("tpmk_batch_size", "gauge", "sequences in the last decode step",
           [("", st.last_batch_size)])
    metric("tpmk_decode_sequences_total", "counter",
           "sequences summed over decode steps (divide by the decode step count: mean batch)",
           [("", st.decode_sequences_total)])
    metric("tpmk_prompt_tokens_total", "counter", "prompt tokens prefilled",
           [("", st.prompt_tokens_total)])
    metric("tpmk_generation_tokens_total", "counter", "tokens generated",
           [("", st.generated_tokens_total)])
    metric("tpmk_tokens_per_second", "gauge", "tokens generated per second over the last 10 s",
           [("", float(st.tokens_per_s()))])
    metric("tpmk_step_seconds", "summary", "engine step time by kind",
           [('_sum{kind="prefill"}', float(st.prefill_seconds)),
            ('_count{kind="prefill"}', st.prefill_steps),
            ('_sum{kind="decode"}', float(st.decode_seconds)),
            ('_count{kind="decode"}', st.decode_steps)])
    metric("tpmk_last_step_seconds", "gauge", "time of the last engine step",
           [("", float(st.last_step_seconds))])
    metric("tpmk_kv_pages_in_use", "gauge", "KV-cache pages held by requests",
           [("", s.pages_in_use)])
    metric("tpmk_kv_pages_total", "gauge", "KV-cache pages", [("", rt.num_pages)])
    metric("tpmk_healthy", "gauge", "1 while the engine works", [("", int(s.healthy))])
    return "\n".join(lines) + "\n"


# ---- command line ----------------------------------------------------------------------
def add_serve_parser(sub) -> argparse.ArgumentParser:
    from tpmk.launcher.launch import add_runtime_args
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve /v1/completions and /v1/chat/completions (OpenAI API, SSE streaming) "
                    "with continuous batching over tensor-parallel workers.")
    add_runtime_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default %(default)s: this machine only; "
                        "0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one "
                   "(default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("TPMK_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TPMK_API_KEY)")
    p.add_argument("--max-queue", type=int, default=64, metavar="Q",
                   help="requests that may wait for a batch slot or KV pages; more get HTTP 429 "
                        "(default %(default)s)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: --model as given)")
    p.add_argument("--step-timeout", type=float, default=None, metavar="S",
                   help="treat an engine step (and the workers' start-up) slower than S "
                        "seconds as a failure (default: none)")
    p.set_defaults(func=run_serve)
    return p


def _model_info(name: str, model_dir: str, cfg, max_seq_len: int, tokenizer) -> ModelInfo:
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text)

    def render_chat(messages: list[dict]) -> list[int]:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
            return tokenizer.encode(text, add_special_tokens=False)
        # No template in the checkpoint: plain "role: content" turns.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return tokenizer.encode(text)

    return ModelInfo(name=name, vocab_size=cfg.vocab_size, max_seq_len=max_seq_len,
                     encode=encode, render_chat=render_chat)


def run_serve(args: argparse.Namespace) -> int:
    from tpmk.config import ModelConfig
    from tpmk.engine.generate import load_tokenizer, stop_token_ids
    from tpmk.launcher.launch import launch, resolve_model, runtime_from_args

    if args.max_queue < 0:
        raise ValueError(f"--max-queue {args.max_queue} must be >= 0")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch {args.max_batch} must be >= 1")
    runtime = runtime_from_args(args)
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_pretrained(model_dir)
    if runtime.max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-seq-len {runtime.max_seq_len} exceeds the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings}; lower it")
    tokenizer = load_tokenizer(model_dir)
    model = _model_info(args.served_model_name or args.model, model_dir, cfg,
                        runtime.max_seq_len, tokenizer)
    client = launch(model_dir, runtime, args.launcher, timeout_s=args.step_timeout)
    scheduler = None
    try:
        scheduler = Scheduler(client, runtime,
                              lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                              stop_token_ids(cfg, model_dir), max_queue=args.max_queue)
        return asyncio.run(_serve(Server(scheduler, model, args.api_key), args, runtime))
    finally:
        # A step still running after the shutdown grace owns the client: leave it (the
        # worker processes are daemons and end with this process).
        if scheduler is None or not scheduler.engine_busy:
            client.close()


async def _serve(server: Server, args: argparse.Namespace, runtime) -> int:
    loop = asyncio.get_running_loop()
    fatal, stop = asyncio.Event(), asyncio.Event()
    server.scheduler.on_fatal = lambda exc: loop.call_soon_threadsafe(fatal.set)
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    srv = await asyncio.start_server(server.handle, args.host, args.port, limit=MAX_HEADER_BYTES)
    server.scheduler.start()
    port = srv.sockets[0].getsockname()[1]
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"tpmk serve: warning: listening on {args.host} without --api-key",
              file=sys.stderr)
    print(f"tpmk serve: listening on http://{args.host}:{port} (model {server.model.name!r}, "
          f"{runtime.engine} tp={runtime.tp} {runtime.resolved_device()}, "
          f"max_batch={runtime.max_batch}, max_seq_len={runtime.max_seq_len})", flush=True)
    waits = [asyncio.create_task(fatal.wait()), asyncio.create_task(stop.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    if fatal.is_set():  # probes see 503 and late clients a clean error, not a refusal
        await asyncio.sleep(FATAL_LINGER_S)
    srv.close()
    if not fatal.is_set():
        await asyncio.to_thread(server.scheduler.stop)  # errors what is left: "shutting down"
    # Let handlers write the error events they were sent, then drop what remains.
    deadline = loop.time() + DRAIN_GRACE_S
    while server.active and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for t in list(server.active):
        t.cancel()
    if fatal.is_set():
        print(f"tpmk serve: error: the engine failed, exiting: {server.scheduler.error}",
              file=sys.stderr, flush=True)
        return 1
    return 0
