"""`treeflash train ...`: features | fit | export | tau.

  treeflash train features --data data/regen/smollm2-135m --out /data/features/smollm2-135m
  treeflash train fit --features /data/features/smollm2-135m --out /runs/tf1 [--resume]
  torchrun --nproc_per_node 2 -m treeflash.cli train fit ...   (DDP, gloo on CPU)
  treeflash train export /runs/tf1/best treeflash/assets/drafters/smollm2-135m-treeflash
  treeflash train tau --drafter DIR[,DIR2] --sets humaneval,gsm8k,mt-bench -n 10 [--tree-size 4,8,16]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from ..cli import add_backend_arg, add_device_arg, add_dtype_arg, add_target_arg
from ..config import check_tree_sizes, tree_sizes_arg, valid_block_len
from ..errors import TreeflashError
from ..options import DRAFTER_METHODS, METHODS, check_method


def register(sub) -> None:
    from ..datasets import DATASETS  # stdlib only

    p = sub.add_parser("train", help="train a DFlash/TreeFlash drafter (features, fit, export, tau)")
    st = p.add_subparsers(dest="stage", required=True)

    f = st.add_parser("features", help="cache target features of regenerated shards (fp16, resumable)")
    add_target_arg(f)
    f.add_argument("--data", required=True, help="directory of shard-NNNNN.jsonl")
    f.add_argument("--out", required=True, help="feature directory (feat-NNNNN.safetensors)")
    f.add_argument("--num-taps", type=int, default=4)
    f.add_argument("--top-k", type=int, default=8, help="target next-token top-K kept for KL")
    f.add_argument("--max-len", type=int, default=1024)
    f.add_argument("--limit-shards", type=int, default=None)
    add_dtype_arg(f, "float32")
    add_device_arg(f)
    f.set_defaults(func=run_features)

    hp = st.add_parser("pairs", help="ShareGPT (user, assistant) pairs as shards (train with --target-labels)")
    add_target_arg(hp)
    hp.add_argument("--out", required=True)
    hp.add_argument("-n", type=int, default=2000, help="pairs to write")
    hp.add_argument("--train-prompts", default="data/prompts/train.jsonl", help="only these prompt ids are used")
    hp.add_argument("--max-len", type=int, default=768)
    hp.add_argument("--shard-size", type=int, default=32, help="sequences per shard (one feature file each)")
    hp.set_defaults(func=run_pairs)

    t = st.add_parser("fit", help="train a drafter on cached features (torchrun for DDP)")
    add_target_arg(t)
    t.add_argument("--features", required=True, nargs="+", help="feature directories or files")
    t.add_argument("--out", required=True, help="run directory (checkpoints, log.jsonl)")
    t.add_argument("--resume", action="store_true", help="continue the checkpoint in --out exactly")
    from .train_config import TrainConfig  # no torch: the trainer loads when `fit` runs
    skip = {"features", "out"}
    for fld in fields(TrainConfig):
        if fld.name in skip:
            continue
        name = "--" + fld.name.replace("_", "-")
        if fld.type in ("bool", bool):
            t.add_argument(name, action=argparse.BooleanOptionalAction, default=fld.default)
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(fld.type), str)
            t.add_argument(name, type=typ, default=fld.default)
    t.set_defaults(func=run_fit)

    e = st.add_parser("export", help="write a trained drafter as bf16 safetensors")
    e.add_argument("checkpoint", help="a run's best/ or last/ directory, or a drafter directory")
    e.add_argument("out")
    e.set_defaults(func=run_export)

    pl = st.add_parser("plot", help="loss and per-position accuracy curves of runs (PNG)")
    pl.add_argument("runs", nargs="+", help="run directories (with log.jsonl)")
    pl.add_argument("--out", required=True, help="PNG file")
    pl.set_defaults(func=run_plot)

    lc = st.add_parser("lookup-calibrate", help="measure lookup-branch scores on target-generated shards")
    lc.add_argument("--data", nargs="+", required=True,
                    help="directories of shard-*.jsonl[.gz] (treeflash data regen: the target's own greedy answers "
                         "to training prompts)")
    lc.add_argument("--out", default=None, help="scores JSON (default: the shipped treeflash/assets/lookup_scores.json)")
    lc.add_argument("--limit", type=int, default=None, help="sequences at most (default: all)")
    lc.set_defaults(func=run_lookup_calibrate)

    m = st.add_parser("tau", help="acceptance length (and tokens/s) on held-out prompts (greedy); several "
                                  "drafters compared in one interleaved run")
    add_target_arg(m)
    m.add_argument("--drafter", default=None, help="drafter directory, or a comma list of them (compared prompt by "
                                                   "prompt on one target); default: the shipped one")
    m.add_argument("--sets", default="humaneval,gsm8k,mt-bench",
                   help=f"comma list of {', '.join(DATASETS)}: the prompts `treeflash bench --datasets NAME "
                        "--num-prompts N` runs, worded as it words them (default: humaneval,gsm8k,mt-bench)")
    m.add_argument("--methods", default=",".join(DRAFTER_METHODS),
                   help=f"comma list of {', '.join(METHODS)}; vanilla runs once")
    m.add_argument("-n", type=int, default=10, help="prompts per set")
    m.add_argument("--tree-size", type=tree_sizes_arg, default=[16],
                   help="nodes per step; a comma list (e.g. 4,8,auto) sweeps")
    m.add_argument("--block-len", type=_block_lens, default=[0],
                   help="rows of the drafter's block pass (0: as deep as the tree); a comma list sweeps")
    add_backend_arg(m)
    m.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=False,
                   help="one untimed generation per arm first (use with --backend compiled when timing)")
    m.add_argument("--max-new-tokens", type=int, default=128)
    add_dtype_arg(m, "float32")
    m.add_argument("--json-out", default=None)
    add_device_arg(m)
    m.set_defaults(func=run_tau)


def feature_files(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(p.glob("feat-*.safetensors"))
            if not files:
                raise TreeflashError(f"no feat-*.safetensors in {p}; run `treeflash train features` first")
            out += files
        elif p.is_file():
            out.append(p)
        else:
            raise TreeflashError(f"missing feature shard or directory {p}")
    return out


def run_features(args) -> int:
    from ..models.drafter_config import default_target_layer_ids
    from ..models.target import Target
    from .features import build_cache, list_shards

    list_shards(args.data)  # fail fast, before loading the target
    if args.num_taps < 1 or args.top_k < 1 or args.max_len < 2:
        raise TreeflashError("bad config value: --num-taps, --top-k must be >= 1 and --max-len >= 2")
    from ..api import check_device

    target = Target.load(args.target, dtype=args.dtype, device=check_device(args.device))
    layers = default_target_layer_ids(target.config.num_hidden_layers, min(args.num_taps, target.config.num_hidden_layers))
    files = build_cache(target, args.data, args.out, layers, args.top_k, args.max_len, args.limit_shards)
    print(f"{len(files)} feature shards in {args.out} (layers {layers})")
    return 0


def run_pairs(args) -> int:
    from ..models.target import Target
    from .features import human_pair_shards

    if not Path(args.train_prompts).is_file():
        raise TreeflashError(f"missing {args.train_prompts}; run `treeflash data prompts` first")
    target = Target.load(args.target)
    n = human_pair_shards(target, args.out, args.n, args.train_prompts, args.max_len, args.shard_size)
    print(f"wrote {n} pairs to {args.out}")
    return 0


def run_fit(args) -> int:
    from ..models.target import Target
    from .trainer import TrainConfig, Trainer, dist_close

    kw = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    kw.update(features=[str(p) for p in feature_files(args.features)], out=args.out)
    cfg = TrainConfig(**kw).check()
    target = Target.load(args.target, dtype="float32")
    try:
        trainer = Trainer(cfg, target, resume=args.resume)
        last = trainer.fit()
    except BaseException:
        dist_close(wait=False)  # the other ranks may be inside a collective: no barrier
        raise
    dist_close()
    if trainer.rank == 0:
        print(json.dumps(last))
    return 0


def run_lookup_calibrate(args) -> int:
    """Agreement rates of lookup edges with the target's greedy continuation, by feature bucket."""
    from ..decoding import lookup as L
    from tqdm import tqdm

    from .data import read_jsonl, shard_files, write_atomic

    seqs = []
    for d in args.data:
        files = shard_files(Path(d))
        if not files:
            raise TreeflashError(f"no shard-*.jsonl[.gz] shards in {d}")
        for f in files:
            seqs += [(r["input_ids"], r["prompt_len"]) for r in read_jsonl(f)]
    if args.limit is not None:
        seqs = seqs[:max(0, args.limit)]
    if not seqs:
        raise TreeflashError("no sequences to calibrate on")
    counts = L.count_agreements(tqdm(seqs, desc="lookup-calibrate", unit="seq", mininterval=5))
    out = Path(args.out) if args.out else L.SCORES_FILE
    meta = {"sequences": len(seqs), "response_tokens": sum(len(i) - p for i, p in seqs),
            "data": [str(d) for d in args.data], "params": vars(L.LookupParams()),
            "buckets": {"match": L.MATCH_BUCKETS, "share": L.SHARE_BUCKETS, "depth": L.DEPTH_BUCKETS}}
    write_atomic(out, json.dumps({**meta, "counts": counts, "log_p": L.scores_from_counts(counts)}) + "\n")
    print(json.dumps({**meta, "out": str(out)}))
    return 0


