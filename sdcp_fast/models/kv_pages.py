"""The K/V of many sessions in one paged pool, so that a pass attends for all of them in one
call per layer instead of one call per session.

    pool = PagePool(n_layer, kv_heads, head_dim, dtype, device, max_bytes=1 << 30)
    pages = pool.take(pool.pages_for(n))        # a session's pages, in position order
    pool.keys(layer), pool.values(layer)        # [pages * PAGE, kv_heads, head_dim] views

One tensor [n_layer, 2, pages, PAGE, kv_heads, head_dim] holds every page; a session owns a
list of pages, position p of the session living at row `pages[p // PAGE] * PAGE + p % PAGE` of
a layer's view. Why pages and not one growable tensor per session: a pass gathers the pages
of all its sessions with one `index_select` per layer into a padded batch that SDPA takes in
one call, and a new token's K/V is written in place (no concatenation that copies a
session's whole past every step). Why pages and not one fixed slot per session: a slot must
be as long as the longest session could grow, while pages cost what a session holds, rounded
up to one page.

Growth: the pool tensor grows by doubling (at least to what is asked) up to `max_bytes` and
never shrinks; its high-water size is at most `max_bytes`. Pages given back are reused first.
`take` raises KVCapacityError when the pages asked for do not fit under `max_bytes`, leaving
the pool as it was; `fits` says so beforehand.
"""

from __future__ import annotations

import torch

from .base import KVCapacityError

PAGE = 16  # positions per page: small pages waste little, large ones index less
MIN_PAGES = 64  # the first allocation, so that the first sessions do not regrow it each


class PagePool:
    def __init__(self, n_layer: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, *, max_bytes: int, page: int = PAGE) -> None:
        self.page = page
        self.shape = (n_layer, 2, page, kv_heads, head_dim)
        self.page_bytes = n_layer * 2 * page * kv_heads * head_dim * dtype.itemsize
        self.max_pages = max_bytes // self.page_bytes
        self.pool = torch.empty(n_layer, 2, 0, page, kv_heads, head_dim, dtype=dtype, device=device)
        self._free: list[int] = []
        self.held = 0  # pages owned by sessions

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page)

    @property
    def allocated(self) -> int:
        return self.pool.shape[2]

    def fits(self, more_pages: int) -> bool:
        return self.held + more_pages <= self.max_pages

    def take(self, n: int) -> list[int]:
        """n pages not owned by anyone (their contents finite, otherwise undefined)."""
        if n <= 0:
            return []
        if not self.fits(n):
            raise KVCapacityError(
                f"K/V would need {(self.held + n) * self.page_bytes} bytes of pages, over "
                f"max_kv_bytes={self.max_pages * self.page_bytes}; release sessions")
        if len(self._free) < n:
            self._grow(self.allocated + n - len(self._free))
        taken = self._free[-n:]
        del self._free[-n:]
        self.held += n
        return taken

    def give_back(self, pages: list[int]) -> None:
        self._free.extend(pages)
        self.held -= len(pages)

    def _grow(self, need: int) -> None:
        old = self.allocated
        new = min(self.max_pages, max(need, 2 * old, MIN_PAGES))
        n_layer, two, page, heads, dim = self.shape
        # zeros, not empty: a masked key's weight is 0, but 0 x NaN (garbage memory) is NaN, so
        # the rows past a session's end that a gather pads with must hold finite values
        pool = torch.zeros(n_layer, two, new, page, heads, dim, dtype=self.pool.dtype, device=self.pool.device)
        if old:
            pool[:, :, :old] = self.pool
        self.pool = pool
        # lowest pages last: `take` pops from the end, so sessions fill the pool from the start
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def keys(self, layer: int) -> torch.Tensor:
        """[allocated * PAGE, kv_heads, head_dim], a view: row = page * PAGE + offset."""
        return self.pool[layer, 0].view(-1, *self.shape[3:])

    def values(self, layer: int) -> torch.Tensor:
        return self.pool[layer, 1].view(-1, *self.shape[3:])

    def rows(self, pages: list[int], start: int, stop: int) -> list[int]:
        """The pool rows of positions start..stop-1 of a session owning `pages`."""
        page = self.page
        return [pages[p // page] * page + p % page for p in range(start, stop)]

    def read(self, pages: list[int], n: int) -> torch.Tensor:
        """The first n positions of a session: [n_layer, 2, kv_heads, n, head_dim] (a copy)."""
        index = torch.tensor(pages[: self.pages_for(n)], dtype=torch.long, device=self.pool.device)
        n_layer, two, page, heads, dim = self.shape
        kv = self.pool.index_select(2, index).view(n_layer, two, -1, heads, dim)[:, :, :n]
        return kv.transpose(2, 3).contiguous()

    def write(self, pages: list[int], start: int, kv: torch.Tensor) -> None:
        """Store kv [n_layer, 2, kv_heads, n, head_dim] at positions start..start+n-1."""
        n = kv.shape[3]
        rows = torch.tensor(self.rows(pages, start, start + n), dtype=torch.long, device=self.pool.device)
        n_layer, two, page, heads, dim = self.shape
        flat = self.pool.view(n_layer, two, -1, heads, dim)
        flat.index_copy_(2, rows, kv.transpose(2, 3).to(flat.dtype))

    def copy(self, source: list[int], target: list[int], n: int) -> None:
        """Positions 0..n-1 of the session owning `target` pages := those of the session
        owning `source` pages (every layer's keys and values)."""
        index = [torch.tensor(self.rows(pages, 0, n), dtype=torch.long, device=self.pool.device)
                 for pages in (source, target)]
        n_layer, two, page, heads, dim = self.shape
        flat = self.pool.view(n_layer, two, -1, heads, dim)
        flat.index_copy_(2, index[1], flat.index_select(2, index[0]))
