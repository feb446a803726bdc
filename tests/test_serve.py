"""`tpmk serve`: the continuous-batching scheduler on a scripted engine, then real servers
on 127.0.0.1 (tiny checkpoint, CPU): tp=2 reference engine over the local launcher, whose
outputs must equal offline generation (tpmk.engine.generate, same seeds); OpenAI errors;
queue limit; disconnects; API key; a worker killed mid-request."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from _cli_helpers import REPO, tpmk_env
from tpmk.config import RuntimeConfig
from tpmk.engine.api import Decode, Prefill, SamplingParams, StepResult, WorkerError
from tpmk.serve.scheduler import EngineDeadError, QueueFullError, Request, Scheduler


# ---- scheduler on a scripted engine ---------------------------------------------------
class ScriptedClient:
    """Request with seed s generates SCRIPTS[s] one character per token (id = ord(char)),
    then 'x' forever; EOS is id 1. Records batch sizes; can fail or block on purpose."""
    world_size = 1
    SCRIPTS = {1: "abc<END>def", 2: "hi\x01never", 3: "0123456789", 4: "é<E"}

    def __init__(self, fail_at_step: int | None = None, step_s: float = 0.0):
        self.batches: list[int] = []
        self.fail_at_step, self.step_s = fail_at_step, step_s

    def _tok(self, seed: int, k: int) -> int:
        s = self.SCRIPTS.get(seed, "")
        return ord(s[k]) if k < len(s) else ord("x")

    def execute(self, cmd):
        time.sleep(self.step_s)
        self.batches.append(len(cmd.tokens))
        if self.fail_at_step is not None and len(self.batches) >= self.fail_at_step:
            raise WorkerError(1, "process 123 died during Decode (exit code -9)")
        if isinstance(cmd, Prefill):
            return StepResult([self._tok(s.seed, 0) for s in cmd.sampling])
        assert isinstance(cmd, Decode)
        # The scheduler's bookkeeping: position of the fed token = prompt (4) + k - 1.
        return StepResult([self._tok(s.seed, p - 4 + 1) for s, p in zip(cmd.sampling, cmd.positions)])


def _detok(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i >= 32)


def _scheduler(client, **kw) -> Scheduler:
    rt = RuntimeConfig(tp=1, device="cpu", page_size=4, max_batch=kw.pop("max_batch", 4),
                       max_seq_len=64, num_pages=kw.pop("num_pages", 0))
    s = Scheduler(client, rt, _detok, eos_token_ids=(1,), **kw)
    s.start()
    return s


def _submit(s: Scheduler, seed: int, max_tokens: int, stop=(), ignore_eos=False):
    events, done = [], threading.Event()

    def sink(ev):
        events.append(ev)
        if ev.finish_reason:
            done.set()
    req = Request(prompt_ids=[5, 6, 7, 8], max_tokens=max_tokens,
                  sampling=SamplingParams(seed=seed), sink=sink, stop=tuple(stop),
                  ignore_eos=ignore_eos)
    s.submit(req)
    return req, events, done


def test_scheduler_stop_strings_eos_and_length():
    s = _scheduler(ScriptedClient())
    cases = [(1, 20, ["<END>"], "abc", "stop"), (2, 20, [], "hi", "stop"),
             (3, 5, [], "01234", "length"), (3, 20, ["34", "7"], "012", "stop"),
             (4, 5, ["<EN"], "é<Exx", "length")]
    runs = [(_submit(s, seed, mt, stop), text, reason) for seed, mt, stop, text, reason in cases]
    for (_, events, done), text, reason in runs:
        assert done.wait(10)
        assert "".join(e.text for e in events) == text
        assert events[-1].finish_reason == reason
    # "<END>" arrives one character per token: its prefix is held back, never handed out.
    assert not any("<" in e.text for e in runs[0][0][1])
    assert s.pages_in_use == 0
    s.stop()


def test_scheduler_admission_by_pages_and_queue_limit():
    client = ScriptedClient(step_s=0.002)
    # 4 pages of 4 tokens; each request needs 4 + 4 tokens = 2 pages: two run at a time.
    s = _scheduler(client, num_pages=4, max_queue=2)
    runs = [_submit(s, 3, 4) for _ in range(2)]
    with pytest.raises(QueueFullError, match="max-queue"):
        for _ in range(10):
            runs.append(_submit(s, 3, 4))
    assert 4 <= len(runs) <= 6
    for _, events, done in runs:
        assert done.wait(10) and "".join(e.text for e in events) == "0123"
    assert max(client.batches) == 2 and s.pages_in_use == 0
    assert s.stats.rejected_total == 1
    s.stop()


def test_scheduler_cancel_frees_pages():
    s = _scheduler(ScriptedClient(step_s=0.005))
    req, events, done = _submit(s, 3, 50, ignore_eos=True)
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.005)
    assert s.pages_in_use == 14  # ceil((4 + 50) / 4)
    s.cancel(req)
    while s.pages_in_use and time.monotonic() < deadline:
        time.sleep(0.005)
    assert s.pages_in_use == 0 and s.stats.finished["cancelled"] == 1 and not done.is_set()
    s.stop()


def test_scheduler_batch_and_page_limits_hold_exactly():
    """max_batch 2 with pages for all: never more than 2 in a step. 3 pages, requests of 2
    pages each: the second waits (nothing overcommits and fails). A request larger than the
    whole cache is refused at submit, not queued forever."""
    client = ScriptedClient(step_s=0.002)
    s = _scheduler(client, max_batch=2)
    runs = [_submit(s, 3, 4) for _ in range(3)]
    for _, events, done in runs:
        assert done.wait(10) and events[-1].finish_reason == "length"
    assert max(client.batches) == 2
    s.stop()
    client = ScriptedClient(step_s=0.002)
    s = _scheduler(client, num_pages=3)   # a request of 4 + 4 tokens needs 2 pages of 4
    runs = [_submit(s, 3, 4) for _ in range(2)]
    for _, events, done in runs:
        assert done.wait(10) and "".join(e.text for e in events) == "0123"
    assert max(client.batches) == 1 and s.healthy and s.pages_in_use == 0
    with pytest.raises(ValueError, match="needs 5 KV pages"):
        _submit(s, 3, 13)   # 4 + 13 tokens: 5 pages of 4 > 3
    s.stop()


def test_scheduler_ignore_eos_and_cancel_while_waiting():
    """ignore_eos runs past the scripted EOS to the length; a request cancelled while it
    waits never reaches the engine and counts once."""
    client = ScriptedClient(step_s=0.01)
    s = _scheduler(client, max_batch=1)
    _, events, done = _submit(s, 2, 6, ignore_eos=True)   # "hi\x01never": EOS third
    req, _, waiting_done = _submit(s, 3, 4)
    s.cancel(req)
    assert done.wait(10) and events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == "hinev"   # the EOS id (1) decodes to nothing here
    assert not waiting_done.is_set() and s.stats.finished["cancelled"] == 1
    assert client.batches.count(1) == len(client.batches) and len(client.batches) == 6
    s.stop()


def test_tokens_per_second_over_the_window():
    """60 tokens within the last 10 s (and 1000 older ones) are 6 tokens/s."""
    from tpmk.serve.scheduler import TOKENS_PER_S_WINDOW_S, Stats
    st = Stats()
    st.recent_tokens.extend([(100.0, 1000), (195.0, 20), (199.0, 40)])
    assert TOKENS_PER_S_WINDOW_S == 10.0 and st.tokens_per_s(now=200.0) == 6.0


def test_scheduler_drops_the_token_of_a_request_cancelled_during_its_step():
    """A cancel that lands while the engine runs the step: the step's token is not handed
    out, the request ends cancelled, its pages come back."""
    box, ready = {}, threading.Event()

    class CancelInStep(ScriptedClient):
        def execute(self, cmd):
            if isinstance(cmd, Decode) and ready.wait(5) and "req" in box:   # the first decode
                box["sched"].cancel(box.pop("req"))
            return super().execute(cmd)
    s = _scheduler(CancelInStep(step_s=0.005))
    box["sched"] = s
    req, events, done = _submit(s, 3, 30)
    box["req"] = req
    ready.set()
    deadline = time.monotonic() + 10
    while not (events and s.pages_in_use == 0) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert s.pages_in_use == 0 and s.stats.finished["cancelled"] == 1 and not done.is_set()
    assert "".join(e.text for e in events) == "0"   # the prefill's token only
    s.stop()


def test_scheduler_prefill_error_answers_the_batch_in_prefill():
    """The requests of a failing prefill are off the waiting list and not yet running: they
    still get the error, and their pages come back."""
    fatal = []
    s = _scheduler(ScriptedClient(fail_at_step=1, step_s=0.05), max_batch=2, on_fatal=fatal.append)
    runs = [_submit(s, 3, 30) for _ in range(3)]  # two in the prefill, one waiting
    for _, events, done in runs:
        assert done.wait(10)
        assert events[-1].finish_reason == "error" and "rank 1" in events[-1].error
    assert s.pages_in_use == 0 and s.stats.finished["error"] == 3 and fatal


def test_scheduler_worker_error_fails_everything():
    fatal = []
    s = _scheduler(ScriptedClient(fail_at_step=3, step_s=0.01), max_batch=1,
                   on_fatal=fatal.append)
    runs = [_submit(s, 3, 30) for _ in range(3)]  # one running, two waiting
    for _, events, done in runs:
        assert done.wait(10)
        assert events[-1].finish_reason == "error" and "rank 1" in events[-1].error
    assert not s.healthy and isinstance(fatal[0], WorkerError)
    with pytest.raises(EngineDeadError):
        _submit(s, 3, 4)


def test_incremental_detokenization_equals_full_decode(tiny_dir):
    """Random ids (bytes that make invalid UTF-8 included) streamed one token at a time:
    the text handed out equals the tokenizer's decode of the whole output."""
    import random
    from tpmk.engine.generate import load_tokenizer
    tok = load_tokenizer(tiny_dir)
    s = Scheduler.__new__(Scheduler)  # only _new_text, which uses detokenize
    s.detokenize = lambda ids: tok.decode(ids, skip_special_tokens=True)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(512) if rng.random() < 0.5 else rng.randrange(6, 262)
               for _ in range(rng.randrange(1, 30))]
        req = Request(prompt_ids=[1], max_tokens=64, sampling=SamplingParams(), sink=print)
        out = ""
        for k, t in enumerate(ids):
            req.output_ids.append(t)
            out += s._new_text(req, final=k == len(ids) - 1)[0]
        assert out == tok.decode(ids, skip_special_tokens=True), ids


