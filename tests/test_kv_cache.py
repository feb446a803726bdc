"""PageAllocator bookkeeping and the paged KV layout (write then gather in token order)."""
from __future__ import annotations

import random

import pytest
import torch

from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.engine.kv_cache import HostPageTable, KVCache, OutOfPages, PageAllocator, check_pages, page_slots
from tpmk.engine.model import paged_decode_attention


def test_allocator_hands_out_lowest_pages_and_takes_them_back():
    a = PageAllocator(num_pages=10, page_size=4)
    p1 = a.allocate(9)          # 3 pages
    p2 = a.allocate(4)          # 1 page
    assert p1 == [0, 1, 2] and p2 == [3] and a.num_free == 6
    a.extend(p2, 13)            # grows to 4 pages, in place
    assert p2 == [3, 4, 5, 6] and a.num_free == 3
    a.extend(p2, 10)            # already covered: nothing taken
    assert len(p2) == 4
    a.free(p1)
    assert a.num_free == 6
    assert a.allocate(1) == [0]
    assert a.allocate(0) == []


def test_allocator_errors_name_the_numbers():
    a = PageAllocator(num_pages=4, page_size=16)
    a.allocate(40)
    with pytest.raises(OutOfPages, match=r"needs 2 KV pages of 16 tokens but only 1 of 4"):
        a.allocate(17)
    with pytest.raises(ValueError, match="page 3 is not allocated"):
        a.free([3])
    with pytest.raises(ValueError, match="num_pages=0"):
        PageAllocator(0, 16)


def test_a_page_named_twice_in_one_free_is_refused_and_nothing_is_freed():
    """Freed twice, a page would go to two sequences (they would share its KV)."""
    a = PageAllocator(num_pages=4, page_size=16)
    p = a.allocate(16)
    with pytest.raises(ValueError, match="twice"):
        a.free(p + p)
    assert a.num_free == 3
    a.free(p)
    assert a.num_free == 4 and sorted(a.allocate(64)) == [0, 1, 2, 3]


def test_check_pages():
    check_pages([[5, 2]], [8], page_size=4, num_pages=6)
    with pytest.raises(ValueError, match="sequence 0 has 9 tokens but 2 pages"):
        check_pages([[5, 2]], [9], page_size=4, num_pages=6)
    with pytest.raises(ValueError, match="page 6, outside 0..5"):
        check_pages([[6]], [1], page_size=4, num_pages=6)
    with pytest.raises(ValueError, match="page -1, outside 0..5"):   # -1 would index the scratch page
        check_pages([[-1]], [1], page_size=4, num_pages=6)


def test_host_page_table_follows_changes_and_pads_with_scratch():
    t = HostPageTable(rows=3, max_pages=4, scratch_page=99)
    seq = [7, 3]
    assert t.update([seq, [1]]).tolist() == [[7, 3, 99, 99], [1, 99, 99, 99], [99] * 4]
    seq.append(5)  # the driver grows a list in place: must be seen
    assert t.update([seq]).tolist() == [[7, 3, 5, 99], [99] * 4, [99] * 4]
    assert t.update([[2], [4, 6, 8, 9]]).tolist() == [[2, 99, 99, 99], [4, 6, 8, 9], [99] * 4]


@pytest.fixture
def cache():
    cfg = ModelConfig.from_name("tiny-gqa")  # 2 KV heads -> 1 per rank at tp=2
    rt = RuntimeConfig(tp=2, page_size=4, num_pages=12, max_seq_len=32)
    return KVCache.allocate(cfg, rt, "cpu", torch.float64)


def test_layout_and_scratch_page(cache):
    assert cache.k.shape == (3, 13, 1, 4, 16)  # [L, num_pages + 1, Hkv, page_size, D]
    assert cache.num_pages == 12 and cache.scratch_page == 12


def test_write_then_gather_returns_tokens_in_order(cache):
    g = torch.Generator().manual_seed(0)
    lens = [7, 3]
    pages = [[9, 2], [5]]
    dense = [torch.randn(n, 1, 16, generator=g, dtype=torch.float64) for n in lens]
    pid, slot = page_slots(pages, [range(n) for n in lens], 4)
    assert pid == [9, 9, 9, 9, 2, 2, 2, 5, 5, 5] and slot == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    cache.write(1, torch.cat(dense), -torch.cat(dense), torch.tensor(pid), torch.tensor(slot))
    assert cache.k[1, 9, 0, 3].equal(dense[0][3, 0]) and cache.k[1, 5, 0, 2].equal(dense[1][2, 0])
    table = torch.tensor([[9, 2], [5, cache.scratch_page]])
    k, v = cache.gather(1, table)  # [B, Hkv, 8, D]
    for b, n in enumerate(lens):
        assert torch.equal(k[b, 0, :n], dense[b][:, 0])
        assert torch.equal(v[b, 0, :n], -dense[b][:, 0])


def test_paged_decode_attention_matches_dense_float64():
    """GQA 4:1 with scattered pages vs softmax(q k^T / sqrt(D)) v written out in float64."""
    g = torch.Generator().manual_seed(1)
    cfg = ModelConfig.from_name("tiny-gqa")
    rt = RuntimeConfig(tp=1, page_size=4, num_pages=20, max_seq_len=40)
    cache = KVCache.allocate(cfg, rt, "cpu", torch.float64)
    D, hq, hkv = cfg.head_dim, 8, 2
    free = list(range(20))
    random.Random(0).shuffle(free)
    positions = [9, 2, 14]
    pages, ks, vs = [], [], []
    for pos in positions:
        n = pos + 1
        pages.append([free.pop() for _ in range((n + 3) // 4)])
        ks.append(torch.randn(n, hkv, D, generator=g, dtype=torch.float64))
        vs.append(torch.randn(n, hkv, D, generator=g, dtype=torch.float64))
        pid, slot = page_slots(pages[-1:], [range(n)], 4)
        cache.write(0, ks[-1], vs[-1], torch.tensor(pid), torch.tensor(slot))
    width = max(len(p) for p in pages)
    table = torch.tensor([p + [cache.scratch_page] * (width - len(p)) for p in pages])
    q = torch.randn(3, hq, D, generator=g, dtype=torch.float64)
    got = paged_decode_attention(q, cache, 0, table, torch.tensor(positions))
    for b in range(3):
        for h in range(hq):
            kv = h // (hq // hkv)
            w = torch.softmax(ks[b][:, kv] @ q[b, h] / D ** 0.5, dim=0)
            torch.testing.assert_close(got[b, h * D:(h + 1) * D], w @ vs[b][:, kv])
