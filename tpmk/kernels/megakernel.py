"""Host side of the CUDA megakernel: compile, buffers, step header, launch, error readout.

`Megakernel` holds every local rank's buffers (virtual TP: all tp ranks on one
GPU in one cooperative launch; `loopback=True`: one rank of a tp schedule
whose peer pointers all point at its own buffers, the per-rank speed proxy;
`group=`: one rank per process, peers' buffers mapped through CUDA IPC).
Buffers mirror the interpreter's `RankState`; the kernel arguments are
`isa.KernelArgs` (one struct per local rank, in device memory).
"""
from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import torch

from tpmk.config import ModelConfig
from tpmk.kernels import isa
from tpmk.kernels.isa import ATTN_CHUNK, BATCH_CHUNK, MMA_SMEM_WORDS, NTHREADS, NWARPS
from tpmk.rope import rope_inv_freq
from tpmk.kernels.schedule import Schedule
from tpmk.partition.weights import RankWeights, local_heads, padded_vocab

CSRC = Path(__file__).parent / "csrc"
HEAD_DIMS = (8, 16, 32, 64, 128, 256)          # attention.cuh: 8-wide output octets; a row is a
                                               # power-of-two count of 16-byte copies
SMEM_LIMIT = 227 * 1024 - 1024
PEER_ONLY = ("attn_slots", "mlp_slots", "cand", "xn", "xn_ssq")   # KernelArgs has only their peer_ tables


class SharedMemoryError(ValueError):
    """A schedule's bucket needs more shared memory than an SM has (check_shapes): smaller
    buckets of the same model may still fit."""


def _check(res, what: str):
    err = res[0]
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return res[1] if len(res) == 2 else res[1:]


def compile_megakernel(dtype: torch.dtype, arch: str = "sm_90a", defines: tuple[str, ...] = ()) -> bytes:
    """NVRTC -> cubin through tpmk.kernels.build (disk cache keyed by sources, options, NVRTC).
    `defines`: extra NAME=VALUE macros for tuning experiments (bench/decode.py --define); the
    environment's TPMK_MK_DEFINES (space-separated) are added to every build of the process,
    so the GPU tests can check a variant (bench/gpu_mk_check.sh)."""
    from tpmk.kernels.build import compile_to_cubin
    return compile_to_cubin(CSRC / "megakernel.cu", options=megakernel_options(dtype, defines), arch=arch)


