"""Logits computed row by row, on demand (the eager target forwards return them)."""
from __future__ import annotations

import torch

# An LM head of more bytes than this is read once for all of a forward's rows at the first row asked
# for: on a CPU one row costs a read of the whole matrix (Qwen2.5-0.5B's 152k x 896 in bf16, 272 MB:
# about 24 ms a row on 2 cores), so a tree's rows cost about one row in one product, and the walk
# reads 2-8 of them. The first row asked for is computed alone (a prefill asks for its last row
# only). A smaller head (SmolLM2's 49k x 576, 56 MB) stays row by row.
ALL_ROWS_BYTES = 128 * 2**20


def head_bytes(module) -> int:
    """Bytes of a head's tensors (a quantized head keeps its weights in buffers)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


class LazyLogits:
    """A forward's logits, indexable by node without the LM head over every row: the acceptance walk
    reads only the nodes on its path (tau of them), so the LM head (49k x 576 for SmolLM2: a fifth
    of the model, and at 16 rows slower per row than at 1) runs over those rows only."""

    def __init__(self, h: torch.Tensor, lm_head):
        self.h, self.lm_head = h, lm_head  # h [N, H] final-normed states
        self.rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.h.shape[0]

    def __getitem__(self, i) -> torch.Tensor:
        """float32 logits: [V] of node i (computed once), [k, V] for a slice or index tensor."""
        if not isinstance(i, int):
            return self.lm_head(self.h[i]).float()
        i = range(len(self))[i]  # a negative index counts from the end
        if i not in self.rows:
            if self.rows and self._all_rows():  # a second row of a large head: every row in one read
                self.rows = dict(enumerate(self.lm_head(self.h).float())) | self.rows
            else:
                self.rows[i] = self.lm_head(self.h[i:i + 1]).float()[0]
        return self.rows[i]

    def _all_rows(self) -> bool:
        """Whether to compute every row at once (asked only at a second row: a prefill or a plain
        step, which read one row, never pays for the check)."""
        return 1 < self.h.shape[0] <= 64 and head_bytes(self.lm_head) > ALL_ROWS_BYTES