def run_export(args) -> int:
    from .trainer import export

    out = export(args.checkpoint, args.out)
    print(f"exported {args.checkpoint} -> {out} (bf16)")
    return 0


def read_log(run: Path) -> tuple[list[dict], list[dict]]:
    """(train records, validation records) of a run's log.jsonl."""
    p = Path(run) / "log.jsonl"
    if not p.exists():
        raise TreeflashError(f"no log.jsonl in {run}")
    recs = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return [r for r in recs if "loss" in r], [r for r in recs if "val_loss" in r]


def run_plot(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for run in args.runs:
        tr, va = read_log(Path(run))
        name = Path(run).name
        ax[0].plot([r["step"] for r in tr], [r["loss"] for r in tr], alpha=0.5, label=f"{name} train")
        if va:
            ax[0].plot([r["step"] for r in va], [r["val_loss"] for r in va], "o-", label=f"{name} val")
            for key, col in (("val_acc", 1), ("val_acc_ar", 2)):
                depth = len(va[0][key])
                for k in range(min(depth, 4)):
                    ax[col].plot([r["step"] for r in va], [r[key][k] for r in va], "o-", label=f"{name} pos {k + 1}")
    ax[0].set(title="loss (weighted, marginal + corrected)", xlabel="step")
    ax[1].set(title="val top-1 accuracy, marginal head", xlabel="step")
    ax[2].set(title="val top-1 accuracy, TreeFlash corrected (teacher-forced)", xlabel="step")
    for a in ax:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


# ---------------------------------------------------------------- tau on held-out prompts
def load_prompts(name: str, n: int) -> list[list[str]]:
    """Each prompt is a list of user turns (MT-Bench has two): the n prompts of the bench dataset
    `name` that `treeflash bench --datasets NAME --num-prompts n` runs, worded as it words them
    (treeflash/datasets.py; a `bench:` prefix is accepted and ignored). The tau figures in
    docs/drafter-recipe.md were measured on the first n items of each set in their own wording, so
    these prompts can give slightly different figures."""
    from ..datasets import sample_prompts

    return [s.turns for s in sample_prompts(name.removeprefix("bench:"), n)]


def measure_tau(engines: dict, sets: list[str], methods: list[str], n: int, tree_sizes: list[int | str],
                max_new: int, warm: bool = False, block_lens: tuple[int, ...] = (0,)) -> dict:
    """{set: {label: {tau, steps, tokens, tok_per_s}}}, label "DRAFTER/METHOD@B" (vanilla: "vanilla"),
    with "/LEN" appended for a block length other than the default 0 (`--block-len`); each also
    splits tau by copy steps (`decoding.lookup.copy_steps`).

    engines: {drafter name: Engine}, all on one target. Every arm (drafter x method x budget) runs
    on a prompt before the next prompt (interleaved, so machine noise hits all alike); multi-turn
    prompts reuse each arm's own answers. warm: one untimed short generation per arm first (the
    compiled backend compiles each tree size on first use)."""
    from tqdm import tqdm

    from ..decoding.lookup import copy_split, copy_steps

    arms = [("vanilla", next(iter(engines.values())), "vanilla", 1, 0)] if "vanilla" in methods else []
    arms += [(f"{name}/{m}@{b}" + (f"/{L}" if L else ""), e, m, b, L) for name, e in engines.items()
             for m in methods if m != "vanilla" for b in tree_sizes for L in block_lens]
    if warm:
        for _, e, m, b, L in arms:
            e.generate("Say hello.", method=m, tree_size=b, max_new_tokens=8, block_len=L)
    out = {}
    for name in sets:
        prompts = load_prompts(name, n)
        acc = {label: ([], [], 0, 0.0) for label, *_ in arms}
        for turns in tqdm(prompts, desc=name, leave=False):
            for label, e, m, b, L in arms:
                msgs, (lens, copy, tokens, secs) = [], acc[label]
                for user in turns:
                    msgs.append({"role": "user", "content": user})
                    ids = e.target.encode(msgs)  # encoded once: the generation and the copy split read it
                    r = e.generate(ids, method=m, max_new_tokens=max_new, tree_size=b, block_len=L)
                    copy = copy + copy_steps(ids, r.token_ids, r.stats.acceptance_lengths)
                    msgs.append({"role": "assistant", "content": r.text})
                    lens = lens + r.stats.acceptance_lengths
                    tokens, secs = tokens + r.stats.new_tokens, secs + r.stats.total_s
                acc[label] = (lens, copy, tokens, secs)
        out[name] = {}
        for label, (lens, copy, tokens, secs) in acc.items():
            tau = sum(lens) / max(1, len(lens))
            cs = copy_split(lens, copy)
            out[name][label] = {"tau": round(tau, 3), "steps": len(lens), "tokens": tokens,
                                "tok_per_s": round(tokens / max(secs, 1e-9), 1),
                                **{k: None if v is None else round(v, 3) for k, v in cs.items()}}
            split = (f"; copy steps {cs['copy_step_share']:.0%}: tau {cs['tau_copy_steps'] or 0:.3f}, "
                     f"rest {cs['tau_other_steps'] or 0:.3f}") if label != "vanilla" and lens else ""
            print(f"{name:10s} {label:40s} tau {tau:.3f} ({len(lens)} steps, "
                  f"{tokens / max(secs, 1e-9):.1f} tok/s{split})", flush=True)
    return out


def _parse_ints(value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {value!r}") from None


def _block_lens(value: str) -> list[int]:
    out = _parse_ints(value)
    if not out or not all(map(valid_block_len, out)):
        raise argparse.ArgumentTypeError(f"block lengths must be 0 (as deep as the tree) or >= 2, got {value!r}")
    return out


def run_tau(args) -> int:
    from .. import api

    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        check_method(m)
    check_tree_sizes(args.tree_size)
    sets = [s for s in args.sets.split(",") if s]
    for s in sets:
        load_prompts(s, 1)
    drafters = [d for d in (args.drafter or "").split(",") if d] or [None]
    if len(set(drafters)) != len(drafters):
        raise TreeflashError("a drafter is listed twice")
    engines = {(Path(d).name if d else "default"): api.load(args.target, d, dtype=args.dtype, device=args.device,
                                                              backend=args.backend)
               for d in drafters}
    if len(engines) != len(drafters):
        raise TreeflashError("two drafters share a directory name; give them distinct names")
    res = measure_tau(engines, sets, methods, args.n, args.tree_size, args.max_new_tokens, warm=args.warmup,
                      block_lens=tuple(args.block_len))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from ..cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