def megakernel_options(dtype: torch.dtype, defines: tuple[str, ...] = ()) -> list[str]:
    """NVRTC options of a megakernel build: its dtype and kernel_macros(defines)."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"megakernel dtype={dtype} unsupported; use bfloat16 or float32")
    opts = ["-DMK_FLOAT32"] if dtype == torch.float32 else []
    return opts + [f"-D{d}" for d in kernel_macros(defines)]


def kernel_macros(defines: tuple[str, ...] = ()) -> tuple[str, ...]:
    """`defines` and the environment's TPMK_MK_DEFINES (space-separated), each checked to be
    NAME or NAME=VALUE: the macros of a megakernel build."""
    macros = (*defines, *os.environ.get("TPMK_MK_DEFINES", "").split())
    for d in macros:
        if not re.fullmatch(r"[A-Za-z_]\w*(=\S+)?", d):
            raise ValueError(f"kernel macro {d!r} is not NAME or NAME=VALUE")
    return macros


def act_and_gu_part(bucket: int, inter: int, gu_splits: int, dev) -> torch.Tensor:
    """act [bucket, inter] f32, a view of one allocation that also holds gate_up's K-slice
    partials right after it when the schedule splits gate_up (gu_part [gu_splits, bucket,
    2 inter], ops/act.cuh): no KernelArgs member of its own, so the default build compiles to
    the instructions it had before the split existed (bff8434's SASS)."""
    extra = gu_splits * bucket * 2 * inter if gu_splits > 1 else 0
    return torch.zeros(bucket * inter + extra, dtype=torch.float32, device=dev)[:bucket * inter].view(bucket, inter)


def out_words(sched: Schedule) -> int:
    """f32 words per batch row after linear()'s inputs: its outputs ([rows] of the largest tile)."""
    return max(2 * i.nrows if i.name in ("qkv", "gate_up") else i.nrows
               for i in sched.instructions if i.name in ("qkv", "gate_up", "lm_head", "o_proj", "down"))


def smem_bytes(cfg: ModelConfig, sched: Schedule, kmax: int, dtype: torch.dtype) -> int:
    """The least dynamic shared memory the ops need; the kernel is launched with it."""
    hq, hkv = local_heads(cfg, sched.tp)
    G, D = hq // hkv, cfg.head_dim
    # attention.cuh: q (f32, or bf16 [16, D + 8] for the tensor cores), scores, bf16
    # probabilities [16, ATTN_CHUNK + 8] (tensor-core P.V), m/l/alpha (padded to 4), two
    # chunks' page numbers, then the K/V chunk buffers (2 stages x K, V x attn_chunk rows of
    # D elements + 16 bytes), which the token phases' partial sums [NTHREADS // (G D / 8), G D]
    # reuse; then the last split's merge: split weights [G, S] (padded to 4), per-thread float4
    # sums
    row_bytes = D * dtype.itemsize + 16
    kv = max(isa.attn_chunk(D, dtype.itemsize, sched.bucket) * row_bytes, NTHREADS // (G * D // 8) * G * D)
    attn = (max(G * D, 8 * (D + 8)) + G * ATTN_CHUNK + 8 * (ATTN_CHUNK + 8) + ((3 * G + 3) & ~3)
            + 2 * isa.ATTN_PAGES + kv)
    merge = ((G * sched.num_splits + 3) & ~3) + 4 * max(NTHREADS, G * D // 4)
    # linear(): inputs, then outputs, of min(BATCH_CHUNK, bucket) rows (mk_linear.cuh)
    linear = min(BATCH_CHUNK, sched.bucket) * (kmax + out_words(sched))
    topk = 2 * NWARPS * isa.TOPK                   # argmax.cuh: per-warp (value, id) lists
    words = max(linear, attn, merge - NWARPS * BATCH_CHUNK, topk)
    # Shared memory is sized to the bucket and the rest is L1 (the carve-out hint in
    # Megakernel). Below MMA_MIN_BATCH: batch 1 at ctx 1024 of the 70B tp=8 rank, H200, 9.36 /
    # 9.40 ms against 9.84 with the tensor-core words at every bucket (same run, 2026-12-06).
    # Tensor-core buckets (staged outputs of bucket rows): batch 8 / 32 at ctx 1024, H100, 11.75
    # / 15.58 and 11.56 / 15.53 ms against 12.97 / 16.86 and 13.18 / 17.16 with all 128 rows.
    if dtype == torch.bfloat16 and sched.bucket >= isa.MMA_MIN_BATCH:
        words = max(words, mma_words(sched), residual_words(sched))   # batch >= MMA_MIN_BATCH
    return 4 * (NWARPS * BATCH_CHUNK + words)


def mma_words(sched: Schedule) -> int:
    """The tensor-core matvec's shared memory (mk_mma.cuh) at this bucket: its chunk buffers,
    then the staged outputs of one pass, nb <= bucket rows of the tallest tile."""
    return isa.MMA_OUT_AT + min(isa.MMA_OUT_WORDS, sched.bucket * out_words(sched))


def residual_words(sched: Schedule) -> int:
    """residual.cuh's staging at batch >= MMA_MIN_BATCH: two passes of rp <= bucket rows, each
    the tile's columns of its tp partials (and x unless the stage sets x), rp capped so that
    both fit MMA_SMEM_WORDS (the kernel's rule, by the bucket's rows)."""
    words = 0
    for i in sched.instructions:
        if i.name == "residual":
            rw = (sched.tp + (not i.arg1)) * i.nrows
            words = max(words, 2 * rw * min(sched.bucket, MMA_SMEM_WORDS // 2 // rw))
    return words


def check_shapes(cfg: ModelConfig, sched: Schedule, dtype: torch.dtype) -> tuple[int, int]:
    """Refuses what the kernel cannot run, naming the value; needs no GPU (Megakernel calls it
    before touching the device). Returns (kmax, dynamic shared-memory bytes)."""
    isa.check_vocab(cfg.vocab_size)
    hq, hkv = local_heads(cfg, sched.tp)
    D, H, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size // sched.tp
    for name, k in (("hidden_size", H), ("q_heads*head_dim", hq * D), ("intermediate/tp", inter)):
        if k % 8:
            raise ValueError(f"{name}={k} must be a multiple of 8 for 16-byte loads")
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim={D} is not supported by the megakernel's attention; "
                         f"supported: {HEAD_DIMS} (every Llama model uses 64 or 128)")
    if hq // hkv * D > 8 * NTHREADS:
        raise ValueError(f"{hq // hkv} query heads per kv head x head_dim={D} > {8 * NTHREADS}: "
                         f"attention keeps one 8-wide output octet per thread (NTHREADS="
                         f"{NTHREADS}); use a larger tp or a model with fewer heads per kv head")
    if sched.num_splits > isa.MAX_SPLITS:
        raise ValueError(f"num_splits={sched.num_splits} > {isa.MAX_SPLITS} (the split merge's lanes "
                         f"take {isa.MAX_SPLITS // 32} splits each)")
    kmax = max(H, hq * D, inter)
    smem = smem_bytes(cfg, sched, kmax, dtype)
    if smem > SMEM_LIMIT:
        raise SharedMemoryError(f"megakernel needs {smem} B of shared memory at batch bucket {sched.bucket} "
                         f"(tp={sched.tp}, longest row kmax={kmax}), over {SMEM_LIMIT}; run smaller "
                         f"buckets (--megakernel-max-batch or --max-batch below {sched.bucket}) or a "
                         f"larger --tp")
    return kmax, smem


class Megakernel:
    def __init__(self, cfg: ModelConfig, sched: Schedule, shards: list[RankWeights],
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 loopback: bool = False, timeout_s: float = 5.0, profile: bool = False,
                 max_pages_per_seq: int = 0, defines: tuple[str, ...] = (), group=None):
        """Virtual TP: all tp shards in this process, one cooperative launch on one GPU.
        loopback: one rank alone, peers' slots looped back to its own (benchmarks).
        group: one rank per process (a torch.distributed group whose rank i is TP rank i, gloo
        is enough): the buffers peers write live in one tpmk.comm.region.PeerRegion whose
        CUDA IPC handle every rank opens, and the kernel uses system-scope
        release/acquire (MK_SYS_SCOPE) so it also holds across GPUs."""
        from cuda.bindings import driver as cu
        self.cu, self.cfg, self.sched, self.group = cu, cfg, sched, group
        self._region = None
        n_local = len(shards)
        if group is not None:
            import torch.distributed as dist
            world, me = dist.get_world_size(group), dist.get_rank(group)
            if loopback or n_local != 1 or world != sched.tp or shards[0].rank != me:
                raise ValueError(f"one rank per process: pass this rank's shard only (got {n_local}), "
                                 f"a group of tp={sched.tp} processes (got {world}) whose rank "
                                 f"{me} holds shard {shards[0].rank}, and loopback=False")
            defines = (*defines, "MK_SYS_SCOPE")
        elif not loopback and n_local != sched.tp:
            raise ValueError(f"virtual TP needs all tp={sched.tp} shards in one process, got {n_local}")
        if sched.gu_splits > 1:   # the K-split gate_up's code only where a schedule uses it
            defines = (*defines, "MK_GU_SPLIT")
        if loopback and sched.reduce != "oneshot":
            raise ValueError(f"loopback runs one rank alone, but reduce={sched.reduce!r} needs the "
                             f"other ranks' owner tiles; build the schedule with reduce='oneshot'")
        dtype = shards[0].qkv.dtype
        kmax, self.smem = check_shapes(cfg, sched, dtype)
        dev = k_caches[0].device
        if dev.type != "cuda":
            raise ValueError(f"the megakernel needs CUDA tensors, got caches on {dev}")
        props = torch.cuda.get_device_properties(dev)
        if props.major != 9:
            raise RuntimeError(f"the megakernel is built for sm_90a (Hopper); {props.name} is "
                               f"sm_{props.major}{props.minor}")
        if n_local * sched.num_sms > props.multi_processor_count:
            raise ValueError(f"{n_local} ranks x {sched.num_sms} SMs per rank > "
                             f"{props.multi_processor_count} SMs on {props.name}")
        hq, hkv = local_heads(cfg, sched.tp)
        D, H, B = cfg.head_dim, cfg.hidden_size, sched.bucket
        inter, vp = cfg.intermediate_size // sched.tp, padded_vocab(cfg, sched.tp) // sched.tp
        f32 = dict(device=dev, dtype=torch.float32)
        words, starts = sched.encode()
        self.instructions, self.queue_start = words.to(dev), starts.to(dev)
        self.max_pages = max_pages_per_seq or k_caches[0].shape[1]
        self.page_size, self.num_pages = k_caches[0].shape[3], k_caches[0].shape[1]
        self.header_cpu = torch.zeros(isa.header_words(B, self.max_pages), dtype=torch.int32).pin_memory()
        self.header = torch.zeros_like(self.header_cpu, device=dev)
        self.error = torch.zeros(isa.ERROR_WORDS, dtype=torch.int32, device=dev)
        self.inv_freq = rope_inv_freq(cfg).to(dev)
        self.shards, self.k_caches, self.v_caches = shards, k_caches, v_caches
        # What peers write (and x, which an all-gather writes): torch tensors, or views of one
        # IPC-exportable region per process.
        # xn: the tensor cores' input (x times the next norm's weight) as bf16 bits.
        shared = dict(x=((B, H), torch.float32), xn=((B, H), torch.int16),
                      xn_ssq=((B, sched.n_h_tiles), torch.float32),
                      counters=((sched.num_counters * isa.COUNTER_STRIDE,), torch.int32),
                      attn_slots=((sched.tp, B, H), torch.float32), mlp_slots=((sched.tp, B, H), torch.float32),
                      cand=(isa.cand_shape(sched.tp, sched.n_lm_tiles, B), torch.float32))
        if group is not None:   # one rank per process (n_local == 1, checked above): one region
            from tpmk.comm.region import PeerRegion
            self._region = PeerRegion(shared, dev, group)
        self.bufs = []
        for _ in range(n_local):
            peer_written = self._region.tensors if self._region is not None else {
                k: torch.zeros(shape, dtype=dt, device=dev) for k, (shape, dt) in shared.items()}
            self.bufs.append(dict(
                q=torch.zeros(B, hq * D, **f32),
                attn_part=torch.zeros(B, hq, sched.num_splits, D + 2, **f32),
                attn_out=torch.zeros(B, hq * D, **f32),
                act=act_and_gu_part(B, inter, sched.gu_splits, dev), logits=torch.zeros(B, vp, **f32),
                attn_bf=torch.zeros(B, hq * D, device=dev, dtype=torch.bfloat16),
                act_bf=torch.zeros(B, inter, device=dev, dtype=torch.bfloat16),
                tokens_out=torch.zeros(B, dtype=torch.int32, device=dev),
                topk_values=torch.zeros(B, isa.TOPK, **f32),
                topk_ids=torch.zeros(B, isa.TOPK, dtype=torch.int32, device=dev),
                profile=torch.zeros(len(sched.instructions) * 2, dtype=torch.int64, device=dev)
                if profile else None, **peer_written))
        peer_bases = self._region.open_peers() if group is not None else None
        self.args = [isa.KernelArgs() for _ in range(n_local)]
        for i, (a, w, buf) in enumerate(zip(self.args, shards, self.bufs)):
            rank = w.rank
            ptrs = dict(embed=w.embed, lm_head=w.lm_head, final_norm=w.final_norm, input_norm=w.input_norm,
                        qkv=w.qkv, o_proj=w.o_proj, post_norm=w.post_norm, gate_up=w.gate_up, down=w.down,
                        k_cache=k_caches[i], v_cache=v_caches[i], rope_inv_freq=self.inv_freq,
                        header=self.header, instructions=self.instructions, queue_start=self.queue_start,
                        error=self.error, **{k: v for k, v in buf.items() if k not in PEER_ONLY})
            for k, t in ptrs.items():
                if t is not None and not t.is_contiguous():
                    raise ValueError(f"rank {rank}: {k} must be contiguous")
                assert hasattr(isa.KernelArgs, k), f"buffer {k} is not a KernelArgs field"
                setattr(a, k, 0 if t is None else t.data_ptr())
            for p in range(sched.tp):
                if peer_bases is not None:   # rank p's region, mapped here; same layout as ours
                    ptr = {k: peer_bases[p] + self._region.offsets[k] for k in shared}
                else:
                    peer = buf if loopback else self.bufs[p]
                    ptr = {k: peer[k].data_ptr() for k in shared}
                a.peer_counters[p], a.peer_attn_slots[p] = ptr["counters"], ptr["attn_slots"]
                a.peer_mlp_slots[p], a.peer_cand[p], a.peer_x[p] = ptr["mlp_slots"], ptr["cand"], ptr["x"]
                a.peer_xn[p], a.peer_xn_ssq[p] = ptr["xn"], ptr["xn_ssq"]
            a.timeout_ns = int(timeout_s * 1e9)
            a.rank, a.tp, a.num_sms, a.bucket = rank, sched.tp, sched.num_sms, B
            a.num_layers, a.hidden, a.q_heads, a.kv_heads = cfg.num_hidden_layers, H, hq, hkv
            a.head_dim, a.inter, a.vocab_local, a.vocab_size = D, inter, vp, cfg.vocab_size
            a.page_size, a.num_pages, a.max_pages = self.page_size, self.num_pages, self.max_pages
            a.num_splits, a.n_lm_tiles, a.n_h_tiles = sched.num_splits, sched.n_lm_tiles, sched.n_h_tiles
            a.num_instructions, a.kmax, a.stop_after = len(sched.instructions), kmax, -1
            a.eps, a.attn_scale = cfg.rms_norm_eps, D ** -0.5
            a.attn_chunk = isa.attn_chunk(D, dtype.itemsize, B)
        self._upload_args()
        cubin = compile_megakernel(dtype, defines=defines)
        self.module = _check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.fn = _check(cu.cuModuleGetFunction(self.module, b"megakernel"), "cuModuleGetFunction")
        static = _check(cu.cuFuncGetAttribute(
            cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self.fn), "cuFuncGetAttribute")
        optin = _check(cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev.index), "cuDeviceGetAttribute")
        if optin - static < self.smem:
            raise ValueError(f"megakernel needs {self.smem} B of dynamic shared memory, the device "
                             f"allows {optin - static} B; lower BATCH_CHUNK or tile sizes")
        _check(cu.cuFuncSetAttribute(
            self.fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            self.smem), "cuFuncSetAttribute")
        # The least carve-out (percent of 228 KB) that holds the CTA's shared memory: the rest
        # is L1. A 100 % carve-out was slower at batch 1 (9.56 vs 9.04-9.23 ms, H200).
        carve = min(100, -(-100 * (self.smem + static + 1024) // (228 * 1024)))
        _check(cu.cuFuncSetAttribute(
            self.fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            carve), "cuFuncSetAttribute")
        self.n_local, self.epoch, self.batch = n_local, 0, 0

    def close(self) -> None:
        """Per-process mode: collective (no rank unmaps a region a peer may still write)."""
        if self._region is not None:
            torch.cuda.synchronize(self.header.device)
            self._region.close()
            self._region = None

    def _upload_args(self) -> None:
        raw = b"".join(bytes(a) for a in self.args)
        self.args_dev = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.header.device)

    def set_stop_after(self, stage: int) -> None:
        """Debug: skip every instruction of a stage after `stage` (-1: run everything)."""
        for a in self.args:
            a.stop_after = stage
        self._upload_args()

    def write_header(self, tokens, positions, pages) -> None:
        B = len(tokens)
        if not 1 <= B <= self.sched.bucket:
            raise ValueError(f"batch={B} must be in 1..bucket={self.sched.bucket}")
        tok_off, pos_off, page_off = isa.header_offsets(self.sched.bucket)
        h = self.header_cpu
        self.epoch += 1
        h.zero_()
        h[isa.HeaderField.EPOCH], h[isa.HeaderField.BATCH] = self.epoch, B
        h[tok_off:tok_off + B] = torch.tensor(tokens, dtype=torch.int32)
        h[pos_off:pos_off + B] = torch.tensor(positions, dtype=torch.int32)
        for b, p in enumerate(pages):
            if len(p) > self.max_pages:
                raise ValueError(f"sequence {b}: {len(p)} pages > max_pages_per_seq={self.max_pages}")
            if len(p) * self.page_size <= positions[b]:
                raise ValueError(f"sequence {b}: position {positions[b]} is past its {len(p)} pages")
            if p and not 0 <= min(p) <= max(p) < self.num_pages:
                raise ValueError(f"sequence {b}: page ids {p} outside 0..{self.num_pages - 1}")
            h[page_off + b * self.max_pages:page_off + b * self.max_pages + len(p)] = torch.tensor(p, dtype=torch.int32)
        self.header.copy_(h, non_blocking=True)
        self.batch = B

    def launch(self) -> None:
        cu = self.cu
        stream = cu.CUstream(torch.cuda.current_stream(self.header.device).cuda_stream)
        grid = self.n_local * self.sched.num_sms
        params = ((self.args_dev.data_ptr(), self.sched.num_sms), (ctypes.c_void_p, ctypes.c_int))
        _check(cu.cuLaunchCooperativeKernel(self.fn, grid, 1, 1, NTHREADS, 1, 1, self.smem, stream, params),
               "cuLaunchCooperativeKernel")

    def step(self, tokens, positions, pages) -> torch.Tensor:
        """One decode step of every local rank; returns tokens [batch] (int32, on the GPU)."""
        self.write_header(tokens, positions, pages)
        self.launch()
        self.check_error()
        return self.bufs[0]["tokens_out"][:self.batch]

    def check_error(self) -> None:
        err = self.error.tolist()   # synchronizes
        if err[isa.ErrorField.FLAG] == 0:
            return
        E = isa.ErrorField
        op = isa.Opcode(err[E.OPCODE]).name if err[E.OPCODE] in iter(isa.Opcode) else err[E.OPCODE]
        cid = err[E.COUNTER]
        cname = self.sched.counter_names[cid] if 0 <= cid < len(self.sched.counter_names) else cid
        what = {1: "timed out waiting", 2: "hit an unknown opcode"}.get(err[E.FLAG], f"flag {err[E.FLAG]}")
        msg = (f"megakernel {what}: rank {err[E.RANK]}, SM {err[E.SM]}, opcode {op}, layer {err[E.LAYER]}, "
               f"tile {err[E.TILE]}, instruction {err[E.INSTR]}, counter {cname} = {err[E.VALUE] & 0xffffffff} "
               f"< expected {err[E.EXPECTED] & 0xffffffff} (epoch {self.epoch})")
        if err[E.FLAG] == 1:   # the first waiter to time out may be downstream of the stall
            counters = {a.rank: buf["counters"].view(-1, isa.COUNTER_STRIDE)[:, 0].tolist()
                        for a, buf in zip(self.args, self.bufs)}
            msg += f"; first unmet wait: {self.sched.first_unmet_wait(counters, self.epoch)}"
        self.error.zero_()
        for buf in self.bufs:   # counters are inconsistent after an abort: start over
            buf["counters"].zero_()
        self.epoch = 0
        raise RuntimeError(msg)

    def logits(self) -> torch.Tensor:
        """[batch, vocab_size] float32 from every rank's vocab slice (gathered over the group
        in per-process mode; on the CPU when the group is gloo)."""
        local = [b["logits"][:self.batch] for b in self.bufs]
        if self.group is not None:
            import torch.distributed as dist
            mine = local[0].cpu() if dist.get_backend(self.group) == "gloo" else local[0].contiguous()
            local = [torch.empty_like(mine) for _ in range(self.sched.tp)]
            dist.all_gather(local, mine, group=self.group)
        return torch.cat(local, dim=1)[:, :self.cfg.vocab_size]

    def topk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-TOPK from the ARGMAX op (local rank 0's copy, on the GPU): values
        [batch, TOPK] f32, ids [batch, TOPK] int64; value descending, then id ascending."""
        buf = self.bufs[0]
        return buf["topk_values"][:self.batch].clone(), buf["topk_ids"][:self.batch].long()

    def profile_trace(self) -> list[dict]:
        """Chrome-trace events (one per executed instruction, per rank / SM)."""
        events = []
        for r, buf in enumerate(self.bufs):
            if buf["profile"] is None:
                raise ValueError("construct Megakernel(profile=True) to record timestamps")
            ts = buf["profile"].view(-1, 2).tolist()
            t0 = min(s for s, _ in ts if s > 0)
            for sm in range(self.sched.num_sms):
                for i in range(self.sched.queue_start[sm], self.sched.queue_start[sm + 1]):
                    s, e = ts[i]
                    if s and e:
                        ins = self.sched.instructions[i]
                        events.append(dict(name=f"{ins.name} L{ins.layer} t{ins.tile}", ph="X", pid=r, tid=sm,
                                           ts=(s - t0) / 1e3, dur=(e - s) / 1e3,
                                           args=dict(stage=ins.arg4)))
        return events
