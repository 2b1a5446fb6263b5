"""One OpenMP team: the same BatchDecoder steps (SmolLM2, compiled, treeflash+lookup@5, one request at a
time) on the main thread and on a second thread while the main thread keeps its OpenMP team
(docs/performance.md, "One OpenMP team"). Usage: python scripts/openmp-teams.py"""
import time, torch, threading, sys
from treeflash.api import load
from treeflash.bench.load import PROMPTS
from treeflash.decoding.batch import BatchDecoder
torch.set_num_threads(2)
engine = load(quiet=True)
engine = type(engine)(engine.target, engine.drafter, backend="compiled")
cfg = engine.config(method="treeflash+lookup", tree_size=5, max_new_tokens=64)
prep = [engine.prepare([{"role": "user", "content": p}], cfg) for p in PROMPTS[:4]]
def run(tag, fix=None):
    if fix == "threads": torch.set_num_threads(2)
    if fix == "denormal": torch.set_flush_denormal(True)
    dec = BatchDecoder(engine.target, engine.drafter, capacity=4096)
    toks = 0; t0 = time.perf_counter()
    for ids, _, prop in prep:
        prop2 = engine.prepare([{"role": "user", "content": "x"}], cfg)[2]
        sid = dec.add(ids, cfg, proposer=prop2)
        (_, st), = dec.run([sid]); toks += st.new_tokens
    print(f"{tag} {fix}: {toks/(time.perf_counter()-t0):.1f} tok/s", flush=True)
run("main")
for fix in (None, "threads", "denormal"):
    t = threading.Thread(target=run, args=("thread", fix)); t.start(); t.join()
run("main")
