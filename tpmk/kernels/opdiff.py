"""Op-by-op diff of the CUDA megakernel against the CPU interpreter (stop after stage K).

Both run the same step with `stop_after = K` (instructions of later stages are
skipped) from identical zeroed buffers and KV caches; the first stage whose
buffers disagree beyond `rtol` names the op and layer to look at.
"""
from __future__ import annotations

import torch

from tpmk.kernels.interpreter import VM
from tpmk.kernels.megakernel import Megakernel

BUFFERS = ("x", "q", "attn_part", "attn_out", "act", "logits", "attn_slots", "mlp_slots")


def _snapshot_vm(vm: VM) -> list[dict]:
    return [{n: getattr(st, n).clone() for n in BUFFERS} | {"k_cache": st.k_cache.float().clone(),
                                                              "v_cache": st.v_cache.float().clone()}
            for st in vm.ranks]


def _snapshot_mk(mk: Megakernel) -> list[dict]:
    return [{n: buf[n].float().cpu() for n in BUFFERS} | {"k_cache": k.float().cpu(), "v_cache": v.float().cpu()}
            for buf, k, v in zip(mk.bufs, mk.k_caches, mk.v_caches)]


def _zero(vm: VM, mk: Megakernel) -> None:
    for st, buf, k, v in zip(vm.ranks, mk.bufs, mk.k_caches, mk.v_caches):
        for n in BUFFERS:
            getattr(st, n).zero_()
            buf[n].zero_()
        for t in (st.k_cache, st.v_cache, k, v):
            t.zero_()
        buf["counters"].zero_()
    vm.counters = [[0] * vm.sched.num_counters for _ in range(vm.tp)]
    vm.epoch = mk.epoch = 0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def diff_stages(vm: VM, mk: Megakernel, tokens, positions, pages, stages=None, rtol: float = 1e-3):
    """Yield (stage, stage name, {rank/buffer: relative error}) per stage; stops at the first bad one."""
    stages = range(len(mk.sched.stage_names)) if stages is None else stages
    for s in stages:
        _zero(vm, mk)
        vm.stop_after = s
        vm.step(tokens, positions, pages) if s == len(mk.sched.stage_names) - 1 else \
            _step_no_check(vm, tokens, positions, pages)
        mk.set_stop_after(s)
        mk.write_header(tokens, positions, pages)
        mk.launch()
        mk.check_error()
        errs = {}
        for r, (want, got) in enumerate(zip(_snapshot_vm(vm), _snapshot_mk(mk))):
            for n in want:
                errs[f"rank{r}/{n}"] = rel_err(got[n], want[n])
        yield s, mk.sched.stage_names[s], errs
        if max(errs.values()) > rtol:
            break
    vm.stop_after = -1
    mk.set_stop_after(-1)
    _zero(vm, mk)


def _step_no_check(vm: VM, tokens, positions, pages) -> None:
    """Interpreter step without the all-ranks-agree token check (argmax has not run)."""
    vm.set_header(tokens, positions, pages)
    import random
    vm._run_program(random.Random(0))
