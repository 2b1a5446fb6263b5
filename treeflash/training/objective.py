"""The DFlash block objective (+ TreeFlash AR-approximation), on one sequence at a time.

Per sequence: anchors are sampled among response positions. Block j is
`[token at anchor_j, MASK x (B-1)]` at positions `anchor_j .. anchor_j+B-1`. It attends to the
target features of positions `< anchor_j` (the context the engine holds when the anchor token is
the root of a step) and bidirectionally to its own block, never to another block. Block position
k (1..B-1) predicts the token at `anchor_j + k`; its loss weight is `exp(-(k-1)/gamma)`.

All blocks of a sequence go through one `Drafter.forward_block` call with a block-diagonal +
prefix mask, so training and inference share exactly the same drafter math.

TreeFlash: the corrected head `drafter.corrected(h_k, emb(token at anchor+k-1))` is trained with
teacher forcing (the ground-truth previous token) beside the marginal head `norm(h_k)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.drafter import Drafter

IGNORE = -100
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """DFlash decay: 7 for B=16, 5 for B=10, 4 for B=8 (interpolated otherwise)."""
    return DEFAULT_GAMMA.get(block_size, max(1.0, 0.45 * block_size))


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] loss weight per block position; position 0 (the anchor itself) has weight 0."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def sample_anchors(prompt_len: int, seq_len: int, max_anchors: int, gen: torch.Generator) -> torch.Tensor:
    """Anchors [A] (sorted) among response positions that have at least one token after them.

    The anchor is a token the engine would hold as a step's root: the first response token or later.
    """
    lo, hi = prompt_len, seq_len - 1  # anchor in [lo, hi): anchor+1 must exist
    n = hi - lo
    if n <= 0:
        return torch.zeros(0, dtype=torch.long)
    pick = torch.randperm(n, generator=gen)[:max_anchors] + lo
    return pick.sort().values


def block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """[A*B, C + A*B] bool, True = may attend: own anchor's prefix (< anchor) + own block."""
    A, B = anchors.numel(), block_size
    q_block = torch.arange(A).repeat_interleave(B)  # [A*B] block index of each query
    ctx = torch.arange(ctx_len)[None, :] < anchors[q_block][:, None]  # [A*B, C]
    own = q_block[:, None] == q_block[None, :]  # [A*B, A*B]
    return torch.cat([ctx, own], 1)


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 pred: torch.Tensor | None = None):
    """Block tokens, positions, labels and previous tokens, each [A*B].

    labels[k] = ids[anchor+k] for k >= 1 inside the sequence, else IGNORE (k = 0 is IGNORE).
    prev[k] = ids[anchor+k-1] (the teacher-forced previous token of the corrected head).
    pred [T] (optional, for data not written by the target): the target's greedy token at each
    position given the data prefix. Then labels[k] = pred[anchor+k], kept only while the data
    agrees with the target's greedy path inside the block (ids == pred at anchor+1..anchor+k-1),
    so every label is exactly the target's greedy continuation of what the block sees.
    """
    T, B = ids.numel(), block_size
    offs = torch.arange(B)
    pos = (anchors[:, None] + offs[None, :])  # [A, B]
    tokens = torch.full(pos.shape, mask_token_id, dtype=torch.long)
    tokens[:, 0] = ids[anchors]
    inside = pos < T
    labels = torch.where(inside, ids[pos.clamp(max=T - 1)], torch.full_like(pos, IGNORE))
    if pred is not None:
        at = pos.clamp(max=T - 1)
        agree = (ids[at] == pred[at]) & inside  # [A, B]
        agree[:, 0] = True
        chain_ok = torch.cumprod(torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1]], 1).long(), 1).bool()
        labels = torch.where(inside & chain_ok, pred[at], torch.full_like(pos, IGNORE))
    labels[:, 0] = IGNORE
    prev = ids[(pos - 1).clamp(min=0, max=T - 1)]
    return tokens.reshape(-1), pos.reshape(-1), labels.reshape(-1), prev.reshape(-1)


@dataclass
class LossConfig:
    block_size: int = 8
    gamma: float | None = None
    max_anchors: int = 32  # blocks per sequence
    kl_weight: float = 0.5  # weight of the soft (target top-K) loss beside the hard-token CE
    ar_weight: float = 1.0  # weight of the corrected (TreeFlash) head loss; 0 = plain DFlash
    marginal_weight: float = 1.0  # weight of the marginal head loss (0 when the body is frozen)
    negatives: int = 2048  # random non-draft-vocabulary rows added to each call's softmax


