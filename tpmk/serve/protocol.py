"""OpenAI request checking and response shapes for /v1/completions and /v1/chat/completions.

Every bad request becomes an APIError whose body is OpenAI's error shape
{"error": {"message", "type", "param", "code"}}, the message naming the bad
value. Supported: max_tokens (chat also max_completion_tokens), temperature,
top_p, seed, stop, n=1, stream, stream_options.include_usage; extensions as
in vLLM: top_k, ignore_eos, return_token_ids.
"""
from __future__ import annotations

import json
import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from tpmk.engine.api import SamplingParams

MAX_STOP_STRINGS = 4
# A text prompt of more characters than this per token of --max-seq-len cannot fit (no Llama
# tokenizer has tokens that long), so it is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
SEED_LIMIT = 2 ** 63
_seed_rng = random.SystemRandom()


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class ModelInfo:
    """What request checking needs to know about the served model."""
    name: str                                  # the id clients put in "model"
    vocab_size: int
    max_seq_len: int
    encode: Callable[[str], list[int]]         # text -> ids, bos included
    render_chat: Callable[[list[dict]], list[int]]  # messages -> prompt ids


@dataclass
class GenerationRequest:
    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool


def _bad(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _number(body: dict, key: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"{key}={v!r} must be a number", key, "invalid_type")
    if isinstance(v, float) and not math.isfinite(v):   # json.loads takes NaN and Infinity
        raise _bad(f"{key}={v!r} must be a finite number", key, "invalid_value")
    if v > hi or v < lo or (lo_open and v == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _bad(f"{key}={v!r} is outside {rng}", key, "invalid_value")
    return float(v)


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{key}={v!r} must be an integer", key, "invalid_type")
    if v < lo or (hi is not None and v > hi):
        raise _bad(f"{key}={v} must be >= {lo}" + (f" and <= {hi}" if hi is not None else ""),
                   key, "invalid_value")
    return v


def _bool(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"{key}={v!r} must be true or false", key, "invalid_type")
    return v


def _reject_unsupported(body: dict) -> None:
    """Fields tpmk does not implement: refused unless they hold their no-op value."""
    noop = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False, 0),
            "top_logprobs": (0,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
            "logit_bias": ({},), "suffix": ("",), "tools": ([],)}
    for key, allowed in noop.items():
        v = body.get(key)
        if v is None or any(v == a and isinstance(v, bool) == isinstance(a, bool)
                            for a in allowed):
            continue
        what = "only n=1 is supported" if key in ("n", "best_of") else "is not supported by tpmk"
        raise _bad(f"{key}={json.dumps(v)}: {what}", key, "unsupported_parameter")


def _prompt_ids(body: dict, model: ModelInfo) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        ids = _encode(model.encode, p, model.max_seq_len, "prompt")
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in p):
        ids = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise _bad(f"prompt holds {len(p)} prompts; tpmk serves one prompt per request",
                   "prompt", "unsupported_parameter")
    else:
        raise _bad("prompt must be a non-empty string or a non-empty list of token ids, "
                   f"got {json.dumps(p)[:80]}", "prompt", "invalid_type")
    bad = [t for t in ids if not 0 <= t < model.vocab_size]
    if bad:
        raise _bad(f"prompt token id {bad[0]} is outside [0, {model.vocab_size}) "
                   f"(vocab_size of {model.name})", "prompt", "invalid_value")
    if not ids:
        raise _bad("prompt is empty after tokenization", "prompt", "invalid_value")
    return ids


def _chat_ids(body: dict, model: ModelInfo) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list of {role, content} objects",
                   "messages", "invalid_type")
    norm = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages",
                       "invalid_type")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(c, dict) and c.get("type") == "text"
                       and isinstance(c.get("text"), str) for c in content):
                raise _bad(f"messages[{i}].content: only text parts are supported",
                           "messages", "invalid_value")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string", "messages", "invalid_type")
        norm.append({"role": m["role"], "content": content})
    _check_chars(sum(len(m["content"]) for m in norm), model.max_seq_len, "messages")
    try:
        return model.render_chat(norm)
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        raise _bad(f"the chat template failed on these messages: {e}", "messages",
                   "invalid_value") from None


