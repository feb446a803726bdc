"""Vocab-parallel sampling that gives the same token whatever the tp degree.

Every rank holds logits for its slice of the padded vocab ([B, Vl], rows
rank*Vl .. (rank+1)*Vl; ids >= vocab_size are padding and never chosen).

- greedy: each rank reduces its slice to (max, lowest index of the max); only
  those pairs are gathered, and the first rank holding the global max wins, so
  ties go to the lowest token id, as in torch.argmax over the full vocab.
- temperature: the same argmax over logits / T + Gumbel noise (Gumbel-max
  trick: an exact sample from softmax(logits / T)).
- top-k / top-p: each rank contributes its local top-k candidates (at most
  CANDIDATE_CAP when only top_p is set; among equal logits the lowest ids, so
  ties resolve the same whatever the tp); every rank sorts the gathered
  candidates by (logit desc, id asc), keeps the global top_k, then the
  smallest prefix whose probability mass reaches top_p, and takes the
  Gumbel-max among those. Identical on every rank, no full logits moved.

The noise is a counter-based hash of (seed, position, token id): row key
(seed, position) -> uniform(0, 1) for every token id of the whole vocab, so a
rank computes just its slice and the value at id i never depends on tp, the
device, or the batch. The same integer hash is cheap to compute inside a
CUDA kernel (the megakernel can draw identical noise).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpmk.engine.api import SamplingParams

CANDIDATE_CAP = 1024  # local candidates per rank when top_k == 0 and top_p < 1
_M32 = 0xFFFFFFFF
# lowbias32 multipliers (both < 2**31, so x * c of a 32-bit x fits in int64 exactly)
_C1, _C2 = 0x21F0AAAD, 0x735A2D97


def _mix32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 15)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The same bijective 32-bit mix as _mix32_int, on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 15)


def row_keys(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys for one (seed, position): the row's noise stream."""
    seed &= (1 << 64) - 1
    a = _mix32_int(_mix32_int(_mix32_int(seed & _M32) ^ (seed >> 32)) ^ (position & _M32))
    return a, _mix32_int(a ^ 0x5BD1E995)


def gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """keys [B, 2] int64 (row_keys), ids [B, N] or [N] int64 token ids -> [B, N] float32 Gumbel."""
    h = mix32(mix32(ids ^ keys[:, :1]) ^ keys[:, 1:])
    # 23 random bits -> odd multiple of 2**-24, exactly representable: u in (0, 1)
    u = ((h >> 9) * 2 + 1).float() * 2.0 ** -24
    return -torch.log(-torch.log(u))


def gather_ranks(local: torch.Tensor, group=None) -> torch.Tensor:
    """local [n_local, ...] (this process's ranks) -> [tp, ...] in rank order."""
    if group is None:
        return local
    world = dist.get_world_size(group)
    moved = local.cpu() if local.is_cuda and dist.get_backend(group) == "gloo" else local
    parts = [torch.empty_like(moved) for _ in range(world)]
    dist.all_gather(parts, moved.contiguous(), group=group)
    return torch.cat(parts).to(local.device)


def _argmax_pairs(score: torch.Tensor, offsets: torch.Tensor, group) -> torch.Tensor:
    """score [n, B, Vl] -> global argmax ids [B] (ties: lowest id), gathering (max, id) pairs."""
    local_ids = score.argmax(dim=-1)  # [n, B], first max within the slice
    local_max = score.gather(-1, local_ids[..., None])[..., 0]
    pairs = torch.stack([local_max, (local_ids + offsets[:, None]).float()], dim=-1)  # [n, B, 2]
    pairs = gather_ranks(pairs, group)  # [tp, B, 2]
    winner = pairs[..., 0].argmax(dim=0)  # first rank with the max = lowest id
    return pairs[winner, torch.arange(pairs.shape[1], device=pairs.device), 1].long()


