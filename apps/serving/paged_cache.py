"""A paged KV cache: fixed-size blocks from one preallocated pool, a block table per sequence.

Every layer's keys and values live in two tensors ``[layers, blocks + 1, block_size,
kv_heads, head_dim]`` allocated once, at start, from a size in tokens or bytes. A sequence
owns a list of block ids (its block table); position ``p`` of it sits in block
``table[p // block_size]`` at offset ``p % block_size``. Blocks are taken as a sequence
grows and all return to the pool when it ends, so memory follows the tokens actually held,
not each request's worst case.

A sequence is admitted only with a *reservation* of the blocks its longest possible length
needs (prompt + max_tokens): the pool never runs dry in the middle of a step, and nothing
needs preempting. A reservation that cannot be had is refused at once (``PoolFull``), so
the caller waits or refuses; it never blocks.

The extra block (id ``blocks``) is scratch: padding slots of a batched step read and write
there. It is never handed out, and attention masks every read from it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from apps.serving.lanes import DecodeLanes


class PoolFull(RuntimeError):
    """The pool has not enough unreserved blocks for what was asked."""


@dataclass
class BlockTable:
    """The blocks of one sequence and its reservation (blocks it may still take)."""

    blocks: list[int] = field(default_factory=list)
    reserved: int = 0  # blocks promised to this sequence and not taken yet
    length: int = 0  # positions written so far


class PagedKVCache:
    """The block pool of one TP rank (its own heads), for every layer of one model."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need >= 1 block of >= 1 token, got {num_blocks} × {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # Zeros, not empty: a masked slot still enters q·kᵀ, and a NaN there would spread.
        shape = (num_layers, num_blocks + 1, block_size, kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives 0, 1, …
        self._reserved = 0  # blocks promised to live tables, not yet taken
        self.lanes = DecodeLanes(self)  # the decoding rows' contiguous copy (apps.serving.lanes)

    @classmethod
    def for_model(
        cls,
        model,
        *,
        tokens: int | None = None,
        nbytes: int | None = None,
        block_size: int = 16,
    ) -> PagedKVCache:
        """A pool for ``model``'s layers and this rank's KV heads, sized by exactly one of
        ``tokens`` (rounded up to whole blocks) or ``nbytes`` (rounded down)."""
        if (tokens is None) == (nbytes is None):
            raise ValueError("size the KV cache by tokens or by bytes (exactly one)")
        probe = model.layers[0].attention.new_cache(1, 0)  # [1, kv heads here, 0, d]
        _, kv_heads, _, head_dim = probe.keys.shape
        layers, dtype = len(model.layers), probe.keys.dtype
        per_block = 2 * layers * block_size * kv_heads * head_dim * dtype.itemsize
        blocks = math.ceil(tokens / block_size) if tokens is not None else nbytes // per_block
        if blocks < 1:
            raise ValueError(f"{nbytes} bytes hold no block of {per_block} bytes")
        _check_room(blocks * per_block, blocks * block_size, probe.keys.device)
        return cls(
            num_layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            num_blocks=blocks,
            block_size=block_size,
            dtype=dtype,
            device=probe.keys.device,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's real blocks (keys and values, every layer)."""
        per_block = self.keys[:, 0].numel() * self.keys.element_size()
        return 2 * per_block * self.num_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks not held by any sequence (some may be reserved)."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        """Blocks held by sequences."""
        return self.num_blocks - len(self._free)

    @property
    def available_blocks(self) -> int:
        """Blocks neither held nor reserved: what a new reservation can get."""
        return len(self._free) - self._reserved

    def describe(self) -> str:
        """One line for the start-up report."""
        return (
            f"KV cache: {self.num_blocks} blocks × {self.block_size} tokens = "
            f"{self.num_blocks * self.block_size} tokens, {self.nbytes / 2**20:.2f} MiB "
            f"({self.keys.dtype}, {self.keys.shape[3]} KV heads × {self.keys.shape[4]})"
        )

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions."""
        return math.ceil(tokens / self.block_size)

    def reserve(self, tokens: int) -> BlockTable:
        """A new, empty table with ``tokens`` positions' blocks promised to it; raises
        ``PoolFull`` (saying how many are free) when they cannot all be promised."""
        need = self.blocks_for(tokens)
        if need > self.available_blocks:
            raise PoolFull(
                f"{tokens} tokens need {need} KV blocks; {self.available_blocks} of "
                f"{self.num_blocks} are free and unreserved"
            )
        self._reserved += need
        return BlockTable(reserved=need)

    def grow(self, table: BlockTable, length: int) -> None:
        """Give ``table`` the blocks that ``length`` positions need, from its reservation."""
        need = self.blocks_for(length) - len(table.blocks)
        if need > table.reserved:
            raise PoolFull(f"{length} positions exceed the table's reservation")
        for _ in range(max(need, 0)):
            table.blocks.append(self._free.pop())
            table.reserved -= 1
            self._reserved -= 1

    def release(self, table: BlockTable) -> None:
        """Return ``table``'s blocks and its unused reservation to the pool (idempotent)."""
        self._free.extend(reversed(table.blocks))
        self._reserved -= table.reserved
        table.blocks, table.reserved, table.length = [], 0, 0

    def slots(self, table: BlockTable, start: int, stop: int) -> torch.Tensor:
        """Flat slot ids (block · block_size + offset) of positions ``start … stop − 1``."""
        pos = torch.arange(start, stop)
        blocks = torch.tensor(table.blocks, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    @property
    def scratch_slot(self) -> int:
        """A slot of the scratch block, for padding."""
        return self.num_blocks * self.block_size

    def write_and_read(
        self,
        layer: int,
        write: torch.Tensor,
        read: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``[b, heads, s, d]`` at slots ``write`` ``[b, s]``, then return
        the keys and values at slots ``read`` ``[b, n]``, as ``[b, heads, n, d]``."""
        keys, values = self.write(layer, write, k, v)
        return keys[read].transpose(1, 2), values[read].transpose(1, 2)

    def write(
        self, layer: int, write: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``[b, heads, s, d]`` at slots ``write`` ``[b, s]``; returns the
        layer's keys and values as flat ``[slots, heads, d]`` views."""
        flat = self.keys.shape[1] * self.block_size
        keys = self.keys[layer].view(flat, *self.keys.shape[3:])  # [slots, heads, d]
        values = self.values[layer].view(flat, *self.values.shape[3:])
        keys[write.flatten()] = k.transpose(1, 2).flatten(0, 1)  # [(b s), heads, d]
        values[write.flatten()] = v.transpose(1, 2).flatten(0, 1)
        return keys, values


def _check_room(nbytes: int, tokens: int, device: torch.device) -> None:
    """A one-line ValueError when a pool of ``nbytes`` (``tokens`` tokens) exceeds the free
    memory of ``device`` (the GPU's, or on a CPU the machine's free RAM), before it is
    allocated: an allocator's traceback, or a machine swapping, otherwise."""
    from engine.preflight import available_ram_bytes

    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], "free on the GPU"
    else:  # every rank of this machine allocates its own pool from the same RAM
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        nbytes *= ranks
        free, where = available_ram_bytes(), "of free RAM"
        where += f" for this machine's {ranks} ranks" if ranks > 1 else ""
    if free is not None and nbytes > free:
        raise ValueError(
            f"a KV cache of {tokens} tokens takes {_size(nbytes)}, and there are "
            f"{_size(free)} {where}: lower --cache-tokens (by default --max-running × the "
            "model's positions)"
        )


def _size(nbytes: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3f} MiB"
