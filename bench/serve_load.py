"""Bounded load on `tpmk serve`: N concurrent streaming clients, M requests in all.

Starts a server (or uses --url), sends streaming /v1/completions with random
token-id prompts and ignore_eos (every request makes exactly --max-tokens
tokens), and prints throughput (output tokens/s, requests/s), time to first
token and per-token latency percentiles, and the server's mean decode batch
and step time from /metrics. JSON goes to bench/results/serve_load_<device>.json.

  python bench/serve_load.py --concurrency 64 --requests 256 -- --engine megakernel --tp 8
  python bench/serve_load.py --url http://127.0.0.1:8000 --model tiny
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "tpmk", "serve", "--port", "0", *serve_args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start (exit {proc.wait()}): {line!r}")
    print(line.strip(), file=sys.stderr)
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
    return proc, line.split("listening on ")[1].split()[0]


def one_request(url, model: str | None, prompt: list[int], max_tokens: int, seed: int,
                api_key: str | None) -> dict:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 1.0, "seed": seed, "return_token_ids": True}
    if model is not None:   # None: whatever the server serves
        body["model"] = model
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    r = conn.getresponse()
    if r.status != 200:
        return {"error": f"HTTP {r.status}: {r.read()[:200]!r}"}
    stamps, n = [], 0
    for line in r:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            return {"error": ev["error"]["message"]}
        k = len(ev["choices"][0].get("token_ids", []))
        if k:
            n += k
            stamps.append(time.perf_counter())
    conn.close()
    end = time.perf_counter()
    return {"tokens": n, "ttft_s": stamps[0] - t0 if stamps else None, "latency_s": end - t0,
            "tpot_s": (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else None}


def metrics(url: str) -> dict[str, float]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line and not line.startswith("#"))}


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def device_name(serve_args: list[str]) -> str:
    import torch
    if "cpu" not in serve_args and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="arguments after -- go to `tpmk serve`")
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--model", default=None,
                   help="model id to request (default: none, the server's own); the server this "
                        "script starts serves tiny unless the arguments after -- name a --model")
    p.add_argument("--api-key", default=os.environ.get("TPMK_API_KEY"))
    p.add_argument("--concurrency", type=int, default=16, metavar="N")
    p.add_argument("--requests", type=int, default=0, metavar="M", help="default: 4 x N")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=500, help="prompt ids drawn below this")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    args, serve_args = p.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    total = args.requests or 4 * args.concurrency
    if not any(a.startswith("--max-batch") for a in serve_args):
        serve_args += ["--max-batch", str(args.concurrency)]
    if not any(a.startswith("--max-queue") for a in serve_args):
        serve_args += ["--max-queue", str(total)]
    if not any(a.startswith("--model") for a in serve_args):
        serve_args += ["--model", args.model or "tiny"]
    proc, url = (None, args.url) if args.url else start_server(serve_args)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(6, args.vocab) for _ in range(args.prompt_len - 1)]
               for _ in range(total)]
    try:
        warm = one_request(url, args.model, prompts[0], 2, 0, args.api_key)
        if "error" in warm:
            raise SystemExit(f"the warm-up request failed: {warm['error']}")
        m0 = metrics(url)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda i: one_request(url, args.model, prompts[i],
                                                          args.max_tokens, i, args.api_key),
                                    range(total)))
        wall = time.perf_counter() - t0
        m1 = metrics(url)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    errors = [r["error"] for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    steps = m1['tpmk_step_seconds_count{kind="decode"}'] - m0['tpmk_step_seconds_count{kind="decode"}']
    step_s = m1['tpmk_step_seconds_sum{kind="decode"}'] - m0['tpmk_step_seconds_sum{kind="decode"}']
    seqs = m1["tpmk_decode_sequences_total"] - m0["tpmk_decode_sequences_total"]
    row = {
        "device": device_name(serve_args if proc else []), "serve_args": serve_args if proc else url,
        "concurrency": args.concurrency, "requests": total, "errors": len(errors),
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "wall_s": wall,
        "output_tokens": tokens, "output_tok_per_s": tokens / wall, "requests_per_s": len(ok) / wall,
        "ttft_p50_s": pct([r["ttft_s"] for r in ok if r["ttft_s"]], 0.5),
        "ttft_p99_s": pct([r["ttft_s"] for r in ok if r["ttft_s"]], 0.99),
        "tpot_p50_ms": 1e3 * pct([r["tpot_s"] for r in ok if r["tpot_s"]], 0.5),
        "latency_p50_s": pct([r["latency_s"] for r in ok], 0.5),
        "mean_decode_batch": seqs / steps if steps else 0.0,
        "mean_decode_step_ms": 1e3 * step_s / steps if steps else 0.0,
    }
    print(f"{'concurrency':>11} {'requests':>8} {'errors':>6} {'tok/s':>9} {'req/s':>7} "
          f"{'TTFT p50':>9} {'TPOT p50':>9} {'batch':>6} {'step ms':>8}")
    print(f"{row['concurrency']:>11} {total:>8} {len(errors):>6} {row['output_tok_per_s']:>9.1f} "
          f"{row['requests_per_s']:>7.2f} {row['ttft_p50_s']:>8.3f}s {row['tpot_p50_ms']:>7.1f}ms "
          f"{row['mean_decode_batch']:>6.1f} {row['mean_decode_step_ms']:>8.2f}")
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
    out = Path(args.out or REPO / "bench" / "results" /
               f"serve_load_{row['device'].replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
