"""The target's KV cache: one protocol, two implementations, one attention mask over its slots.

`KVCache` is what a target forward and the decoding loop need of a cache (gpt-fast style: the
cache owns how keys and values are written and how a step keeps its accepted path):
- `length`: the tokens held, positions 0..length-1; a forward writes its N tokens after them,
- `update(k, v, layer, slots)`: write one layer's new keys and values [1, Hkv, N, D] (Hugging
  Face's argument order, plus the cache slots of the new tokens) and return that layer's keys
  and values to attend over [1, Hkv, S, D],
- `compact(start, keep)`: keep slots [:start] and the tree nodes start+keep (one implementation
  for both caches, over `key_values` and `truncate`).

`StaticKV` (preallocated, the static and compiled backends, written by `fastpath`) and `HFCache`
(Hugging Face's DynamicCache, whose `update` the model's own attention calls: the hf backend).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache


def path_in_place(keep: torch.Tensor) -> bool:
    """Whether the accepted tree nodes `keep` [K] already sit in the first K tree slots."""
    return keep.tolist() == list(range(len(keep)))


def causal(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()  # [N, N]


def attention_mask(start: int, tree_mask: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Fill `out` [N, S] bool (S >= start+N; True = may attend) for N new tokens in slots
    start..start+N-1: each sees the held slots [:start] and, among the new ones, its ancestors
    (tree_mask [N, N]; None: causal, a flat sequence), no slot after those. Returns `out`."""
    n = out.shape[0]
    out.zero_()
    out[:, :start] = True
    out[:, start:start + n] = causal(n, out.device) if tree_mask is None else tree_mask
    return out


class KVCache:
    """The protocol (see the module's docstring); `compact` is shared."""

    length: int

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int, slots: torch.Tensor):
        raise NotImplementedError

    def key_values(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: keys, values [1, Hkv, S, D], S >= length (slots [:length] are live)."""
        raise NotImplementedError

    def truncate(self, length: int) -> None:
        """Hold only slots [:length]."""
        raise NotImplementedError

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep slots [:start] and the tree slots start+keep [K] (in order) at start..start+K-1."""
        n = len(keep)
        if not path_in_place(keep):  # plain decoding: always in place
            idx = start + keep
            for kv in self.key_values():
                for t in kv:
                    t[:, :, start:start + n] = t[:, :, idx]  # the gather copies first: no aliasing
        self.truncate(start + n)


class StaticKV(KVCache):
    """Preallocated cache. k[i], v[i]: [1, Hkv, capacity, D] per layer i (separate tensors, so a
    compiled step updates each in place; views of one tensor would make it copy the whole cache);
    slots < `length` hold the context."""

    def __init__(self, layers: int, n_kv: int, head_dim: int, capacity: int, dtype, device):
        self.k = [torch.zeros(1, n_kv, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.length = 0
        self._inputs: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def update(self, k, v, layer, slots):
        """Write into `slots`; returns the whole buffers (the mask says which slots count)."""
        self.k[layer].index_copy_(2, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, slots, v.to(self.v[layer].dtype))
        return self.k[layer], self.v[layer]

    def key_values(self):
        return list(zip(self.k, self.v))

    def truncate(self, length: int) -> None:
        self.length = length

    def inputs(self, bucket: int) -> dict[str, torch.Tensor]:
        """Reused input buffers of the compiled step for one bucket size (`FastPath._padded`): mask
        [Nb, capacity] bool, ids, pos, slots [Nb] long."""
        if bucket not in self._inputs:
            dev = self.k[0].device
            z = torch.zeros(bucket, dtype=torch.long, device=dev)
            self._inputs[bucket] = {"mask": torch.zeros(bucket, self.capacity, dtype=torch.bool, device=dev),
                                    "ids": z.clone(), "pos": z.clone(), "slots": z.clone()}
        return self._inputs[bucket]


class HFCache(DynamicCache, KVCache):
    """Hugging Face's DynamicCache (any causal LM; its `update` appends, so the slots are always the
    next ones) with the protocol's length, key_values and truncate."""

    @property
    def length(self) -> int:
        return self.get_seq_length()

    def key_values(self):
        return [(layer.keys, layer.values) for layer in self.layers if layer.is_initialized]

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.crop(length - self.length)  # transformers 5: a negative count of tokens to remove
