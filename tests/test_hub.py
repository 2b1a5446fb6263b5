"""Models by Hugging Face repository id, from a real hub cache laid out on disk as the hub lays it
(`models--ORG--NAME/snapshots/<hash>/`, `refs/main`), under HF_HUB_OFFLINE=1. No mocks."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from treeflash.models import registry

pytestmark = pytest.mark.slow  # the real SmolLM2 target, in subprocesses

TARGET_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
DRAFTER_REPO = "peerrh/treeflash-smollm2-135m"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def lay_out(hub: Path, repo: str, files: Path) -> Path:
    """Copy a model directory into the hub cache as revision REVISION of `repo`, with refs/main."""
    org, name = repo.split("/")
    root = hub / f"models--{org}--{name}"
    snap = root / "snapshots" / REVISION
    shutil.copytree(files, snap)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(REVISION)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    builtin, _ = registry.resolve_target(registry.DEFAULT_TARGET)  # the dequantised SmolLM2 files
    lay_out(root, TARGET_REPO, builtin)
    exported = root.parent / "exported"
    assert cli_run(None, "export", str(exported), "--format", "treeflash", "--dtype", "float32").returncode == 0
    lay_out(root, DRAFTER_REPO, exported)
    return root


def cli_run(hub: Path | None, *argv) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if hub is not None:
        env["HF_HUB_CACHE"] = str(hub)
    return subprocess.run([sys.executable, "-m", "treeflash", *argv], capture_output=True, text=True,
                          timeout=600, env=env)


def generate(hub, *argv) -> dict:
    r = cli_run(hub, "generate", "Name three colours.", "--json", "--max-new-tokens", "24", "--dtype", "float32",
                "--backend", "static", *argv)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_repository_ids_load_from_the_hub_cache_and_decode_losslessly(hub):
    builtin = generate(hub, "--target", "smollm2-135m", "--tree-size", "8")
    by_id = generate(hub, "--target", TARGET_REPO, "--tree-size", "8")  # the shipped drafter: the id maps to the built-in target
    assert by_id["token_ids"] == builtin["token_ids"]
    assert by_id["stats"]["acceptance_lengths"] == builtin["stats"]["acceptance_lengths"]
    pinned = generate(hub, "--target", f"{TARGET_REPO}@{REVISION}", "--drafter", DRAFTER_REPO, "--method", "vanilla")
    assert pinned["token_ids"] == builtin["token_ids"]


def test_a_drafter_in_the_published_treeflash_layout_loads_from_the_cache(hub):
    builtin = generate(hub, "--method", "treeflash", "--tree-size", "8")
    cached = generate(hub, "--target", TARGET_REPO, "--drafter", DRAFTER_REPO, "--method", "treeflash",
                      "--tree-size", "8")
    assert cached["token_ids"] == builtin["token_ids"]
    random_ = generate(hub, "--drafter", "random", "--method", "treeflash", "--tree-size", "8")
    # the trained drafter from the cache drafts as well as the shipped one, far better than a random one
    assert cached["stats"]["mean_acceptance_length"] > random_["stats"]["mean_acceptance_length"] + 0.3


def test_missing_repository_or_revision_is_one_line_with_the_fetch_command(hub):
    r = cli_run(hub, "generate", "Hi", "--target", "someorg/not-cached", "--drafter", "none", "--method", "vanilla")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: target 'someorg/not-cached' is not in the Hugging Face cache")
    assert "hf download someorg/not-cached" in r.stderr
    r = cli_run(hub, "generate", "Hi", "--target", f"{TARGET_REPO}@v9", "--drafter", "none", "--method", "vanilla")
    assert r.returncode == 2 and "hf download HuggingFaceTB/SmolLM2-135M-Instruct --revision v9" in r.stderr
    r = cli_run(hub, "generate", "Hi", "--drafter", "someorg/no-drafter")
    assert r.returncode == 2 and "error: drafter 'someorg/no-drafter'" in r.stderr and "Traceback" not in r.stderr


def test_device_cuda_without_a_gpu_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    r = cli_run(None, "generate", "Hi", "--device", "cuda", "--drafter", "none", "--method", "vanilla")
    assert r.returncode == 2 and r.stderr.startswith("error: --device cuda: torch sees no CUDA GPU")
