"""`TrainConfig`: every option of `treeflash train fit` (one command-line flag per field), its
default and its check. No torch here: `treeflash train --help` lists the options without loading
the trainer (training/trainer.py runs them)."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields

from ..errors import TreeflashError


@dataclass
class TrainConfig:
    features: list[str] = field(default_factory=list)  # feature shard files
    out: str = "runs/drafter"
    num_layers: int = 2
    num_taps: int = 4
    block_size: int = 8
    treeflash: bool = True
    ar_size: int = 0  # hidden size of the TreeFlash head's SwiGLU; 0 = the target's MLP size
    init: str = "target"  # "target" (last target layers) | "random" | a drafter directory
    freeze_body: bool = False  # train only the AR-approximation (needs init = a drafter directory)
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_seqs: int = 8  # sequences per step (global)
    max_anchors: int = 32  # blocks per sequence
    # position-loss decay exp(-(k-1)/gamma); 0 = DFlash's default for the block size (validation
    # always weighs with the default)
    gamma: float = 0.0
    steps: int = 1000
    kl_weight: float = 0.5
    ar_weight: float = 1.0
    draft_vocab: int = 8192  # 0 = full vocabulary
    negatives: int = 2048  # random out-of-draft-vocabulary rows per sequence in the softmax
    val_seqs: int = 32
    eval_every: int = 100
    ckpt_every: int = 100
    log_every: int = 10
    bf16: bool = False
    seed: int = 0
    max_minutes: float = 0.0  # stop (with a checkpoint) after this long; 0 = no limit
    target_labels: bool = False  # response labels := target's greedy top-1 (for human-written data)

    def check(self) -> "TrainConfig":
        def bad(msg):
            raise TreeflashError(f"bad config value: {msg}")
        if self.block_size < 2:
            bad(f"block_size must be >= 2, got {self.block_size}")
        if self.ar_size < 0:
            bad(f"ar_size must be >= 0, got {self.ar_size}")
        if self.num_layers < 1:
            bad(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_taps < 1:
            bad(f"num_taps must be >= 1, got {self.num_taps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            bad(f"lr must be a positive number, got {self.lr}")
        if not 0 <= self.warmup < 1:
            bad(f"warmup must be in [0, 1), got {self.warmup}")
        if self.steps < 1 or self.batch_seqs < 1 or self.max_anchors < 1:
            bad("steps, batch_seqs and max_anchors must be >= 1")
        if not 0 <= self.kl_weight <= 1:
            bad(f"kl_weight must be in [0, 1], got {self.kl_weight}")
        if self.ar_weight < 0 or self.grad_clip < 0 or self.draft_vocab < 0 or self.val_seqs < 0:
            bad("ar_weight, grad_clip, draft_vocab and val_seqs must be >= 0")
        if not (self.gamma >= 0 and math.isfinite(self.gamma)):
            bad(f"gamma must be >= 0 (0 = the default for the block size), got {self.gamma}")
        if self.freeze_body and self.init in ("target", "random"):
            bad("freeze_body needs init = a trained drafter directory")
        if self.freeze_body and not self.treeflash:
            bad("freeze_body trains only the TreeFlash AR-approximation; it needs treeflash")
        return self

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """A config from a dict (a checkpoint's `state.json` "config"); keys this version does not
        know (options since removed) are dropped with a warning on stderr."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(k for k in d if k not in names)
        if unknown:
            print(f"treeflash: warning: ignoring unknown training options {', '.join(unknown)}", file=sys.stderr)
        return cls(**{k: v for k, v in d.items() if k in names})
