"""tpmk.comm: arena layout, handle exchange, error path (CPU); all-reduce on a GPU vs
float64 and an independent fp32 rank-order sum (GPU tests, marked)."""
import ctypes
import json
import time

import pytest
import torch
import torch.multiprocessing as mp

from tpmk.comm import handles, topology
from tpmk.comm.arena import ERROR_RECORD, FLAG_KINDS, FLAG_LINE, ArenaLayout, ErrorInfo

import _comm_workers


# ---------------------------------------------------------------- CPU: layout -------
@pytest.mark.parametrize("world_size,blocks", [(1, 1), (2, 32), (8, 16), (3, 5)])
def test_arena_layout_flags_own_lines_and_regions_disjoint(world_size, blocks):
    L = ArenaLayout(world_size, blocks, 1 << 20)
    offs = [L.flag_offset(k, b, s) for k in range(len(FLAG_KINDS)) for b in range(blocks)
            for s in range(world_size)]
    assert len(set(o // FLAG_LINE for o in offs)) == len(offs)      # one 128-byte line each
    assert all(o % FLAG_LINE == 0 for o in offs)
    assert max(offs) + FLAG_LINE <= L.epochs_offset
    assert L.epochs_offset + 8 * blocks <= L.data_offset and L.data_offset % 4096 == 0
    slots = sorted(L.slot_offset(p, s) for p in (0, 1) for s in range(world_size + 1))
    assert slots[0] == L.data_offset
    assert all(b - a == L.slot_bytes for a, b in zip(slots, slots[1:]))   # no overlap
    assert slots[-1] + L.slot_bytes == L.nbytes
    assert L.chunk_elems * 2 == L.slot_bytes


@pytest.mark.parametrize("bad", [dict(world_size=9), dict(world_size=0), dict(max_blocks=0),
                                 dict(slot_bytes=1000), dict(slot_bytes=4096 + 16)])
def test_arena_layout_rejects_bad_values(bad):
    kw = dict(world_size=2, max_blocks=4, slot_bytes=4096) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        ArenaLayout(**kw)


def test_kernel_params_struct_matches_cuda_source():
    from tpmk.comm.allreduce import _Params, source_params_fields
    names, size = source_params_fields()
    assert names == [f[0] for f in _Params._fields_]
    assert size == ctypes.sizeof(_Params)


def test_error_record_matches_cuda_source():
    from tpmk.kernels.build import CSRC
    text = (CSRC / "comm.cuh").read_text()
    assert f"sizeof(ErrorRecord) == {ERROR_RECORD.size}" in text
    body = text[text.index("struct ErrorRecord {"):text.index("};", text.index("struct ErrorRecord {"))]
    fields = [line.split(";")[0].split()[-1] for line in body.splitlines()[1:] if ";" in line]
    assert fields == ["status", "rank", "peer", "flag", "block", "pad", "expected", "seen"]


# ---------------------------------------------------------------- CPU: error path ---
def test_error_info_decodes_and_names_the_values():
    raw = ERROR_RECORD.pack(1, 3, 2, 1, 7, 0, 42, 41)
    info = ErrorInfo.from_bytes(raw)
    assert (info.rank, info.peer, info.flag, info.block, info.expected, info.seen) == (3, 2, 1, 7, 42, 41)
    msg = info.message(0.5)
    for s in ("rank 3", "rank 2", "'gather'", "block 7", ">= 42", "saw 41", "0.5 s"):
        assert s in msg, (s, msg)


class _FakeErrorBlock:
    def __init__(self, raw):
        self.raw, self.alarmed = raw, False

    def read(self):
        return ErrorInfo.from_bytes(self.raw)


def _host_only_comm(raw):
    """A Communicator without a GPU: only the host-side error logic is exercised."""
    from tpmk.comm.allreduce import Communicator
    c = object.__new__(Communicator)
    c.error, c.broken, c.timeout_s, c.device = _FakeErrorBlock(raw), None, 0.25, 0
    return c


def test_alarm_raises_comm_error_once_then_stays_broken(monkeypatch):
    from tpmk.comm.allreduce import CommError
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    c = _host_only_comm(ERROR_RECORD.pack(1, 0, 1, 0, 0, 0, 5, 4))
    c._raise_if_alarmed()                           # no alarm: nothing
    c.error.alarmed = True                          # kernel raised the host alarm word
    with pytest.raises(CommError, match="rank 0 timed out .* waiting for rank 1") as e:
        c._raise_if_alarmed()
    assert e.value.info.expected == 5 and e.value.info.seen == 4
    c.error.alarmed = False
    with pytest.raises(CommError):                  # broken for good: no silent reuse
        c._raise_if_alarmed()


def test_check_raises_on_record_without_alarm(monkeypatch):
    from tpmk.comm.allreduce import CommError
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    c = _host_only_comm(ERROR_RECORD.pack(1, 2, 3, 0, 1, 0, 9, 8))
    with pytest.raises(CommError, match="rank 2 timed out"):
        c.check()
    ok = _host_only_comm(ERROR_RECORD.pack(0, 0, 0, 0, 0, 0, 0, 0))
    ok.check()


# ---------------------------------------------------------------- CPU: handles ------
def _records(n, over=None):
    recs = [handles.PeerRecord(r, n, "h", 100 + r, f"bus{r}", (n, 4, 4096, 1), b"\0" * 64)
            for r in range(n)]
    for r, kw in (over or {}).items():
        recs[r] = handles.PeerRecord(**(recs[r].__dict__ | kw))
    return recs


def test_validate_records_accepts_consistent_world():
    handles.validate_records(_records(4), 1, 4)


@pytest.mark.parametrize("over,match", [
    ({2: dict(layout=(4, 8, 4096, 1))}, "layout differs"),
    ({1: dict(host="other")}, "one node"),
    ({3: dict(pid=100)}, "share a process"),
    ({2: dict(rank=3)}, "claims rank 3"),
    ({0: dict(world_size=2)}, "world_size=2"),
    ({1: dict(handle=b"x")}, "1-byte IPC handle"),
])
def test_validate_records_rejects(over, match):
    with pytest.raises(ValueError, match=match):
        handles.validate_records(_records(4, over), 0, 4)


def test_handle_exchange_over_gloo(tmp_path):
    world = 3
    mp.spawn(_comm_workers.exchange_worker, args=(world, str(tmp_path / "init"), str(tmp_path)),
             nprocs=world, join=True)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    expect = [[r, f"0000:{r:02x}:00.0", (bytes([r]) * 64).hex()] for r in range(world)]
    assert all(s == expect for s in seen)


def test_topology_refuses_pairs_without_peer_access():
    ids = {"a": 0, "b": 1, "c": 2}
    deny = lambda x, y: {x, y} != {0, 2}          # noqa: E731 - GPUs 0 and 2 lack P2P
    topology.require_peer_access("a", ["a", "b"], deny, ids.get)
    topology.require_peer_access("a", ["a", "a"], deny, ids.get)    # same GPU: fine
    with pytest.raises(topology.PeerAccessError, match="GPU a cannot access GPU c"):
        topology.require_peer_access("a", ["a", "b", "c"], deny, ids.get)
    with pytest.raises(topology.PeerAccessError, match="not visible"):
        topology.require_peer_access("a", ["a", "zz"], deny, ids.get)


def test_pick_algo():
    from tpmk.comm.allreduce import pick_algo
    assert pick_algo(16384, 256 << 10) == "one_shot"
    assert pick_algo(16 << 20, 256 << 10) == "two_shot"


# ---------------------------------------------------------------- GPU ---------------
def _inputs(world, n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(n, device="cuda", generator=g) * (r + 1)).to(torch.bfloat16) for r in range(world)]


def _assert_allreduce(xs, outs):
    """Bit-identical on every rank; equal to an fp32 rank-order sum rounded once (an
    independent torch computation); within bf16 rounding of the float64 sum."""
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc += x.float()
    exact = acc.to(torch.bfloat16)
    ref = sum(x.double() for x in xs)
    tol = 2.0 ** -8 * ref.abs() + len(xs) * 2.0 ** -24 * sum(x.double().abs() for x in xs) + 1e-30
    for r, o in enumerate(outs):
        assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16)), f"rank {r} differs from rank 0"
    assert torch.equal(outs[0].view(torch.int16), exact.view(torch.int16)), \
        f"{(outs[0] != exact).sum().item()} elements differ from the fp32 rank-order sum"
    assert bool(((outs[0].double() - ref).abs() <= tol).all())