class DraftObjective(nn.Module):
    """Drafter + frozen target embedding/LM head (buffers, never saved) -> weighted block losses.

    `draft_vocab` (sorted ids) restricts the LM head to the most frequent target tokens during
    training; labels outside it are ignored. None = the full vocabulary. Each call also adds
    `cfg.negatives` random rows from outside the draft vocabulary to the softmax: without them the
    untrained rows are never pushed down and one of them wins the full-vocabulary argmax at inference.
    """

    def __init__(self, drafter: Drafter, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 cfg: LossConfig, draft_vocab: torch.Tensor | None = None):
        super().__init__()
        self.drafter, self.cfg = drafter, cfg
        V = head_weight.shape[0]
        self.register_buffer("embed_weight", embed_weight.detach().float(), persistent=False)  # [V, H]
        vocab = torch.arange(V) if draft_vocab is None else draft_vocab.long()
        self.register_buffer("full_head", head_weight.detach().float(), persistent=False)  # [V, H]
        self.register_buffer("vocab", vocab, persistent=False)  # [Vd]
        outside = torch.ones(V, dtype=torch.bool)
        outside[vocab] = False
        self.register_buffer("outside", outside.nonzero()[:, 0], persistent=False)  # [V - Vd]
        self.head_weight = self.full_head[vocab]  # [Vd, H] (+ negatives per call)
        to_draft = torch.full((V,), IGNORE, dtype=torch.long)
        to_draft[vocab] = torch.arange(vocab.numel())
        self.register_buffer("to_draft", to_draft, persistent=False)  # [V] full id -> draft id
        gamma = cfg.gamma or default_gamma(cfg.block_size)
        self.register_buffer("pos_w", position_weights(cfg.block_size, gamma), persistent=False)  # [B]

    def draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(labels, IGNORE)
        ok = labels >= 0
        out[ok] = self.to_draft[labels[ok]]
        return out

    def weights(self, labels: torch.Tensor) -> torch.Tensor:
        """[A*B] per-query weight (0 where the label is ignored)."""
        B = self.cfg.block_size
        w = self.pos_w.repeat(labels.numel() // B)
        return w * (self.draft_labels(labels) >= 0)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return states @ self.head_weight.to(states.dtype).T  # [N, Vd (+ negatives)]

    def set_negatives(self, seed: int) -> None:
        """Head rows for the next call: the draft vocabulary, then random rows from outside it."""
        n = min(self.cfg.negatives, self.outside.numel())
        if n == 0:
            self.head_weight = self.full_head[self.vocab]
            return
        g = torch.Generator().manual_seed(seed)
        neg = self.outside[torch.randperm(self.outside.numel(), generator=g)[:n]]
        self.head_weight = self.full_head[torch.cat([self.vocab, neg])]  # [Vd + n, H]

    def soft_targets(self, top_idx: torch.Tensor, top_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target top-K (full ids [N, K], log-probs [N, K]) -> draft ids [N, K] and renormalised probs."""
        d = self.to_draft[top_idx]
        p = top_logp.float().exp() * (d >= 0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        return d.clamp_min(0), p

    def head_loss(self, states, labels_d, w, soft) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted loss sum and top-1 hits [N] of one head."""
        logp = self.logits(states).float().log_softmax(-1)  # [N, Vd]
        safe = labels_d.clamp_min(0)
        hard = -logp.gather(1, safe[:, None])[:, 0]
        loss = hard
        if soft is not None and self.cfg.kl_weight > 0:
            d, p = soft
            soft_ce = -(p * logp.gather(1, d)).sum(-1)
            loss = (1 - self.cfg.kl_weight) * hard + self.cfg.kl_weight * soft_ce
        hits = (logp.argmax(-1) == labels_d) & (labels_d >= 0)
        return (loss * w).sum(), hits

    def forward(self, feats: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                top_idx: torch.Tensor | None = None, top_logp: torch.Tensor | None = None,
                pred: torch.Tensor | None = None) -> dict:
        """One sequence. feats [T, taps*H]; ids [T]; anchors [A]; top_* [T, K] (target's next-token top-K).

        Returns sums (not means): 'loss' (weighted), 'weight', per-position 'hits'/'hits_ar'/'count' [B].
        """
        cfg, d = self.cfg, self.drafter
        T, B = ids.numel(), cfg.block_size
        dtype = self.embed_weight.dtype
        self.set_negatives(int(anchors.sum()) * 7919 + T)  # deterministic in the inputs (exact resume)
        kv = d.context_kv(feats.to(dtype), torch.arange(T))  # per layer [nkv, T, hd]
        tokens, pos, labels, prev = block_inputs(ids, anchors, B, d.config.mask_token_id, pred)  # [A*B]
        mask = block_mask(anchors, T, B)  # [A*B, T + A*B]
        h = d.forward_block(F.embedding(tokens, self.embed_weight), pos, kv, mask)  # [A*B, H]
        labels_d = self.draft_labels(labels)
        w = self.weights(labels)  # [A*B]
        soft = None
        if top_idx is not None:
            src = (pos - 1).clamp(0, T - 1)  # the target's distribution for token `pos` sits at pos-1
            soft = self.soft_targets(top_idx[src].long(), top_logp[src])
        keep = w > 0
        h, labels_d, w = h[keep], labels_d[keep], w[keep]
        soft = (soft[0][keep], soft[1][keep]) if soft is not None else None
        k_of = torch.arange(B).repeat(anchors.numel())[keep]  # block position of each kept query
        loss = h.new_zeros((), dtype=torch.float32)
        if cfg.marginal_weight > 0:
            m_loss, hits = self.head_loss(d.model.norm(h), labels_d, w, soft)
            loss = loss + cfg.marginal_weight * m_loss
        else:  # frozen body: the marginal head is only measured
            with torch.no_grad():
                _, hits = self.head_loss(d.model.norm(h), labels_d, w, soft)
        hits_ar = torch.zeros_like(hits)
        if d.ar_approximation is not None and cfg.ar_weight > 0:
            prev_emb = F.embedding(prev[keep], self.embed_weight)  # [N, H]
            a_loss, hits_ar = self.head_loss(d.corrected(h, prev_emb), labels_d, w, soft)
            loss = loss + cfg.ar_weight * a_loss
        count = torch.bincount(k_of, minlength=B)
        return {"loss": loss, "weight": w.sum(),
                "hits": torch.bincount(k_of, weights=hits.float(), minlength=B),
                "hits_ar": torch.bincount(k_of, weights=hits_ar.float(), minlength=B),
                "count": count.float()}


class BatchObjective(nn.Module):
    """Sums `DraftObjective` over several sequences in one forward (one DDP forward per step)."""

    def __init__(self, obj: DraftObjective):
        super().__init__()
        self.obj = obj

    def forward(self, seqs: list[dict], anchors: list[torch.Tensor]) -> dict:
        out = None
        for s, a in zip(seqs, anchors):
            if a.numel() == 0:
                continue
            r = self.obj(s["feats"], s["ids"], a, s.get("top_idx"), s.get("top_logp"), s.get("pred"))
            out = r if out is None else {k: out[k] + r[k] for k in out}
        return out


def dense_reference_mask(anchors: list[int], ctx_len: int, block_size: int) -> torch.Tensor:
    """Element-by-element reference for `block_mask` (used by the tests)."""
    A, B = len(anchors), block_size
    m = torch.zeros(A * B, ctx_len + A * B, dtype=torch.bool)
    for qi in range(A * B):
        j = qi // B
        for c in range(ctx_len):
            m[qi, c] = c < anchors[j]
        for kj in range(A * B):
            m[qi, ctx_len + kj] = (kj // B) == j
    return m


def draft_vocab_from_counts(counts: torch.Tensor, size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent token ids (plus `always`), sorted. counts [V]."""
    size = min(size, counts.numel())
    top = counts.topk(size).indices
    ids = torch.unique(torch.cat([top, torch.tensor(always, dtype=torch.long)]))
    return ids.sort().values


def cosine_lr(step: int, total: int, peak: float, warmup_frac: float, floor: float = 0.0) -> float:
    """Linear warmup (warmup_frac of total) then cosine decay to floor*peak."""
    warm = max(1, int(round(total * warmup_frac)))
    if step < warm:
        return peak * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))