# ---- real servers ------------------------------------------------------------------------
class ServerProc:
    def __init__(self, *args: str):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tpmk", "serve", "--port", "0", "--device", "cpu", *args],
            cwd=REPO, env=tpmk_env(), stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.port = None

    def wait_ready(self, timeout=90.0) -> "ServerProc":
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        line = box[0] if box else ""
        if "listening on" not in line:
            self.stop()
            raise AssertionError(f"server did not start: {line!r}\n{self.stderr()}")
        self.port = int(line.split("http://127.0.0.1:")[1].split()[0])
        return self

    def stderr(self) -> str:
        self.log.flush()
        return open(self.log.name).read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)


def call(port: int, method: str, path: str, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    ctype = r.getheader("Content-Type", "")
    return r.status, json.loads(raw) if ctype.startswith("application/json") else raw.decode()


def stream(port: int, path: str, body: dict, headers=None) -> tuple[int, list]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    if r.status != 200:
        return r.status, [json.loads(r.read())]
    events = []
    for line in r:
        if line.startswith(b"data: "):
            if line.strip() == b"data: [DONE]":
                break
            events.append(json.loads(line[6:]))
    conn.close()
    return 200, events


def metrics(port: int) -> dict[str, float]:
    _, text = call(port, "GET", "/metrics")
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line and not line.startswith("#"))}


