"""`tpmk` command line: generate, make-checkpoint, serve."""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from tpmk.engine.api import WorkerError
from tpmk.launcher.launch import add_runtime_args

EPILOG = """examples:
  tpmk generate --prompt "Hello, tpmk"                       # tiny default model, CPU or GPU
  tpmk generate --model DIR --tp 2 --prompt-ids 1,2,3 --json  # two local worker processes
  tpmk make-checkpoint --config tiny-gqa /tmp/tiny-gqa        # random HF checkpoint
  tpmk serve --model DIR --tp 8 --engine megakernel           # OpenAI-compatible server
  mpirun -n 2 tpmk generate --launcher mpi --tp 2 --prompt hi
  ray job submit -- tpmk serve --launcher ray --tp 8 --model DIR"""


def _prompt_ids(text: str) -> tuple[str, list[int]]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of token ids, e.g. 1,2,3") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more token ids >= 0, e.g. 1,2,3")
    return ("ids", ids)


def add_generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "generate", help="generate text offline for one or more prompts",
        description="Generate continuations of prompts with a tensor-parallel engine. "
                    "Greedy unless --temperature > 0.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    add_runtime_args(p)
    p.add_argument("--prompt", dest="prompts", action="append", metavar="TEXT",
                   type=lambda s: ("text", s),
                   help="prompt text, tokenized with the checkpoint's tokenizer (repeatable)")
    p.add_argument("--prompt-ids", dest="prompts", action="append", metavar="1,2,3",
                   type=_prompt_ids, help="prompt as token ids, used as is (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="tokens to generate per prompt (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0: greedy (default); > 0: sample")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the k most likely; 0: all (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling mass (default %(default)s)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="sampling seed for every prompt (default: a random one per prompt)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the end-of-sequence token")
    p.add_argument("--json", action="store_true",
                   help='print one JSON line per prompt: {"token_ids": [...], "text": "..."}')
    p.set_defaults(func=run_generate)
    return p


def run_generate(args: argparse.Namespace) -> int:
    from tpmk.config import ModelConfig
    from tpmk.engine.api import SamplingParams
    from tpmk.engine.generate import (GenerateStats, check_lengths, generate, load_tokenizer,
                                      stop_token_ids)
    from tpmk.launcher.launch import launch, resolve_model, runtime_from_args

    runtime = runtime_from_args(args)
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    prompts = [v if kind == "ids" else tokenizer.encode(v)
               for kind, v in (args.prompts or [("text", "Hello, tpmk")])]
    for i, p in enumerate(prompts):
        if max(p) >= cfg.vocab_size:
            raise ValueError(f"prompt {i} has token id {max(p)} >= vocab_size={cfg.vocab_size} "
                             f"of {model_dir}")
    check_lengths(prompts, args.max_new_tokens, runtime)
    rng = random.SystemRandom()
    sampling = [SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               seed=args.seed if args.seed is not None else rng.randrange(2**31))
                for _ in prompts]
    eos = () if args.ignore_eos else stop_token_ids(cfg, model_dir)

    t0 = time.perf_counter()
    client = launch(model_dir, runtime, args.launcher)
    stats = GenerateStats()
    try:
        start_s = time.perf_counter() - t0
        gens = generate(client, runtime, prompts, args.max_new_tokens, sampling, eos, stats)
    finally:
        client.close()
    for g in gens:
        text = tokenizer.decode(g.token_ids, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"token_ids": g.token_ids, "text": text}), flush=True)
        else:
            print(f"{tokenizer.decode(g.prompt_ids, skip_special_tokens=True)!r} -> {text!r} "
                  f"({len(g.token_ids)} tokens, {g.finish_reason})", flush=True)
    total_s = max(stats.prefill_s + stats.decode_s, 1e-9)
    step_ms = stats.decode_s * 1e3 / max(stats.decode_steps, 1)
    print(f"tpmk: {runtime.engine} tp={runtime.tp} {runtime.resolved_device()}: start-up "
          f"{start_s:.1f} s, prefill {stats.prefill_s * 1e3:.0f} ms, {stats.decode_steps} decode "
          f"steps {step_ms:.1f} ms/step, {stats.new_tokens} new tokens "
          f"{stats.new_tokens / total_s:.1f} tok/s", file=sys.stderr)
    return 0


def _add_optional_parser(sub, name: str, module: str, hook: str, help: str) -> None:
    """A subcommand whose parser lives in another module; if that module is missing,
    the subcommand still shows in --help and fails with the import error."""
    import importlib
    try:
        add_parser = getattr(importlib.import_module(module), hook)
    except (ImportError, AttributeError) as e:
        p = sub.add_parser(name, help=f"{help} (unavailable: {e})")
        err = f"`tpmk {name}` is unavailable: {module}.{hook} could not be imported ({e})"

        def unavailable(args, err=err):
            raise ImportError(err)
        p.set_defaults(func=unavailable)
        return
    add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpmk", description="Tensor-parallel megakernel runtime for Llama decoding.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_generate_parser(sub)
    _add_optional_parser(sub, "make-checkpoint", "tpmk.checkpoint", "add_make_checkpoint_parser",
                         "write a random Hugging Face-compatible Llama checkpoint")
    _add_optional_parser(sub, "serve", "tpmk.serve.app", "add_serve_parser",
                         "OpenAI-compatible HTTP server")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except WorkerError as e:
        if e.input_error and not os.environ.get("TPMK_TRACEBACK"):
            # a rank refused its input (a wrong flag or checkpoint): the message says it all
            print(f"tpmk: error: rank {e.rank}: {e.message}\n(TPMK_TRACEBACK=1 shows the rank's "
                  f"traceback)", file=sys.stderr)
            return 2
        print(f"tpmk: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
        print(f"tpmk: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":   # python -m tpmk.cli, as python -m tpmk
    sys.exit(main())
