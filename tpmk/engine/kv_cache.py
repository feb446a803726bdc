"""Paged KV cache: the layout shared by the reference engine and the megakernel.

Per rank, two tensors in the model dtype:

    k, v: [num_hidden_layers, num_pages + 1, Hkv_local, page_size, head_dim]

Token t of a sequence lives in page `pages[t // page_size]`, slot
`t % page_size`. Page ids 0 .. num_pages-1 belong to the driver's
`PageAllocator`; the extra last page (`scratch_page`) is the engine's own: the
padded rows of a CUDA-graph batch bucket write their KV there, and padded
page-table entries point at it, so padding never touches a live sequence.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.partition.weights import local_heads


class OutOfPages(RuntimeError):
    """The allocator has fewer free pages than a request needs."""


class PageAllocator:
    """Driver-side page ids for the KV cache; engines keep no allocation state.

    Pages are handed out lowest id first, so a run is reproducible.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages} must be > 0")
        if page_size <= 0:
            raise ValueError(f"page_size={page_size} must be > 0")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages))  # a heap (sorted list is a valid heap)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.page_size)

    def _take(self, n: int, why: str) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(
                f"{why} needs {n} KV pages of {self.page_size} tokens but only {len(self._free)} "
                f"of {self.num_pages} are free; raise --num-pages (or --max-seq-len x --max-batch) "
                f"or run fewer sequences at once")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(pages)
        return pages

    def allocate(self, n_tokens: int) -> list[int]:
        """Pages for a new sequence of n_tokens tokens."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens={n_tokens} must be >= 0")
        return self._take(self.pages_for(n_tokens), f"a sequence of {n_tokens} tokens")

    def extend(self, pages: list[int], n_tokens: int) -> list[int]:
        """Grow `pages` in place so it covers n_tokens tokens; returns the same list."""
        need = self.pages_for(n_tokens) - len(pages)
        if need > 0:
            pages.extend(self._take(need, f"growing a sequence to {n_tokens} tokens"))
        return pages

    def free(self, pages: list[int]) -> None:
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages {pages} name a page twice; each page is freed once")
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated (double free, or not from this "
                                 f"allocator of {self.num_pages} pages)")
        for p in pages:
            self._used.discard(p)
            heapq.heappush(self._free, p)


@dataclass
class KVCache:
    """One rank's paged K and V (see the module docstring for the layout)."""

    k: torch.Tensor  # [L, num_pages + 1, Hkv, page_size, D]
    v: torch.Tensor  # [L, num_pages + 1, Hkv, page_size, D]

    @classmethod
    def allocate(cls, cfg: ModelConfig, runtime: RuntimeConfig, device, dtype) -> "KVCache":
        _, hkv = local_heads(cfg, runtime.tp)
        shape = (cfg.num_hidden_layers, runtime.num_pages + 1, hkv, runtime.page_size,
                 cfg.head_dim)
        # zeros, not empty: masked slots are multiplied by probability 0, and 0 * NaN = NaN.
        return cls(torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(shape, device=device, dtype=dtype))

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        """Pages the driver may use (the scratch page excluded)."""
        return self.k.shape[1] - 1

    @property
    def scratch_page(self) -> int:
        return self.k.shape[1] - 1

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor,
              slots: torch.Tensor) -> None:
        """k, v: [N, Hkv, D] for N tokens; page_ids, slots: [N] int64."""
        self.k[layer][page_ids, :, slots] = k
        self.v[layer][page_ids, :, slots] = v

    def gather(self, layer: int, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """page_table [B, P] -> k, v [B, Hkv, P * page_size, D] (token order)."""
        B, P = page_table.shape
        k = self.k[layer][page_table]  # [B, P, Hkv, page_size, D]
        v = self.v[layer][page_table]
        hkv, D = k.shape[2], k.shape[4]
        # transpose is free when Hkv == 1 (one KV head per rank, e.g. 70B at tp=8)
        k = k.transpose(1, 2).reshape(B, hkv, P * self.page_size, D)
        v = v.transpose(1, 2).reshape(B, hkv, P * self.page_size, D)
        return k, v


class HostPageTable:
    """A [rows, max_pages] int64 page table on the host, rebuilt only where a row's page list
    changed since the last step (a decode batch's lists change once every page_size steps;
    rebuilding 128 x 256 entries from Python lists each step would cost milliseconds).
    Entries past a sequence's pages, and rows past the batch, hold the scratch page."""

    def __init__(self, rows: int, max_pages: int, scratch_page: int):
        self.scratch = scratch_page
        self.table = torch.full((rows, max_pages), scratch_page, dtype=torch.long)
        self._rows: list[list[int] | None] = [None] * rows

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    def update(self, pages: list[list[int]]) -> torch.Tensor:
        if len(pages) > len(self._rows):
            raise ValueError(f"{len(pages)} sequences > {len(self._rows)} page-table rows")
        width = self.table.shape[1]
        for b, seq_pages in enumerate(pages):
            if self._rows[b] != seq_pages:
                n = min(len(seq_pages), width)
                self.table[b, :n] = torch.tensor(seq_pages[:n], dtype=torch.long)
                self.table[b, n:] = self.scratch
                self._rows[b] = list(seq_pages)
        for b in range(len(pages), len(self._rows)):
            if self._rows[b] is not None:
                self.table[b] = self.scratch
                self._rows[b] = None
        return self.table


def page_slots(pages: list[list[int]], positions: list[list[int]] | list[range],
               page_size: int) -> tuple[list[int], list[int]]:
    """(page id, slot) of every listed position of every sequence, flattened in order."""
    page_ids, slots = [], []
    for seq_pages, seq_pos in zip(pages, positions):
        for t in seq_pos:
            page_ids.append(seq_pages[t // page_size])
            slots.append(t % page_size)
    return page_ids, slots


def check_pages(pages: list[list[int]], n_tokens: list[int], page_size: int,
                num_pages: int) -> None:
    """Every sequence's page list covers its tokens and names valid page ids."""
    for b, (seq_pages, n) in enumerate(zip(pages, n_tokens)):
        if len(seq_pages) * page_size < n:
            raise ValueError(
                f"sequence {b} has {n} tokens but {len(seq_pages)} pages of {page_size} tokens; "
                f"give it at least {math.ceil(n / page_size)} pages (PageAllocator.extend)")
        for p in seq_pages[:math.ceil(n / page_size)]:
            if not 0 <= p < num_pages:
                raise ValueError(f"sequence {b} names page {p}, outside 0..{num_pages - 1} "
                                 f"(runtime num_pages={num_pages})")


__all__ = ["HostPageTable", "KVCache", "OutOfPages", "PageAllocator", "check_pages", "page_slots"]