def wait_for(pred, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def open_stream(port: int, body: dict, headers=None, n_events=2) -> socket.socket:
    """A raw streaming request left open after `n_events` SSE events."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps({**body, "stream": True}).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
                 f"{head}\r\n".encode() + data)
    buf = b""
    while buf.count(b"data: ") < n_events:
        more = sock.recv(65536)
        assert more, f"stream ended early: {buf[:500]!r}"
        buf += more
    assert buf.startswith(b"HTTP/1.1 200"), buf[:300]
    return sock


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    from tpmk.launcher import resolve_model
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def servers(tiny_dir):
    """Started together: tp=2 local launcher; tp=1 inline with max_batch 1 and an API key."""
    tp2 = ServerProc("--tp", "2", "--launcher", "local", "--max-batch", "8")
    tp1 = ServerProc("--max-batch", "1", "--max-queue", "1", "--api-key", "sekret")
    try:
        yield tp2.wait_ready(), tp1.wait_ready()
    finally:
        tp2.stop()
        tp1.stop()


def _requests(tokenizer):
    texts = ["Hello, tpmk", "The capital of France", "def main():", "Once upon a time",
             "quick brown fox", "GPUs", "1 2 3 4", "memory bandwidth"]
    out = []
    for i in range(16):
        prompt = texts[i // 2] if i % 2 else [1] + [(7 * i + 3 * j) % 500 + 6 for j in range(i + 1)]
        temperature = (0.0, 0.8, 1.0)[i % 3]
        out.append({"model": "tiny", "prompt": prompt, "max_tokens": 6 + i % 5,
                    "temperature": temperature, "top_p": 0.9 if i % 4 == 1 else 1.0,
                    "top_k": 20 if i % 4 == 2 else 0, "seed": 1000 + i,
                    "return_token_ids": True})
    return out


def test_16_concurrent_streams_equal_offline_generation(servers, tiny_dir):
    from tpmk.engine.generate import generate, load_tokenizer
    from tpmk.launcher import launch
    port = servers[0].port
    tok = load_tokenizer(tiny_dir)
    reqs = _requests(tok)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda b: stream(port, "/v1/completions", b), reqs))
    # Offline: the same tp=2 shards in one process (inline). The server's two ranks sum
    # two partials in gloo, commutative in IEEE arithmetic: bit-identical logits.
    rt = RuntimeConfig(tp=2, device="cpu", max_batch=8)
    client = launch(tiny_dir, rt, "inline")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend with the servers
    try:
        for body, (status, events) in zip(reqs, got):
            assert status == 200, events
            p = body["prompt"]
            ids = tok.encode(p) if isinstance(p, str) else p
            sp = SamplingParams(temperature=body["temperature"], top_p=body["top_p"],
                                top_k=body["top_k"], seed=body["seed"])
            ref = generate(client, rt, [ids], body["max_tokens"], [sp], (2,))[0]
            out_ids = [t for e in events for t in e["choices"][0].get("token_ids", [])]
            assert out_ids == ref.token_ids, body
            text = "".join(e["choices"][0]["text"] for e in events)
            assert text == tok.decode(ref.token_ids, skip_special_tokens=True)
            assert events[-1]["choices"][0]["finish_reason"] == ref.finish_reason
    finally:
        torch.set_num_threads(threads)
        client.close()
    m = metrics(port)
    assert m["tpmk_decode_sequences_total"] / m["tpmk_step_seconds_count{kind=\"decode\"}"] > 2
    assert m["tpmk_kv_pages_in_use"] == 0 and m["tpmk_requests_running"] == 0


def test_chat_uses_checkpoint_template(servers, tiny_dir):
    import jinja2
    cfg = json.load(open(os.path.join(tiny_dir, "tokenizer_config.json")))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = jinja2.Template(cfg["chat_template"]).render(
        messages=msgs, add_generation_prompt=True, bos_token=cfg["bos_token"],
        eos_token=cfg["eos_token"])
    from tpmk.engine.generate import load_tokenizer
    want = load_tokenizer(tiny_dir).encode(rendered, add_special_tokens=False)
    status, body = call(servers[0].port, "POST", "/v1/chat/completions",
                        {"messages": msgs, "max_tokens": 3, "seed": 5, "return_token_ids": True})
    assert status == 200, body
    assert body["prompt_token_ids"] == want and want[0] == 1
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize("path,body,param,needle", [
    ("/v1/completions", b'{"prompt": "hi", ', None, "not valid JSON"),
    ("/v1/completions", b'[1, 2]', None, "JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, "model", "gpt-4"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n", "n=1"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", "-1"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "stop"),
    ("/v1/completions", {"prompt": [1, 600]}, "prompt", "600"),
    ("/v1/completions", {"prompt": []}, "prompt", "non-empty"),
    ("/v1/completions", {"prompt": [1] * 1000, "max_tokens": 100}, "prompt", "1024"),
    ("/v1/completions", {"prompt": [1, 512]}, "prompt", "512"),   # tiny's vocab: 0..511
    ("/v1/completions", {"prompt": "hi", "seed": 2 ** 63}, "seed", "seed"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n", "n=1"),
    ("/v1/completions", {"prompt": "hi", "stream_options": "x"}, "stream_options", "object"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop", "non-empty"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, "top_k", "top_k"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": NaN}', "top_p", "finite"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', "temperature", "finite"),
    ("/v1/completions", {"prompt": "\ud800"}, "prompt", "could not be tokenized"),
    ("/v1/completions", b"[" * 50000 + b"]" * 50000, None, "not valid JSON"),
    ("/v1/completions", {"prompt": "x" * (256 * 1024 + 1)}, "prompt", "262145 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (256 * 1024 + 1)}]},
     "messages", "characters"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 2000}, "messages", "2000"),
])
def test_bad_requests_get_openai_400(servers, path, body, param, needle):
    status, resp = call(servers[0].port, "POST", path, body)
    assert status == 400, resp
    err = resp["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert needle in err["message"], err["message"]


def test_out_of_range_sampling_values_behave_as_their_limits(servers):
    """top_k past the vocab (even past int64) samples the whole vocab; a temperature that is
    0 in float32 is greedy. Neither may reach the engine as is: either failed a step, which
    ends the server."""
    port = servers[0].port
    base = {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}

    def ids(**kw):
        status, body = call(port, "POST", "/v1/completions", {**base, **kw})
        assert status == 200, body
        return body["choices"][0]["token_ids"]
    assert ids(temperature=1.0, seed=3, top_k=10 ** 30) == ids(temperature=1.0, seed=3)
    assert ids(temperature=1e-40, seed=3) == ids(temperature=0)
    assert call(port, "GET", "/health")[0] == 200


def test_context_limits_and_default_max_tokens(servers):
    """max_seq_len 1024: a prompt plus max_tokens of exactly 1024 fits; without max_tokens a
    completion gets min(16, the room left); chat honours max_completion_tokens; text parts
    of a message are joined as they are."""
    port = servers[0].port

    def completion(path, body):
        status, resp = call(port, "POST", path, {"ignore_eos": True, "return_token_ids": True, **body})
        assert status == 200, resp
        return resp
    r = completion("/v1/completions", {"prompt": [1] * 1020, "max_tokens": 4})
    assert len(r["choices"][0]["token_ids"]) == 4
    r = completion("/v1/completions", {"prompt": [1] * 1021})
    assert len(r["choices"][0]["token_ids"]) == 3 and r["choices"][0]["finish_reason"] == "length"
    r = completion("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                            "max_completion_tokens": 2})
    assert r["usage"]["completion_tokens"] == 2
    parts = completion("/v1/chat/completions", {"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}]})
    whole = completion("/v1/chat/completions", {"max_tokens": 1, "messages": [{"role": "user", "content": "abcd"}]})
    assert parts["prompt_token_ids"] == whole["prompt_token_ids"]


class _Writes:
    def __init__(self):
        self.data = b""

    def write(self, b: bytes) -> None:
        self.data += b


def _parse(raw: bytes):
    """read_request on `raw` (then EOF): (HttpRequest or HttpError, bytes written back)."""
    import asyncio
    from tpmk.serve.http import HttpError, read_request

    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        w = _Writes()
        try:
            return await read_request(reader, w), w.data
        except HttpError as e:
            return e, w.data
    return asyncio.run(go())


@pytest.mark.parametrize("raw,status", [
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 413),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n", 413),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411),
    (b"GET / FOO\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}", 400),
])
def test_http_requests_malformed_get_their_status(raw, status):
    err, _ = _parse(raw)
    assert getattr(err, "status", None) == status, err


def test_http_request_parsing():
    """The query string leaves the path; header names are case-blind; Expect: 100-continue
    gets its interim response before the body is read."""
    req, out = _parse(b"GET /health?probe=1 HTTP/1.1\r\nX-Thing: A\r\n\r\n")
    assert (req.method, req.path, req.headers["x-thing"], req.body) == ("GET", "/health", "A", b"")
    req, out = _parse(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 2\r\n"
                      b"EXPECT: 100-continue\r\n\r\n{}")
    assert req.body == b"{}" and out == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert _parse(b"") == (None, b"")


def test_an_unexpected_error_costs_its_request_a_500():
    """A bug in a handler answers that request with OpenAI's error shape (500) instead of
    dropping the connection, and the server goes on serving."""
    import asyncio
    from tpmk.serve.app import Server

    class Broken(Server):
        async def route(self, req, reader, writer):
            if req.path == "/boom":
                raise RuntimeError("boom")
            writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")

    async def get(port, path):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = await reader.read()
        writer.close()
        return data

    async def main():
        srv = Broken(scheduler=None, model=None)
        server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await get(port, "/boom"), await get(port, "/ok")
        finally:
            server.close()
            srv.parser.shutdown()
    boom, ok = asyncio.run(main())
    assert boom.startswith(b"HTTP/1.1 500"), boom[:200]
    err = json.loads(boom.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["type"] == "server_error" and "RuntimeError: boom" in err["message"]
    assert ok.startswith(b"HTTP/1.1 204")


def test_disconnect_mid_stream_frees_pages(servers):
    port = servers[0].port
    before = metrics(port)['tpmk_requests_finished_total{reason="cancelled"}']
    sock = open_stream(port, {"prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": True})
    m = metrics(port)
    assert m["tpmk_kv_pages_in_use"] == 57 and m["tpmk_requests_running"] == 1  # ceil(903/16)
    sock.close()
    wait_for(lambda: metrics(port)["tpmk_kv_pages_in_use"] == 0, what="pages freed")
    assert metrics(port)['tpmk_requests_finished_total{reason="cancelled"}'] == before + 1


def test_api_key_and_queue_limit(servers):
    port, key = servers[1].port, {"Authorization": "Bearer sekret"}
    body = {"prompt": "hi", "max_tokens": 2}
    assert call(port, "POST", "/v1/completions", body)[0] == 401
    status, resp = call(port, "POST", "/v1/completions", body, {"Authorization": "Bearer nope"})
    assert status == 401 and resp["error"]["code"] == "invalid_api_key"
    assert call(port, "GET", "/v1/models")[0] == 401
    assert call(port, "GET", "/health")[0] == 200  # probes need no key
    assert call(port, "POST", "/v1/completions", body, key)[0] == 200
    # max_batch 1, max_queue 1: one running, one waiting, the third is refused.
    long = {"prompt": [1, 2], "max_tokens": 1000, "ignore_eos": True}
    running = open_stream(port, long, key)
    waiting = socket.create_connection(("127.0.0.1", port))
    data = json.dumps({**long, "stream": True}).encode()
    waiting.sendall(b"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer sekret\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(data) + data)
    wait_for(lambda: metrics(port)["tpmk_queue_depth"] == 1, what="queue depth 1")
    status, resp = call(port, "POST", "/v1/completions", body, key)
    assert status == 429, resp
    assert resp["error"]["type"] == "rate_limit_exceeded" and "max-queue" in resp["error"]["message"]
    running.close()
    waiting.close()
    wait_for(lambda: metrics(port)["tpmk_kv_pages_in_use"] == 0, what="pages freed")


def test_sigterm_exits_cleanly(servers):
    """A stream in flight ends with a 503-type error event (the engine is fine; the server
    is going away), then [DONE]; the process exits 0."""
    srv = servers[1]
    sock = open_stream(srv.port, {"prompt": [1, 2], "max_tokens": 1000, "ignore_eos": True},
                       {"Authorization": "Bearer sekret"})
    srv.proc.send_signal(signal.SIGTERM)
    buf = b""
    while more := sock.recv(65536):
        buf += more
    assert b'"code": "engine_unavailable"' in buf and buf.rstrip().endswith(b"data: [DONE]"), buf[-500:]
    assert srv.proc.wait(15) == 0, srv.stderr()


def test_worker_killed_mid_request_errors_and_exits(servers):
    """Last in the file: it ends the tp=2 server."""
    srv = servers[0]
    sock = open_stream(srv.port, {"prompt": [1, 2, 3], "max_tokens": 800, "ignore_eos": True})
    children = []
    for task in os.listdir(f"/proc/{srv.proc.pid}/task"):
        children += open(f"/proc/{srv.proc.pid}/task/{task}/children").read().split()
    ranks = [int(c) for c in children
             if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
    assert len(ranks) == 2, children
    with ThreadPoolExecutor(1) as pool:  # a second, non-streaming request in flight
        plain = pool.submit(call, srv.port, "POST", "/v1/completions",
                            {"prompt": [1, 2], "max_tokens": 800, "ignore_eos": True})
        wait_for(lambda: metrics(srv.port)["tpmk_requests_running"] == 2, what="2 running")
        os.kill(ranks[-1], signal.SIGKILL)
        status, body = plain.result(30)
    assert status == 500 and body["error"]["code"] == "engine_error", body
    rest = b""
    while chunk := sock.recv(65536):
        rest += chunk
    sock.close()
    assert b'"error"' in rest and b"rank" in rest, rest[-500:]
    status, body = call(srv.port, "GET", "/health")  # answered until the exit
    assert status == 503 and "rank" in body["error"], body
    assert srv.proc.wait(20) == 1, srv.stderr()
    assert "the engine failed" in srv.stderr()
