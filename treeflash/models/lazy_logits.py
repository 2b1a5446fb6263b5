"""Logits computed row by row, on demand (the eager target forwards return them)."""
from __future__ import annotations

import torch


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
            self.rows[i] = self.lm_head(self.h[i:i + 1]).float()[0]
        return self.rows[i]