SIZES = [1, 7, 8, 9, 1000, 4099, 3 * 8192 + 5, (1 << 20) + 3]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("algo", ["one_shot", "two_shot"])
def test_virtual_allreduce_sizes(world, algo):
    from tpmk.comm.allreduce import Communicator
    comm = Communicator.virtual(world, slot_bytes=1 << 20)     # 1 MiB slots: also exercises chunking
    for i, n in enumerate(SIZES):
        xs = _inputs(world, n, seed=100 * world + i)
        outs = [torch.full_like(x, float("nan")) for x in xs]   # poisoned
        comm.all_reduce_virtual(xs, outs, algo=algo)
        comm.check()
        _assert_allreduce(xs, outs)
        inplace = [x.clone() for x in xs]
        comm.all_reduce_virtual(inplace, algo=algo)
        comm.check()
        assert torch.equal(inplace[0], outs[0])
    comm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_virtual_allreduce_64mib(world):
    from tpmk.comm.allreduce import Communicator
    n = 32 << 20                                                # 64 MiB of bf16 per rank
    comm = Communicator.virtual(world)
    xs = _inputs(world, n + 3, seed=7)
    outs = [torch.empty_like(x) for x in xs]
    for algo in ("auto", "one_shot"):
        for o in outs:
            o.fill_(float("nan"))
        comm.all_reduce_virtual(xs, outs, algo=algo)
        comm.check()
        _assert_allreduce(xs, outs)
    comm.close()