def _truncated(z: torch.Tensor, ids: torch.Tensor, params: list[SamplingParams],
               keys: torch.Tensor, group) -> torch.Tensor:
    """top-k / top-p rows. z [n, Bt, Vl] masked logits, ids [n, Vl] global ids -> [Bt] ids."""
    dev = z.device
    ks = [p.top_k if p.top_k > 0 else CANDIDATE_CAP for p in params]
    kk = min(max(ks), z.shape[-1])
    # Local top-kk, taking the lowest ids among values equal to the kk-th (torch.topk leaves
    # that choice unspecified): the token then depends neither on tp nor on the backend, and
    # a row that is -inf outside the megakernel's top-TOPK candidates samples the same token.
    kth = z.topk(kk, dim=-1).values[..., -1:]
    above, tied = z > kth, z == kth
    take = above | (tied & (tied.cumsum(-1) <= kk - above.sum(-1, keepdim=True)))  # kk per row
    pos = (take * (z.shape[-1] - torch.arange(z.shape[-1], device=dev))).topk(kk, dim=-1).indices
    vals = z.gather(-1, pos)  # [n, Bt, kk]
    gid = torch.gather(ids[:, None, :].expand(-1, z.shape[1], -1), -1, pos)
    cands = gather_ranks(torch.stack([vals, gid.float()], dim=-1), group)  # [tp, Bt, kk, 2]
    cands = cands.permute(1, 0, 2, 3).reshape(z.shape[1], -1, 2)  # [Bt, tp*kk, 2]
    vals, gid = cands[..., 0], cands[..., 1].long()
    order = gid.argsort(dim=-1, stable=True)  # by id asc, then by logit desc (stable)
    vals, gid = vals.gather(-1, order), gid.gather(-1, order)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    gid = gid.gather(-1, order)
    rank_in_row = torch.arange(vals.shape[-1], device=dev)[None, :]
    k_row = torch.tensor(ks, device=dev)[:, None]
    temp = torch.tensor([p.temperature for p in params], device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    keep = (rank_in_row < k_row) & torch.isfinite(vals)
    scaled = (vals / temp).masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= (mass_before < top_p) | (rank_in_row == 0)
    score = (scaled + gumbel(keys, gid)).masked_fill(~keep, float("-inf"))
    return gid.gather(-1, score.argmax(dim=-1, keepdim=True))[:, 0]


def sample_vocab_parallel(local_logits: list[torch.Tensor], first_rank: int, vocab_size: int,
                          positions: list[int], sampling: list[SamplingParams],
                          group=None) -> list[int]:
    """One token per row from this process's logit slices (one [B, Vl] per local rank, ranks
    first_rank, first_rank+1, ...). With `group`, collectives run across processes; every
    process gets the same tokens."""
    B, vl = local_logits[0].shape
    if len(positions) != B or len(sampling) != B:
        raise ValueError(f"{B} logit rows but {len(positions)} positions and {len(sampling)} "
                         f"SamplingParams; give one of each per row")
    dev = local_logits[0].device
    n = len(local_logits)
    offsets = (first_rank + torch.arange(n, device=dev)) * vl  # [n]
    ids = offsets[:, None] + torch.arange(vl, device=dev)[None, :]  # [n, Vl]
    z = torch.stack([lg.float() for lg in local_logits])  # [n, B, Vl]
    z = z.masked_fill((ids >= vocab_size)[:, None, :], float("-inf"))
    out = torch.empty(B, dtype=torch.long, device=dev)
    is_plain = [s.greedy or (s.top_k == 0 and s.top_p == 1.0) for s in sampling]
    plain = [b for b in range(B) if is_plain[b]]
    trunc = [b for b in range(B) if not is_plain[b]]
    keys = None
    if any(not s.greedy for s in sampling):
        keys = torch.tensor([row_keys(s.seed, p) for s, p in zip(sampling, positions)],
                            dtype=torch.long, device=dev)  # [B, 2]
    if plain:
        idx = torch.tensor(plain, device=dev)
        score = z[:, idx]
        if any(not sampling[b].greedy for b in plain):
            temp = torch.tensor([sampling[b].temperature or 1.0 for b in plain], device=dev)
            noisy = torch.tensor([not sampling[b].greedy for b in plain], device=dev)
            noise = torch.stack([gumbel(keys[idx], ids[r]) for r in range(n)])  # [n, Bp, Vl]
            score = torch.where(noisy[None, :, None], score / temp[None, :, None] + noise, score)
        out[idx] = _argmax_pairs(score, offsets, group)
    if trunc:
        idx = torch.tensor(trunc, device=dev)
        out[idx] = _truncated(z[:, idx], ids, [sampling[b] for b in trunc], keys[idx], group)
    return out.tolist()


def sample(logits: torch.Tensor, positions: list[int],
           sampling: list[SamplingParams]) -> torch.Tensor:
    """Full logits [B, vocab] on one rank -> tokens [B] int64 (same tokens as any tp)."""
    toks = sample_vocab_parallel([logits], 0, logits.shape[-1], positions, sampling)
    return torch.tensor(toks, dtype=torch.long)


__all__ = ["CANDIDATE_CAP", "gather_ranks", "gumbel", "row_keys", "sample",
           "sample_vocab_parallel"]
