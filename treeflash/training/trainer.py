"""Drafter training: DDP over torch.distributed (gloo on CPU, nccl on GPU) or one plain process.

- data: cached target features (`features.FeatureStore`); a step takes `batch_seqs` sequences
  (global), split over ranks; the order and the anchors depend only on (seed, step), so any world
  size and any resume point see the same batches;
- loss: `objective.DraftObjective`, normalised by the global sum of weights, so N ranks give the
  same gradient as one process;
- AdamW, linear warmup + cosine, grad-clip, optional bf16 autocast;
- checkpoints: `<out>/last/` (drafter safetensors fp32 + optimizer safetensors + state.json),
  replaced atomically (write `last.tmp`, rename); `<out>/best/` holds the best validation drafter;
- logs: `<out>/log.jsonl` (loss, lr, per-position accuracy), tqdm with ETA.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..errors import TreeflashError
from ..fsutil import ensure_writable_dir
from ..models.drafter import Drafter, load_drafter
from ..models.drafter_config import DrafterConfig, check_fits
from ..models.target import Target
from .features import FeatureStore
from .objective import BatchObjective, DraftObjective, LossConfig, block_inputs, cosine_lr, draft_vocab_from_counts, sample_anchors
from .train_config import TrainConfig


# Removed options that an older checkpoint's state.json may still record, with their off value.
# A run that used one cannot be resumed as it was trained.
REMOVED_OPTIONS = {"grow_layers": 0, "short_blocks": 0.0}


# ---------------------------------------------------------------- distributed
def dist_timeout() -> timedelta | None:
    """Collective timeout from TREEFLASH_DIST_TIMEOUT_S (seconds; unset: torch's default, 30 min):
    a rank stuck in a collective then fails with an error instead of hanging its peers."""
    v = os.environ.get("TREEFLASH_DIST_TIMEOUT_S")
    if not v:
        return None
    try:
        s = float(v)
    except ValueError:
        s = -1.0
    if not (s > 0 and math.isfinite(s)):
        raise TreeflashError(f"TREEFLASH_DIST_TIMEOUT_S must be a positive number of seconds, got {v!r}")
    return timedelta(seconds=s)


def dist_env() -> tuple[int, int]:
    """(rank, world); initialises the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        # gloo: training keeps every tensor on the CPU, which nccl cannot reduce (even where a GPU is seen)
        dist.init_process_group("gloo", timeout=dist_timeout())
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def dist_close(wait: bool = True) -> None:
    """Tear the process group down; with `wait`, first wait for every rank (rank 0 may still be
    writing the checkpoint): a rank that exits with a live gloo group can abort under its peers."""
    if dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def all_sum(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t)
    return t


# ---------------------------------------------------------------- drafter
def init_from_target(drafter: Drafter, target: Target) -> None:
    """Copy the target's last decoder layers (and final norm) into the drafter's layers: drafter
    layer i of n gets target layer L - n + i."""
    t_layers = target.decoder.layers
    n = len(drafter.model.layers)
    for i, layer in enumerate(drafter.model.layers):
        src = t_layers[len(t_layers) - n + i].state_dict()
        own = layer.state_dict()
        own.update({k: v for k, v in src.items() if k in own and own[k].shape == v.shape})
        layer.load_state_dict(own)
    if hasattr(target.decoder, "norm"):
        drafter.model.norm.load_state_dict(target.decoder.norm.state_dict())


def with_ar(drafter: Drafter, seed: int) -> Drafter:
    """A TreeFlash drafter around a (possibly plain DFlash) drafter's body; new AR part is identity."""
    if drafter.ar_approximation is not None:
        return drafter
    cfg = DrafterConfig.from_dict(drafter.config.to_dict())
    cfg.ar_approximation = "swiglu"
    new = Drafter(cfg).init_weights(seed)
    new.model.load_state_dict(drafter.model.state_dict())
    new.draft_vocab = drafter.draft_vocab
    return new


def build_drafter(cfg: TrainConfig, target: Target) -> Drafter:
    if cfg.init not in ("target", "random"):
        d = load_drafter(cfg.init).float()
        check_fits(d.config, target.config, target.vocab_rows)
        if cfg.treeflash:
            d = with_ar(d, cfg.seed)
        return d.train()
    dcfg = DrafterConfig.for_target(target.config, num_layers=cfg.num_layers, num_taps=cfg.num_taps,
                                    block_size=cfg.block_size, mask_token_id=target.default_mask_token(),
                                    treeflash=cfg.treeflash, ar_intermediate_size=cfg.ar_size or None)
    dcfg.vocab_size = target.vocab_rows
    if cfg.num_layers > target.config.num_hidden_layers and cfg.init == "target":
        raise TreeflashError(f"cannot initialise {cfg.num_layers} drafter layers from a "
                             f"{target.config.num_hidden_layers}-layer target")
    d = Drafter(dcfg).init_weights(cfg.seed)
    if cfg.init == "target":
        init_from_target(d, target)
    return d.float().train()


# ---------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, drafter: Drafter, opt: torch.optim.Optimizer, state: dict,
                    draft_vocab: torch.Tensor | None) -> None:
    """Write `path` atomically: a sibling tmp dir, then rename (the previous one is kept until then)."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    drafter.save(tmp / "drafter", dtype=None)
    names = {id(p): n for n, p in drafter.named_parameters()}
    tensors = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            n = names[id(p)]
            tensors[f"{n}.exp_avg"] = st["exp_avg"].contiguous()
            tensors[f"{n}.exp_avg_sq"] = st["exp_avg_sq"].contiguous()
            tensors[f"{n}.step"] = torch.as_tensor(st["step"], dtype=torch.float64).reshape(1)
    if draft_vocab is not None:
        tensors["__draft_vocab__"] = draft_vocab.contiguous()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(out: Path) -> Path | None:
    for name in ("last", "last.old"):  # .old survives a crash between the two renames
        if (out / name / "state.json").exists():
            return out / name
    return None


def check_removed_options(path: Path, config: dict) -> None:
    """Refuse to resume a checkpoint trained with an option this version no longer has (set to
    anything but its off value); the `--option` would otherwise be silently dropped."""
    used = {k: config[k] for k in REMOVED_OPTIONS if k in config and config[k] != REMOVED_OPTIONS[k]}
    if used:
        opts = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in used.items())
        raise TreeflashError(f"checkpoint {path} was trained with {opts}, which this version no longer "
                             f"has; it cannot be resumed. Start a new run with --init {path / 'drafter'} "
                             "to fine-tune its drafter")


def load_checkpoint(path: Path, drafter: Drafter, opt: torch.optim.Optimizer):
    from safetensors.torch import load_file

    state = json.loads((path / "state.json").read_text())
    check_removed_options(path, state.get("config", {}))
    d = load_drafter(path / "drafter")
    try:
        drafter.load_state_dict(d.state_dict())
    except RuntimeError as e:
        raise TreeflashError(f"checkpoint {path} holds a drafter of another shape than this config builds "
                             f"({str(e).splitlines()[0]}); resume with the same config") from None
    tensors = load_file(str(path / "optimizer.safetensors"))
    for n, p in drafter.named_parameters():
        if f"{n}.exp_avg" in tensors:
            opt.state[p] = {"step": tensors[f"{n}.step"].reshape(()).float(),
                            "exp_avg": tensors[f"{n}.exp_avg"], "exp_avg_sq": tensors[f"{n}.exp_avg_sq"]}
    return state, tensors.get("__draft_vocab__")


def check_out_dir(out: Path, resume: bool) -> None:
    ensure_writable_dir(out)
    if not resume and find_checkpoint(out) is not None:
        raise TreeflashError(f"{out} already holds a checkpoint; pass --resume to continue it "
                             "or choose another --out")


# ---------------------------------------------------------------- batches
def step_sequences(step: int, n_train: int, batch: int, seed: int) -> list[int]:
    """Global sequence indices of a step: epoch-wise permutations seeded by (seed, epoch)."""
    per_epoch = max(1, n_train // batch)
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return perm[k * batch:(k + 1) * batch].tolist()


def anchors_for(seq: dict, step: int, index: int, cfg: TrainConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 1_000_033 + index)
    return sample_anchors(seq["prompt_len"], seq["ids"].numel(), cfg.max_anchors, g)


def local_weight(obj: DraftObjective, seq: dict, anchors: torch.Tensor) -> float:
    _, _, labels, _ = block_inputs(seq["ids"], anchors, obj.cfg.block_size, obj.drafter.config.mask_token_id,
                                   seq.get("pred"))
    return float(obj.weights(labels).sum())


# ---------------------------------------------------------------- training
class Trainer:
    def __init__(self, cfg: TrainConfig, target: Target, resume: bool = False):
        self.cfg = cfg.check()
        self.rank, self.world = dist_env()
        self.out = Path(cfg.out)
        if self.rank == 0:
            check_out_dir(self.out, resume)
        self.target = target
        torch.manual_seed(cfg.seed)
        self.drafter = build_drafter(cfg, target)
        check_fits(self.drafter.config, target.config, target.vocab_rows)
        dc = self.drafter.config
        self.store = FeatureStore([Path(f) for f in cfg.features], dc.target_layer_ids, dc.hidden_size,
                                  cfg.target_labels)
        n = len(self.store)
        self.n_val = min(cfg.val_seqs, n // 4)
        self.n_train = n - self.n_val
        if self.n_train < 1:
            raise TreeflashError("not enough sequences to train on")
        if cfg.freeze_body:
            for p in self.drafter.model.parameters():
                p.requires_grad_(False)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.step, self.state = 0, {"best_val": None, "elapsed_s": 0.0, "tokens": 0}
        draft_vocab = None
        ckpt = find_checkpoint(self.out) if resume else None
        if ckpt is not None:
            st, draft_vocab = load_checkpoint(ckpt, self.drafter, self.opt)
            if st["config"]["block_size"] != dc.block_size or st["n_train"] != self.n_train:
                raise TreeflashError(f"checkpoint {ckpt} was trained with other data or block size; "
                                     "resume with the same --features and config")
            self.step, self.state = st["step"], st["state"]
        elif cfg.draft_vocab:
            draft_vocab = self.inherited_draft_vocab()
            if draft_vocab is None:
                draft_vocab = self.make_draft_vocab()
        self.draft_vocab = draft_vocab
        self.drafter.draft_vocab = draft_vocab  # saved with every drafter checkpoint (draft_vocab.safetensors)
        emb, head = target.embed.weight, target.lm_head.weight
        lcfg = LossConfig(block_size=dc.block_size, max_anchors=cfg.max_anchors, kl_weight=cfg.kl_weight,
                          ar_weight=cfg.ar_weight if self.drafter.ar_approximation is not None else 0.0,
                          marginal_weight=0.0 if cfg.freeze_body else 1.0,
                          negatives=cfg.negatives if draft_vocab is not None else 0,
                          gamma=cfg.gamma or None)
        self.obj = DraftObjective(self.drafter, emb, head, lcfg, draft_vocab)
        self.val_obj = DraftObjective(self.drafter, emb, head, replace(lcfg, negatives=0, gamma=None), None)  # full vocabulary: honest accuracy
        self.model = BatchObjective(self.obj)
        if self.world > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(self.model, broadcast_buffers=False)
        self._stop = False

    def inherited_draft_vocab(self) -> torch.Tensor | None:
        """The init drafter's draft vocabulary [Vd] when it has one of the requested size, else None.

        A fine-tune keeps the columns its drafter was trained on: a vocabulary recounted on a narrow
        data mix (say, word problems) would drop tokens the drafter already predicts (code)."""
        vocab = self.drafter.draft_vocab  # build_drafter: the init drafter's, None from the target
        return vocab if vocab is not None and len(vocab) == self.cfg.draft_vocab else None

    def make_draft_vocab(self) -> torch.Tensor:
        counts = self.store.token_counts(self.target.vocab_rows)
        return draft_vocab_from_counts(counts, self.cfg.draft_vocab, sorted(self.target.stop_ids()))

    # -- one step
    def run_step(self) -> dict:
        cfg = self.cfg
        idx = step_sequences(self.step, self.n_train, cfg.batch_seqs, cfg.seed)
        mine = idx[self.rank::self.world]
        seqs = [self.store.get(i) for i in mine]
        anchors = [anchors_for(s, self.step, i, cfg) for s, i in zip(seqs, mine)]
        denom = all_sum(torch.tensor([sum(local_weight(self.obj, s, a) for s, a in zip(seqs, anchors))],
                                     dtype=torch.float64), self.world).item()
        lr = cosine_lr(self.step, cfg.steps, cfg.lr, cfg.warmup)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        B = self.drafter.block_size
        metrics = torch.zeros(3 * B + 2, dtype=torch.float64)  # hits, hits_ar, count, loss sum, tokens
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            r = self.model(seqs, anchors)
        if r is None:  # no anchors on this rank: a zero loss keeps DDP's all-reduce in step
            total = sum(p.sum() * 0 for p in self.drafter.parameters() if p.requires_grad)
        else:
            total = r["loss"]
            metrics[:B], metrics[B:2 * B], metrics[2 * B:3 * B] = r["hits"], r["hits_ar"], r["count"]
        metrics[-1] = float(sum(s["ids"].numel() for s in seqs))
        (total * (self.world / max(denom, 1e-9))).backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.opt.step()
        metrics[-2] = float(total.detach())
        metrics = all_sum(metrics, self.world)
        self.step += 1
        return self.summarise(metrics, denom, lr)

    def summarise(self, m: torch.Tensor, denom: float, lr: float) -> dict:
        B = self.drafter.block_size
        cnt = m[2 * B:3 * B].clamp_min(1)
        return {"step": self.step, "loss": round(float(m[-2]) / max(denom, 1e-9), 5), "lr": lr,
                "acc": [round(float(x), 4) for x in (m[:B] / cnt)[1:]],
                "acc_ar": [round(float(x), 4) for x in (m[B:2 * B] / cnt)[1:]], "tokens": int(m[-1])}

    @torch.no_grad()
    def validate(self) -> dict:
        B = self.drafter.block_size
        m = torch.zeros(3 * B + 2, dtype=torch.float64)
        denom = 0.0
        self.drafter.eval()
        for i in range(self.n_train, self.n_train + self.n_val):
            s = self.store.get(i)
            a = anchors_for(s, -1, i, self.cfg)
            if a.numel() == 0:
                continue
            r = self.val_obj(s["feats"], s["ids"], a, s["top_idx"], s["top_logp"], s.get("pred"))
            m[:B] += r["hits"]
            m[B:2 * B] += r["hits_ar"]
            m[2 * B:3 * B] += r["count"]
            m[-2] += float(r["loss"])
            denom += float(r["weight"])
        self.drafter.train()
        out = self.summarise(m, denom, 0.0)
        return {"step": self.step, "val_loss": out["loss"], "val_acc": out["acc"], "val_acc_ar": out["acc_ar"]}

    # -- loop
    def checkpoint(self) -> None:
        if self.rank != 0:
            return
        st = {"step": self.step, "config": asdict(self.cfg), "n_train": self.n_train, "world": self.world,
              "state": self.state}
        save_checkpoint(self.out / "last", self.drafter, self.opt, st, self.draft_vocab)

    def log(self, rec: dict) -> None:
        if self.rank == 0:
            with open(self.out / "log.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")

    def trim_log(self) -> None:
        """On resume, drop log lines of steps after the checkpoint (they will be redone)."""
        p = self.out / "log.jsonl"
        if self.rank != 0 or not p.exists():
            return
        keep = [ln for ln in p.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= self.step]
        p.write_text("".join(ln + "\n" for ln in keep))

    def maybe_best(self, val: dict) -> None:
        score = sum(val["val_acc_ar"] if self.drafter.ar_approximation is not None else val["val_acc"])
        if self.rank == 0 and (self.state["best_val"] is None or score > self.state["best_val"]):
            self.state["best_val"] = score
            self.drafter.save(self.out / "best.tmp", dtype=None)
            shutil.rmtree(self.out / "best", ignore_errors=True)
            os.replace(self.out / "best.tmp", self.out / "best")

    def evaluate(self, last: dict) -> dict:
        """Validate (when there is a validation set), log it and keep the best checkpoint."""
        if not self.n_val:
            return last
        val = self.validate()
        self.log(val)
        self.maybe_best(val)
        return {**last, **val}

    def _on_signal(self, *_):
        self._stop = True

    def fit(self) -> dict:
        cfg = self.cfg
        self.trim_log()
        old = signal.signal(signal.SIGTERM, self._on_signal) if self.rank == 0 else None
        t0, base = time.perf_counter(), self.state["elapsed_s"]
        last = {}
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", disable=self.rank != 0)
        try:
            while self.step < cfg.steps:
                rec = self.run_step()
                self.state["tokens"] += rec["tokens"]
                self.state["elapsed_s"] = base + time.perf_counter() - t0
                rec["elapsed_s"] = round(self.state["elapsed_s"], 1)
                last = rec
                bar.update(1)
                bar.set_postfix(loss=rec["loss"], acc1=rec["acc"][0])
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    self.log(rec)
                timeout = cfg.max_minutes and self.state["elapsed_s"] - base > cfg.max_minutes * 60
                stop = all_sum(torch.tensor([float(self._stop or bool(timeout))]), self.world).item() > 0
                if self.step % cfg.eval_every == 0 or self.step == cfg.steps or stop:  # a stop's steps may be the best
                    last = self.evaluate(last)
                if self.step % cfg.ckpt_every == 0 or self.step == cfg.steps or stop:
                    self.checkpoint()
                if stop:
                    break
        finally:
            bar.close()
            if old is not None:
                signal.signal(signal.SIGTERM, old)
        return last


def run_draft_vocab(checkpoint_dir: Path) -> torch.Tensor | None:
    """The draft vocabulary stored in the optimizer state of `<run>/last` (None if absent)."""
    from safetensors import safe_open

    for run in (checkpoint_dir, checkpoint_dir.parent):
        f = run / "last" / "optimizer.safetensors"
        if f.exists():
            with safe_open(str(f), "pt") as st:
                return st.get_tensor("__draft_vocab__").long() if "__draft_vocab__" in st.keys() else None
    return None


def export(checkpoint_dir: str | Path, out_dir: str | Path, target: Target | None = None) -> Path:
    """Copy a trained drafter (a run's best/ or last/ or any drafter dir) as bf16 safetensors."""
    p = Path(checkpoint_dir)
    src = p / "drafter" if (p / "drafter" / "config.json").exists() else p
    d = load_drafter(src)
    if d.draft_vocab is None:  # runs from before drafters carried it: the run's training vocabulary
        d.draft_vocab = run_draft_vocab(p)
    if target is not None:
        check_fits(d.config, target.config, target.vocab_rows)
    d.save(out_dir, dtype=torch.bfloat16)
    return Path(out_dir)