def _check_chars(chars: int, max_seq_len: int, param: str) -> None:
    """Refuse text that cannot fit before spending the time to tokenize it."""
    if chars > MAX_CHARS_PER_TOKEN * max_seq_len:
        raise _bad(f"the {param} holds {chars} characters, more than {MAX_CHARS_PER_TOKEN} per "
                   f"token of this model's maximum context length of {max_seq_len} tokens "
                   f"(--max-seq-len); shorten it", param, "context_length_exceeded")


def _encode(encode: Callable[[str], list[int]], text: str, max_seq_len: int, param: str) -> list[int]:
    """Tokenize text, refusing what cannot fit (_check_chars) or what the tokenizer refuses."""
    _check_chars(len(text), max_seq_len, param)
    try:
        return encode(text)
    except Exception as e:  # noqa: BLE001 - e.g. a lone surrogate ("\ud800") the tokenizer refuses
        raise _bad(f"the {param} could not be tokenized: {e}", param, "invalid_value") from None


def parse_generation(raw: bytes, chat: bool, model: ModelInfo) -> GenerationRequest:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_json")
    name = body.get("model")
    if name is not None and name != model.name:
        raise _bad(f"model {name!r} does not exist; this server serves {model.name!r}",
                   "model", "model_not_found")
    _reject_unsupported(body)
    ids = _chat_ids(body, model) if chat else _prompt_ids(body, model)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int(body, key, 1)
    room = model.max_seq_len - len(ids)
    if max_tokens is None:
        max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, room) if not chat else room
        if room < 1:
            max_tokens = 1  # report the overflow below with the numbers
    if len(ids) + max_tokens > model.max_seq_len:
        raise _bad(f"this model's maximum context length is {model.max_seq_len} tokens "
                   f"(--max-seq-len), but the request needs {len(ids) + max_tokens}: "
                   f"{len(ids)} in the prompt + {max_tokens} from {key}; shorten the prompt "
                   f"or lower {key}", "messages" if chat else "prompt", "context_length_exceeded")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) \
            or len(stop) > MAX_STOP_STRINGS:
        raise _bad(f"stop={json.dumps(body.get('stop'))[:80]} must be a non-empty string or a "
                   f"list of up to {MAX_STOP_STRINGS} non-empty strings", "stop", "invalid_value")
    seed = _int(body, "seed", 0, SEED_LIMIT - 1)
    top_k = _int(body, "top_k", -1)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k in (None, -1) or top_k >= model.vocab_size else top_k,   # >= vocab: all of it
        seed=seed if seed is not None else _seed_rng.randrange(2 ** 31))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options must be an object", "stream_options", "invalid_type")
    return GenerationRequest(
        chat=chat, prompt_ids=ids, max_tokens=max_tokens, sampling=sampling, stop=tuple(stop),
        stream=_bool(body, "stream"), include_usage=bool((opts or {}).get("include_usage")),
        ignore_eos=_bool(body, "ignore_eos"), return_token_ids=_bool(body, "return_token_ids"))


# ---- response shapes -----------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chunk(req: GenerationRequest, rid: str, model: str, created: int, text: str | None,
          finish_reason: str | None, first: bool = False, token_ids: list[int] | None = None) -> dict:
    """One SSE event of a streamed completion (text None: no content in this chunk)."""
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if req.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": created, "model": model, "choices": [choice]}


def usage_chunk(req: GenerationRequest, rid: str, model: str, created: int, n_out: int) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": created, "model": model, "choices": [],
            "usage": usage(len(req.prompt_ids), n_out)}


def full_response(req: GenerationRequest, rid: str, model: str, text: str,
                  token_ids: list[int], finish_reason: str) -> dict:
    if req.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    out = {"id": rid, "object": "chat.completion" if req.chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": [choice],
           "usage": usage(len(req.prompt_ids), len(token_ids))}
    if req.return_token_ids:
        choice["token_ids"] = token_ids
        out["prompt_token_ids"] = req.prompt_ids
    return out
