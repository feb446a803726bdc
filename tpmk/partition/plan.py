"""ShardPlan: which slice of which Hugging Face tensor each rank holds, and where it goes.

Every tensor of a LlamaForCausalLM checkpoint is one of
  column     q/k/v (by heads), gate/up (by rows of intermediate_size): a row range
  row        o_proj, down_proj: a column range; the output is a partial sum
  vocab      embed_tokens, lm_head: a row range of the vocab padded to padded_vocab(cfg, tp)
  replicated norms: the whole tensor
A `TensorShard` names the slice (rows / cols of the full tensor) and its destination
(a RankWeights field, a layer, a row offset inside the fused QKV / gate_up rows).
The same plan drives `shard_state_dict` (tensors in memory) and the lazy loader
(safetensors `get_slice`, so a rank reads only its slices).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpmk.config import ModelConfig
from tpmk.partition.weights import RankWeights, local_heads, padded_vocab

KINDS = ("column", "row", "replicated", "vocab")
# Tensors some checkpoints carry that tpmk recomputes or does not need.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorShard:
    name: str                        # HF tensor name
    kind: str                        # column | row | replicated | vocab
    shape: tuple[int, ...]           # expected shape of the full tensor
    dst: str                         # RankWeights field
    layer: int | None = None         # index into the stacked [L, ...] field
    dst_row: int = 0                 # first row inside the (fused) destination
    rows: tuple[int, int] | None = None  # [start, stop) along dim 0 of the full tensor
    cols: tuple[int, int] | None = None  # [start, stop) along dim 1 of the full tensor

    def take(self, src) -> torch.Tensor:
        """The local slice of `src`: a torch tensor or a safetensors slice (get_slice)."""
        if self.rows is not None:
            return src[self.rows[0]:self.rows[1]]
        if self.cols is not None:
            return src[:, self.cols[0]:self.cols[1]]
        return src[:]

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.rows is not None:
            return (self.rows[1] - self.rows[0], *self.shape[1:])
        if self.cols is not None:
            return (self.shape[0], self.cols[1] - self.cols[0])
        return self.shape


@dataclass
class ShardPlan:
    cfg: ModelConfig
    tp: int
    rank: int
    tensors: list[TensorShard] = field(default_factory=list)

    @property
    def by_name(self) -> dict[str, TensorShard]:
        return {t.name: t for t in self.tensors}

    def allowed_extra(self, name: str) -> bool:
        """Present in some checkpoints, never read: tied lm_head copies, rotary caches."""
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return True
        return name.endswith(IGNORED_SUFFIXES)

    def check_tensors(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Raise on a missing, unexpected or misshaped tensor (each named)."""
        expected = self.by_name
        missing = [n for n in expected if n not in shapes]
        if missing:
            raise ValueError(f"checkpoint is missing tensor {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                             + f" expected by config {self.cfg.name!r}")
        extra = [n for n in shapes if n not in expected and not self.allowed_extra(n)]
        if extra:
            raise ValueError(f"checkpoint has unexpected tensor {extra[0]!r}"
                             + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                             + " that a LlamaForCausalLM of this config does not have")
        for n, t in expected.items():
            if tuple(shapes[n]) != t.shape:
                raise ValueError(f"tensor {n!r} has shape {tuple(shapes[n])}, expected {t.shape} "
                                 f"from config.json")

    def empty_weights(self, dtype: torch.dtype, device="cpu") -> RankWeights:
        """Zero-filled RankWeights of this rank's shapes (zeros: vocab pad rows stay zero)."""
        cfg, tp = self.cfg, self.tp
        hq, hkv = local_heads(cfg, tp)
        H, D, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
        inter, vp = cfg.intermediate_size // tp, padded_vocab(cfg, tp) // tp
        z = lambda *s: torch.zeros(s, dtype=dtype, device=device)
        embed = z(vp, H)
        return RankWeights(
            rank=self.rank, tp=tp, embed=embed,
            lm_head=embed if cfg.tie_word_embeddings else z(vp, H),
            final_norm=z(H), input_norm=z(L, H), qkv=z(L, (hq + 2 * hkv) * D, H),
            o_proj=z(L, H, hq * D), post_norm=z(L, H), gate_up=z(L, 2 * inter, H),
            down=z(L, H, inter))

    def place(self, w: RankWeights, t: TensorShard, piece: torch.Tensor) -> None:
        """Copy one local slice into its destination inside `w` (dtype/device converted)."""
        buf = getattr(w, t.dst)
        if t.layer is not None:
            buf = buf[t.layer]
        buf[t.dst_row:t.dst_row + piece.shape[0]].copy_(piece)


def build_shard_plan(cfg: ModelConfig, tp: int, rank: int) -> ShardPlan:
    """Every HF tensor name -> its kind, expected shape, local slice and destination."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank={rank} is out of range for tp={tp}")
    hq, hkv = local_heads(cfg, tp)  # raises "tp=3 does not divide num_attention_heads=..."
    if cfg.intermediate_size % tp:
        raise ValueError(f"tp={tp} does not divide intermediate_size={cfg.intermediate_size}")
    H, D, L, V = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads
    inter = cfg.intermediate_size // tp
    vp = padded_vocab(cfg, tp) // tp
    # KV heads: split when tp <= kv; otherwise replicated, rank r holds head r * kv // tp.
    kv0 = rank * hkv if kv >= tp else rank * kv // tp
    q_rows = (rank * hq * D, (rank + 1) * hq * D)
    kv_rows = (kv0 * D, (kv0 + hkv) * D)
    i_rows = (rank * inter, (rank + 1) * inter)
    v_rows = (min(rank * vp, V), min((rank + 1) * vp, V))  # real rows; the rest is zero padding

    ts: list[TensorShard] = [
        TensorShard("model.embed_tokens.weight", "vocab", (V, H), "embed", rows=v_rows),
        TensorShard("model.norm.weight", "replicated", (H,), "final_norm"),
    ]
    if not cfg.tie_word_embeddings:
        ts.append(TensorShard("lm_head.weight", "vocab", (V, H), "lm_head", rows=v_rows))
    for i in range(L):
        p = f"model.layers.{i}."
        ts += [
            TensorShard(p + "input_layernorm.weight", "replicated", (H,), "input_norm", i),
            TensorShard(p + "self_attn.q_proj.weight", "column", (cfg.q_size, H), "qkv", i,
                        0, rows=q_rows),
            TensorShard(p + "self_attn.k_proj.weight", "column", (cfg.kv_size, H), "qkv", i,
                        hq * D, rows=kv_rows),
            TensorShard(p + "self_attn.v_proj.weight", "column", (cfg.kv_size, H), "qkv", i,
                        (hq + hkv) * D, rows=kv_rows),
            TensorShard(p + "self_attn.o_proj.weight", "row", (H, cfg.q_size), "o_proj", i,
                        cols=q_rows),
            TensorShard(p + "post_attention_layernorm.weight", "replicated", (H,), "post_norm", i),
            TensorShard(p + "mlp.gate_proj.weight", "column", (cfg.intermediate_size, H),
                        "gate_up", i, 0, rows=i_rows),
            TensorShard(p + "mlp.up_proj.weight", "column", (cfg.intermediate_size, H),
                        "gate_up", i, inter, rows=i_rows),
            TensorShard(p + "mlp.down_proj.weight", "row", (H, cfg.intermediate_size), "down", i,
                        cols=i_rows),
        ]
    return ShardPlan(cfg, tp, rank, ts)


def shard_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int,
                     dtype: torch.dtype | None = None) -> RankWeights:
    """One rank's RankWeights from an in-memory HF LlamaForCausalLM state dict.

    dtype: of the result; None keeps the state dict's (the embedding's) dtype.
    """
    plan = build_shard_plan(cfg, tp, rank)
    plan.check_tensors({n: tuple(t.shape) for n, t in state_dict.items()})
    dtype = dtype or state_dict["model.embed_tokens.weight"].dtype
    w = plan.empty_weights(dtype)
    with torch.no_grad():
        for t in plan.tensors:
            plan.place(w, t, t.take(state_dict[t.name]))
    return w


__all__ = ["KINDS", "ShardPlan", "TensorShard", "build_shard_plan", "shard_state_dict"]