@pytest.mark.gpu
def test_unaligned_views_fall_back_to_copies():
    from tpmk.comm.allreduce import Communicator
    comm = Communicator.virtual(2)
    base = _inputs(2, 1001, seed=3)
    xs = [b[1:] for b in base]                                  # 2-byte offset: not 16-aligned
    want = [x.clone() for x in xs]
    comm.all_reduce_virtual(xs)
    comm.check()
    _assert_allreduce(want, xs)
    comm.close()


@pytest.mark.gpu
def test_ten_thousand_back_to_back_calls_without_reset():
    from tpmk.comm.allreduce import Communicator
    world, n = 4, 8192 + 3
    comm = Communicator.virtual(world, slot_bytes=1 << 20)
    sets = [_inputs(world, n, seed=s) for s in range(3)]        # 3 sets: parity reuse sees new data
    outs = [[torch.empty_like(x) for x in sets[0]] for _ in range(2)]
    for i in range(10_000):
        algo = "one_shot" if i % 5 else "two_shot"
        comm.all_reduce_virtual(sets[i % 3], outs[i % 2], algo=algo)
        if i % 1000 == 999 or i >= 9_998:
            comm.check()
            _assert_allreduce(sets[i % 3], outs[i % 2])
    comm.close()


@pytest.mark.gpu
def test_graph_replay_advances_epochs():
    from tpmk.comm.allreduce import Communicator
    world = 4
    comm = Communicator.virtual(world)
    sets = [_inputs(world, 8192 * b + 1, seed=b) for b in (1, 4)]
    outs = [[torch.empty_like(x) for x in s] for s in sets]
    comm.all_reduce_virtual(sets[0], outs[0])                   # warm up (compile, first epoch)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        comm.all_reduce_virtual(sets[0], outs[0], algo="one_shot")
        comm.all_reduce_virtual(sets[1], outs[1], algo="two_shot")
    for _ in range(50):
        for o in outs[0] + outs[1]:
            o.fill_(float("nan"))
        graph.replay()
        comm.check()
        _assert_allreduce(sets[0], outs[0])
        _assert_allreduce(sets[1], outs[1])
    comm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["one_shot", "two_shot"])
def test_missing_peer_times_out_with_record(algo):
    from tpmk.comm.allreduce import CommError, Communicator
    world, timeout = 4, 0.2
    comm = Communicator.virtual(world, timeout_s=timeout)
    xs = _inputs(world, 100_000, seed=1)
    t0 = time.perf_counter()
    comm.all_reduce_virtual(xs, algo=algo, absent_rank=2)
    with pytest.raises(CommError, match="waiting for rank 2") as e:
        comm.check()
    elapsed = time.perf_counter() - t0
    assert timeout <= elapsed < timeout + 5.0, elapsed
    info = e.value.info
    assert info.peer == 2 and info.rank != 2 and info.expected >= 1 and info.seen < info.expected
    with pytest.raises(CommError):                              # unusable afterwards
        comm.all_reduce_virtual(xs)


@pytest.mark.gpu
def test_multiprocess_ipc_handle_exchange_on_one_gpu(tmp_path):
    world, sizes = 2, [5, 10_003]
    mp.spawn(_comm_workers.ipc_allreduce_worker,
             args=(world, str(tmp_path / "init"), str(tmp_path), sizes), nprocs=world, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for n in sizes:
        xs = []
        for r in range(world):
            g = torch.Generator().manual_seed(1000 * n + r)
            xs.append(torch.randn(n, generator=g).to(torch.bfloat16))
        for algo in ("one_shot", "two_shot"):
            outs = [torch.tensor(got[r][f"{n}_{algo}"], dtype=torch.int16).view(torch.bfloat16)
                    for r in range(world)]
            acc = xs[0].float() + xs[1].float()
            for o in outs:
                assert torch.equal(o.view(torch.int16), acc.to(torch.bfloat16).view(torch.int16))


@pytest.mark.gpu
def test_peer_region_rows_written_by_every_process(tmp_path):
    """tpmk.comm.region (the megakernel's per-process buffers): each of 2 processes writes
    its row into every process's region through the mapped base + offset (the buffer sits
    after another, at a non-zero offset); each region ends with every rank's row."""
    world = 2
    mp.spawn(_comm_workers.peer_region_worker, args=(world, str(tmp_path / "init"), str(tmp_path)),
             nprocs=world, join=True)
    for r in range(world):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got == [[float(src + 1)] * 4 for src in range(world)], f"rank {r}: {got}"

