"""What one generation measured: tokens, steps, accepted lengths per step, and where the time went.

Its own module so that decoding, serving and bench share it without importing the decode loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stats:
    """Per generation. acceptance_lengths[i] = accepted draft tokens + 1 bonus in step i."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: steps accepting >= j+1 drafts
    tree_sizes: list[int] = field(default_factory=list)
    node_hits: list[int] = field(default_factory=list)  # [i]: steps whose accepted path holds node i+1
    prefill_s: float = 0.0
    draft_s: float = 0.0
    tree_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = "length"

    def record(self, n_accepted: int, tree_size: int, path: list[int] = ()) -> None:
        self.steps += 1
        for node in path[1:]:  # node indices follow the builder's (best-first) order
            while len(self.node_hits) < node:
                self.node_hits.append(0)
            self.node_hits[node - 1] += 1
        self.acceptance_lengths.append(n_accepted + 1)
        self.tree_sizes.append(tree_size)
        while len(self.accepted_per_position) < n_accepted:
            self.accepted_per_position.append(0)
        for j in range(n_accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(1, self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def per_position_acceptance(self) -> list[float]:
        """vLLM-style: fraction of steps whose draft was accepted at least up to position j+1."""
        return [a / max(1, self.steps) for a in self.accepted_per_position]

    def node_acceptance(self) -> list[float]:
        """[i]: fraction of steps whose accepted path held the (i+1)-th best-first draft node."""
        return [h / max(1, self.steps) for h in self.node_hits]

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "steps": self.steps,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_lengths": self.acceptance_lengths,
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance()],
            "mean_tree_size": round(sum(self.tree_sizes) / max(1, self.steps), 2),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "time_s": {"total": round(self.total_s, 6), "prefill": round(self.prefill_s, 6),
                       "draft": round(self.draft_s, 6), "tree": round(self.tree_s, 6),
                       "verify": round(self.verify_s, 6)},
            "finish_reason": self.finish_reason,
        }
