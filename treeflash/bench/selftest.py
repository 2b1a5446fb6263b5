"""`treeflash selftest`: exactness and a greedy bench on one device, as one JSON report.

Made for a GPU machine that has PyTorch and transformers but no package registry and no room for
the offline targets' weights (`make gpu-check`; docs/performance.md, "GPU check", says how to run it):

1. exactness: every method and several budgets on tiny random Llama / Qwen2 / Qwen3 targets, fp32
   on the device, greedy output compared token by token with plain decoding (any difference fails
   the run); in bf16 the identity is measured and reported, not required; batched decoding (one
   request per method, staggered) against the same reference;
2. bench: greedy tokens/s and tau of vanilla, chain, marginal, treeflash (and treeflash+lookup) at
   the given budgets, on the built-in target when it can be loaded here, else on a random-weight
   model of SmolLM2-135M's shape with the shipped drafter (speed only: its tau means nothing).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..options import CORE_METHODS

# torch and transformers are imported where they are used: `treeflash selftest --help` loads neither

ARCHS = {  # name -> (config class, model class, extra config) in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True)


class NoTokenizer:
    """For targets driven by token ids: only the attributes the engine reads exist."""

    chat_template = None
    eos_token_id = bos_token_id = pad_token_id = unk_token_id = None
    all_special_ids: list[int] = []
    added_tokens_decoder: dict = {}

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self):
        return self.vocab

    def decode(self, ids, **_kw) -> str:
        return " ".join(map(str, ids))


def random_model(arch: str, seed: int, device="cpu", **cfg):
    import torch
    import transformers

    cfg_name, model_name, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(eos_token_id=None, bos_token_id=None, pad_token_id=None,
                                             **{**extra, **cfg})
    return getattr(transformers, model_name)(config).float().eval().to(device)


def tiny_target(arch: str = "llama", vocab: int = 128, layers: int = 4, seed: int = 0,
                logit_scale: float = 1.0, max_pos: int = 512, device="cpu", dtype=None):
    """A random-weight 4-layer target of `arch` (hidden 64), its LM head scaled by `logit_scale`
    (larger: peakier distributions, so greedy choices are far from ties); dtype: default float32."""
    import torch

    from ..models.target import Target

    model = random_model(arch, seed, device, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_pos, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return Target(model.to(dtype or torch.float32), NoTokenizer(vocab), name=f"tiny-{arch}")


def greedy(target, method: str, drafter, prompt: list[int], n: int, budget: int):
    import torch

    from ..decoding.generate import decode
    from ..decoding.proposers import TreeParams, make_proposer
    from ..decoding.sampling import SamplingParams
    from ..decoding.stats import Stats

    stats = Stats()
    p = make_proposer(method, drafter if method not in ("vanilla", "lookup") else None, target.embed,
                      target.lm_head, TreeParams(budget, 4, 4))
    with torch.no_grad():
        out = list(decode(target, p, prompt, n, SamplingParams(), stats=stats, stop_ids=set()))
    return out, stats


def recompute_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from the model's own forward over the whole sequence at every step: no KV cache,
    no tree, no backend of ours (the reference that catches a backend's own bug)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def exactness(device: str, budgets=(2, 8, 33), n: int = 48, backends=("hf", "static")) -> list[dict]:
    """Rows {arch, dtype, backend, method, budget, identical, tau}: every method (plain decoding too) on
    every backend against `recompute_greedy`; fp32 rows must be identical."""
    import torch

    from ..models.drafter import random_drafter
    from ..options import METHODS

    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 11, 12, 5, 6, 7]  # repeats: lookup branches get accepted
    rows = []
    for arch in ARCHS:
        for dtype in (torch.float32, torch.bfloat16):
            target = tiny_target(arch, logit_scale=3.0, device=device, dtype=dtype)
            drafter = random_drafter(target, seed=1, num_layers=1, num_taps=2, block_size=8)
            target.set_taps(drafter.config.target_layer_ids)
            ref = recompute_greedy(target.model, prompt, n)
            for backend in backends:
                target.set_backend(backend)
                for method in METHODS:
                    for b in ([1] if method == "vanilla" else budgets):
                        out, st = greedy(target, method, drafter, prompt, n, b)
                        same = next((i for i, (a, c) in enumerate(zip(out, ref)) if a != c), len(ref))
                        rows.append({"arch": arch, "dtype": str(dtype).split(".")[1], "backend": target.backend,
                                     "method": method, "budget": b, "identical": out == ref,
                                     "tokens_before_first_difference": same,
                                     "tau": round(st.mean_acceptance_length, 3)})
    return rows


def batch_exactness(device: str, n: int = 40) -> list[dict]:
    """Rows {arch, method, budget, identical}: batched decoding (static backend, fp32) of one request per
    method, each added one step after the previous one, prompts prefilled 7 tokens per step, every
    answer against its `recompute_greedy`."""
    import torch

    from ..config import GenerationConfig
    from ..decoding.batch import BatchDecoder
    from ..models.drafter import random_drafter
    from ..options import METHODS

    rows = []
    for arch in ARCHS:
        target = tiny_target(arch, logit_scale=3.0, device=device).set_backend("static")
        drafter = random_drafter(target, seed=1, num_layers=1, num_taps=2, block_size=8)
        target.set_taps(drafter.config.target_layer_ids)
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, 60, (4 + 5 * i,), generator=g).tolist() + [5, 6, 7, 5, 6, 7]
                   for i in range(len(METHODS))]
        budgets = [1 if m == "vanilla" else (4, 8, 16)[i % 3] for i, m in enumerate(METHODS)]
        dec, ids, who = BatchDecoder(target, drafter, capacity=2048, prefill_chunk=7), {}, {}  # prompts in chunks
        for step in range(10_000):
            if step < len(METHODS):
                cfg = GenerationConfig(method=METHODS[step], tree_size=budgets[step], max_new_tokens=n, ignore_eos=True)
                who[dec.add(prompts[step], cfg)] = step
            if not dec.busy:
                break
            for sid, toks in dec.step().items():
                ids.setdefault(sid, []).extend(toks)
        for sid, i in who.items():
            ref = recompute_greedy(target.model, prompts[i], n)
            rows.append({"arch": arch, "method": METHODS[i], "budget": budgets[i], "identical": ids.get(sid) == ref})
    return rows


def bench_batch(engine, sizes=(1, 8, 32), budget: int = 16, max_new: int = 64) -> list[dict]:
    """Aggregate greedy tokens/s of `Engine.generate_batch` over B random prompts, plain and treeflash."""
    import torch

    from ..api import Engine

    engine = Engine(engine.target, engine.drafter, "static")  # batched decoding runs the static backend
    g = torch.Generator().manual_seed(3)
    vocab = engine.target.vocab_rows
    rows = []
    for b in sizes:
        prompts = [torch.randint(100, min(vocab, 40000), (48,), generator=g).tolist() for _ in range(b)]
        for method, tree in (("vanilla", 1), ("treeflash", budget)):
            engine.generate_batch(prompts, method=method, tree_size=tree, max_new_tokens=4, ignore_eos=True, chat=False)
            t0 = time.perf_counter()
            res = engine.generate_batch(prompts, method=method, tree_size=tree, max_new_tokens=max_new,
                                        ignore_eos=True, chat=False)
            secs = time.perf_counter() - t0
            tokens = sum(r.stats.new_tokens for r in res)
            rows.append({"batch": b, "method": method, "budget": tree, "tokens_per_s": round(tokens / secs, 1)})
    return rows


def bench_target(name: str, device: str):
    """(engine, prompts as token ids, what was loaded)."""
    import torch

    from .. import api
    from ..models.target import Target

    try:
        engine = api.load(name, None, dtype="bfloat16", device=device, quiet=True)
        ids = [engine.target.encode(p) for p in api.CALIBRATION_PROMPTS]
        return engine, ids, f"{name} with its shipped drafter"
    except Exception as e:  # noqa: BLE001 (no gguf package or weights here): fall back to the shape
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
    model = random_model("llama", 0, device, **SMOLLM2_SHAPE).to(torch.bfloat16)
    target = Target(model, NoTokenizer(SMOLLM2_SHAPE["vocab_size"]), name="random-smollm2-shape")
    from ..models import registry
    from ..models.drafter import load_drafter

    drafter = load_drafter(registry.resolve_drafter("smollm2-135m-treeflash", "smollm2-135m"), dtype=torch.bfloat16)
    engine = api.Engine(target, drafter)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(100, 40000, (64,), generator=g).tolist() for _ in range(3)]
    return engine, ids, f"random weights of SmolLM2-135M's shape + the shipped drafter ({name} not loadable: {why})"


def bench(engine, prompts: list[list[int]], budgets, max_new: int = 128) -> list[dict]:
    methods = [*CORE_METHODS, "treeflash+lookup"]
    rows = []
    for method in methods:
        for b in ([1] if method == "vanilla" else budgets):
            engine.generate(prompts[0], method=method, tree_size=b, max_new_tokens=8)  # warm-up
            tokens = steps = 0
            secs = 0.0
            for ids in prompts:
                r = engine.generate(ids, method=method, tree_size=b, max_new_tokens=max_new, ignore_eos=True)
                tokens += r.stats.new_tokens
                steps += r.stats.steps
                secs += r.stats.total_s
            rows.append({"method": method, "budget": b, "tokens_per_s": round(tokens / secs, 1),
                         "tau": round((tokens - len(prompts)) / max(1, steps), 3)})
    return rows


def run(args) -> int:
    import torch

    from ..api import check_device
    from ..config import check_tree_sizes

    device = check_device(args.device)
    budgets = check_tree_sizes(args.budgets, "--budgets")
    t0 = time.perf_counter()
    report = {"device": device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}
    print(f"treeflash selftest on {device}: exactness ...", file=sys.stderr, flush=True)
    report["exactness"] = exactness(device) if not args.bench_only else []
    fp32 = [r for r in report["exactness"] if r["dtype"] == "float32"]
    bf16 = [r for r in report["exactness"] if r["dtype"] == "bfloat16"]
    report["fp32_all_identical"] = all(r["identical"] for r in fp32) if fp32 else None  # None: skipped
    report["bf16_identical_share"] = round(sum(r["identical"] for r in bf16) / len(bf16), 3) if bf16 else None
    print(f"treeflash selftest: fp32 identical {sum(r['identical'] for r in fp32)}/{len(fp32)}; batched ...",
          file=sys.stderr, flush=True)
    report["batch_exactness"] = batch_exactness(device) if not args.bench_only else []
    report["batch_all_identical"] = (all(r["identical"] for r in report["batch_exactness"])
                                     if report["batch_exactness"] else None)
    print(f"treeflash selftest: batched fp32 identical {sum(r['identical'] for r in report['batch_exactness'])}"
          f"/{len(report['batch_exactness'])}; bench ...", file=sys.stderr, flush=True)
    engine, prompts, what = bench_target(args.target, device)
    report["bench_target"] = what
    report["bench"] = bench(engine, prompts, budgets, args.max_new_tokens)
    report["bench_batch"] = bench_batch(engine)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for r in report["bench"]:
        print(f"{r['method']}@{r['budget']}: {r['tokens_per_s']} tok/s, tau {r['tau']}", file=sys.stderr)
    for r in report["bench_batch"]:
        print(f"batch {r['batch']} {r['method']}@{r['budget']}: {r['tokens_per_s']} tok/s in all", file=sys.stderr)
    ok = report["fp32_all_identical"] is not False and report["batch_all_identical"] is not False
    verdict = "skipped" if args.bench_only else "passed" if ok else "FAILED"
    print(f"wrote {out}: fp32 exactness {verdict}", file=sys.stderr)
    return 0 if ok else 1


def register(sub) -> None:
    from ..cli import add_device_arg, add_target_arg
    from ..config import tree_sizes_arg

    p = sub.add_parser("selftest", help="exactness on this device and a greedy bench, as one JSON report")
    add_device_arg(p)
    add_target_arg(p, "bench target (falls back to SmolLM2's shape)")
    p.add_argument("--budgets", type=tree_sizes_arg, default="16,64", help="comma list of tree sizes for the bench")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="bench-out/selftest.json")
    p.add_argument("--bench-only", action="store_true", help="skip the exactness runs (a rerun of the bench)")
    p.set_defaults(func=run)
