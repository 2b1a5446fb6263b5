"""The drafter's output heads at inference: from one block pass's states to log-probs.

`DraftHeads` reads the pre-norm states h [D+1, H] of one drafter pass (row 0: the root, row d:
depth d) through the target's LM head:
- `marginal(h)`: the DFlash marginal at each depth;
- `corrected(h, root_token, prev, cols)`: TreeFlash stage 2, each depth's distribution given a
  previous token (the AR-approximation), for many previous tokens per depth.

Tokens are addressed by *column*: their index in the drafter's draft vocabulary when one is used
(EAGLE-3 style: the LM head then runs over those rows only), else their token id; `tokens(cols)`
maps columns to token ids. Verification never uses the draft vocabulary.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models import aot
from ..models.drafter import Drafter

# Tensors derived from a drafter's weights (the draft vocabulary's LM-head rows, the previous-token
# table, the column of each token), kept per drafter across proposers (the API builds a proposer
# per request): {drafter: {name: (key, value)}}; an entry is rebuilt when its key changes.
_DERIVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DraftHeads:
    """Marginal and TreeFlash-corrected log-probs of one drafter, over the target's LM head."""

    PREV_TABLE_MAX_BYTES = 128 << 20

    def __init__(self, drafter: Drafter, embed: nn.Module, lm_head: nn.Module, draft_vocab: bool = True):
        """draft_vocab: propose from the drafter's draft vocabulary when it has one (False: all ids)."""
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        self.use_draft_vocab = draft_vocab
        self._derived = _DERIVED.setdefault(drafter, {})

    @property
    def vocab(self) -> torch.Tensor | None:
        """The token ids [Vd] the columns stand for (None: columns are token ids)."""
        return self.drafter.draft_vocab if self.use_draft_vocab else None

    def tokens(self, cols: torch.Tensor) -> torch.Tensor:
        """Columns (any shape) -> token ids (the same shape)."""
        return cols if self.vocab is None else self.vocab.to(cols.device)[cols]

    def marginal(self, h: torch.Tensor) -> torch.Tensor:
        """h [D+1, H] -> log-probs [D, Vd] over the columns, for depths 1..D."""
        x = self.drafter.model.norm(h[1:])  # [D, H]
        if self.vocab is None:
            return self.lm_head(x).float().log_softmax(-1)  # [D, V]
        return (x @ self.vocab_rows().T).float().log_softmax(-1)

    def to_full(self, logp: torch.Tensor) -> torch.Tensor:
        """Log-probs over the columns [D, Vd] -> over every token id [D, V] (-inf outside the draft
        vocabulary)."""
        if self.vocab is None:
            return logp
        full = logp.new_full((logp.shape[0], self.lm_head.weight.shape[0]), float("-inf"))  # [D, V]
        full[:, self.vocab.to(logp.device)] = logp
        return full

    def corrected(self, h: torch.Tensor, root_token: int, prev: torch.Tensor,
                  cols: torch.Tensor | None = None) -> torch.Tensor:
        """Row 0: depth 1 given the root; row 1 + (d-1)*m + j: depth d+1 given prev[d-1, j].

        h [D+1, H]; prev [D-1, m] the previous-token candidates of depths 1..D-1 (columns); cols
        [D, C] the columns scored at each depth (None: every token id) -> log-probs
        [1 + (D-1)*m, C] (or [.., V]), normalised over those columns."""
        x = self.corrected_states(h[1:], self._row_positions(prev), self._prev_parts(root_token, prev))
        if cols is None:
            return self.lm_head(x).float().log_softmax(-1)  # [1 + (D-1)*m, V]
        return self._column_logits(x, cols, prev.shape[1]).float().log_softmax(-1)

    def corrected_states(self, h: torch.Tensor, row_pos: torch.Tensor, prev_part: torch.Tensor) -> torch.Tensor:
        """TreeFlash-corrected, final-normed states for rows that share positions.

        h [P, H] pre-norm states of P positions; row_pos [R] the position of each row; prev_part
        [R, 2A] each row's previous-token half (`ARApproximation.prev_part` or `prev_table` rows)
        -> [R, H]. Equals `Drafter.corrected(h[row_pos], embed(prev))` up to rounding, for a
        fraction of the matmuls when R >> P: the AR correction's state half runs once per position."""
        ar, norm = self.drafter.ar_approximation, self.drafter.model.norm
        ug = ar.state_part(h, norm)[row_pos] + prev_part  # [R, 2A]
        return norm(ar.combine(h[row_pos], ug))

    def prev_table(self) -> torch.Tensor | None:
        """ar_approximation.prev_part of every draft-vocabulary token [Vd, 2A] (cached), or None
        without a draft vocabulary or when the table would exceed PREV_TABLE_MAX_BYTES."""
        vocab, w = self.vocab, self.drafter.ar_approximation.ug.weight
        if vocab is None or len(vocab) * w.shape[0] * w.element_size() > self.PREV_TABLE_MAX_BYTES:
            return None
        key = (w.data_ptr(), w._version, self.embed.weight.data_ptr(), vocab.data_ptr())
        return self._cached("prev_table", key, lambda: self._table(vocab.to(w.device)))

    def vocab_rows(self) -> torch.Tensor:
        """lm_head.weight[draft vocabulary] [Vd, H] (cached)."""
        w, vocab = self.lm_head.weight, self.vocab
        key = (w.data_ptr(), w.dtype, w.device, vocab.data_ptr())
        return self._cached("vocab_rows", key, lambda: w[vocab.to(w.device)].contiguous())

    def column(self, token: int) -> int | None:
        """The column of `token` in the draft vocabulary (None: not in it)."""
        vocab = self.vocab
        columns = self._cached("columns", vocab.data_ptr(),
                               lambda: dict((t, i) for i, t in enumerate(vocab.tolist())))
        return columns.get(int(token))

    # ---- parts of `corrected` ----
    @staticmethod
    def _row_positions(prev: torch.Tensor) -> torch.Tensor:
        """prev [D-1, m] -> the position (depth - 1) each output row reads [1 + (D-1)*m]."""
        n, m = prev.shape
        zero = torch.zeros(1, dtype=torch.long, device=prev.device)
        return torch.cat([zero, torch.arange(1, n + 1, device=prev.device).repeat_interleave(m)])

    def _prev_parts(self, root_token: int, prev: torch.Tensor) -> torch.Tensor:
        """Each row's previous-token half [1 + (D-1)*m, 2A]: from the table where there is one."""
        table = self.prev_table()
        root_part = self._root_part(root_token, table)  # [1, 2A]
        cand_part = (table[prev.reshape(-1)] if table is not None
                     else self._prev_part(self.tokens(prev).reshape(-1)))  # [(D-1)*m, 2A]
        return torch.cat([root_part, cand_part])

    def _root_part(self, root_token: int, table: torch.Tensor | None) -> torch.Tensor:
        """The root's previous-token half [1, 2A]: its row of `table`, or computed where it has none
        (no table, or a root outside the draft vocabulary)."""
        col = self.column(root_token) if table is not None else None
        if col is not None:
            return table[col][None]
        return self._prev_part(torch.tensor([root_token], device=self.embed.weight.device))

    def _prev_part(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [R] -> their previous-token halves [R, 2A]."""
        return self.drafter.ar_approximation.prev_part(self.embed(token_ids))

    @torch.no_grad()
    def _table(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._prev_part(token_ids)  # [Vd, 2A]

    def _column_logits(self, x: torch.Tensor, cols: torch.Tensor, m: int) -> torch.Tensor:
        """x [1 + (D-1)*m, H] corrected states, cols [D, C] -> logits [1 + (D-1)*m, C] (row r
        over the columns of its depth)."""
        D, C = cols.shape
        w = self.vocab_rows()[cols] if self.vocab is not None else self.lm_head.weight[cols]  # [D, C, H]
        first = x[:1] @ w[0].T  # [1, C]
        rest = torch.bmm(x[1:].view(D - 1, m, x.shape[-1]), w[1:].transpose(1, 2)).view((D - 1) * m, C)
        return torch.cat([first, rest])

    # ---- TreeFlash stages 1 and 2 as one compiled graph ----
    def compiled_tables(self, h: torch.Tensor, root_token: int, m: int, k: int, n_cols: int, depth: int,
                        cpp_gemm: bool):
        """TreeFlash stage 1 + 2 over the draft vocabulary, compiled (`TablesGraph`), for h [D+1, H] of
        at most `depth` positions (shorter blocks, at the end of a generation, are padded to it: one
        graph per depth). Returns (candidate columns [D, m], stage-2 columns [1 + (D-1)*m, k], their
        log-probs), or None where the graph does not apply (no draft vocabulary or previous-token
        table). A root outside the draft vocabulary (about one step in eight on HumanEval) gets its
        previous-token half computed here rather than read from the table, so those steps run the
        graph too, not the dearer eager heads (docs/performance.md, "Compiled TreeFlash heads")."""
        table, D = self.prev_table(), h.shape[0] - 1
        if table is None or self.vocab is None or not 1 <= D <= depth:
            return None
        graph = self.tables_graph(m, k, n_cols, depth, cpp_gemm)
        if D < depth:  # padded positions: their rows come after every row of the first D positions
            h = torch.cat([h, h[-1:].expand(depth - D, -1)])
        with torch.no_grad():
            cand, idx, vals = graph.run(h, self._root_part(root_token, table))
        return cand[:D], idx[:1 + (D - 1) * m], vals[:1 + (D - 1) * m]

    def tables_graph(self, m: int, k: int, n_cols: int, depth: int, cpp_gemm: bool) -> "TablesGraph":
        """The compiled `TablesGraph` for these options (built once per drafter and weights)."""
        w = self.drafter.ar_approximation.ug.weight
        key = (m, k, n_cols, depth, cpp_gemm, w.data_ptr(), w._version, self.lm_head.weight.data_ptr(),
               self.vocab.data_ptr())
        graphs = self._cached("tables_graphs", key[4:], dict)
        if key[:4] not in graphs:
            graphs[key[:4]] = TablesGraph(self, m, k, n_cols, depth, cpp_gemm)
        return graphs[key[:4]]

    def _cached(self, name: str, key, build):
        hit = self._derived.get(name)
        if hit is None or hit[0] != key:
            hit = self._derived[name] = (key, build())
        return hit[1]


class TablesGraph(nn.Module):
    """TreeFlash stages 1 and 2 (`TreeFlash.heads` up to the host copies) as one compiled graph of
    fixed shape: D positions, top-m candidates, stage 2 over each position's top `n_cols` columns,
    top-k children. The weights it reads (the draft vocabulary's LM-head rows, the previous-token
    table, the AR correction) are module constants, so inductor's freezing prepacks them and, on
    backend compiled-cpp, runs their matmuls in its C++ GEMM template, where ATen's eager bf16 GEMM of
    a few rows over the 8k draft-vocabulary rows is slow on AVX2 CPUs: the compiled heads cost about
    half the eager ones (docs/performance.md, "Compiled TreeFlash heads"). Stage 2's column logits
    are a gathered dot product (no GEMM)."""

    def __init__(self, heads: DraftHeads, m: int, k: int, n_cols: int, depth: int, cpp_gemm: bool):
        super().__init__()
        ar, drafter = heads.drafter.ar_approximation, heads.drafter
        self.m, self.k, self.n_cols, self.depth = m, k, n_cols, depth
        self.norm, self.d = drafter.model.norm, ar.d
        frozen = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.rows = frozen(heads.vocab_rows())         # [Vd, H]
        self.table = frozen(heads.prev_table())        # [Vd, 2A]
        self.w_state = frozen(ar._halves()[1])         # [2A, H]
        zero = torch.zeros(1, dtype=torch.long)
        self.register_buffer("row_pos", torch.cat([zero, torch.arange(1, depth).repeat_interleave(m)]),
                             persistent=False)         # [R] the position each stage-2 row reads
        shape = f"m={m} k={k} cols={n_cols} depth={depth}"
        self.run = aot.compiled_call(  # a package on disk on the CPU (`models/aot.py`)
            self, lambda: aot.key_dir("heads", self, shape, cpp_gemm) / "tables.pt2", lambda: (self.example(), None),
            cpp_gemm, "the TreeFlash heads", dynamic=False, fullgraph=True)
        self.warmed = False

    def forward(self, h: torch.Tensor, root_part: torch.Tensor):
        """h [D+1, H] pre-norm states, root_part [1, 2A] the root's previous-token half ->
        (candidate columns [D, m], stage-2 columns [R, k], log-probs [R, k]), R = 1 + (D-1)*m."""
        m, pos = self.m, self.row_pos
        x = self.norm(h[1:])                                                   # [D, H]
        marginal = (x @ self.rows.T).float().log_softmax(-1)                   # [D, Vd]
        top = marginal.topk(max(m, self.n_cols), -1).indices                   # [D, max(m, C)]
        cols = top[:, :self.n_cols]                                            # [D, C]
        prev_part = torch.cat([root_part, self.table[top[:-1, :m].reshape(-1)]])  # [R, 2A]
        u, g = ((x @ self.w_state.T)[pos] + prev_part).chunk(2, -1)           # [R, A] each
        y = self.norm(h[1:][pos] + self.d(F.silu(g) * u))                      # [R, H]
        w = self.rows[cols[pos]]                                               # [R, C, H]
        logits = (y[:, None, :].float() * w.float()).sum(-1)                  # [R, C]
        vals, idx = logits.log_softmax(-1).topk(self.k, -1)                    # [R, k]
        return top[:, :m], cols[pos].gather(1, idx), vals

    def example(self) -> tuple:
        """Inputs of the graph's fixed shape: h [D+1, H], root_part [1, 2A]."""
        p = self.rows
        return torch.zeros(self.depth + 1, p.shape[1], dtype=p.dtype, device=p.device), self.table[:1].clone()

    @torch.no_grad()
    def warm(self) -> None:
        """Compile now (or load its package), not inside a timed generation; once."""
        if not self.warmed:
            self.run(*self.example())
            self.warmed = True
