"""The compiled backends' graphs as AOTInductor packages on disk (`models/aot.py`, the default on
the CPU): the target's steps, the drafter's passes and the TreeFlash heads are lossless and match
their eager forms (the checks of test_lossless.py, run again with packages), a later process loads
them instead of rebuilding, a corrupt entry is rebuilt, a module the export cannot take compiles in
process; and `--backend auto` picks the backend it timed faster, once per machine."""
import pytest
import torch

import test_lossless as lossless
from treeflash.decoding import costmodel
from treeflash.decoding.stats import Stats
from treeflash.models import aot

from conftest import oracle, run, tiny_drafter, tiny_target, vanilla

PROMPT = list(range(3, 40, 2))
N = 24


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """Packages on, in an empty cache; yields the list of package files built."""
    monkeypatch.setenv("TREEFLASH_AOT", "1")
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path))
    builds = []
    real_build = aot.build
    monkeypatch.setattr(aot, "build", lambda module, args, shapes, path, cpp: (builds.append(path.name),
                                                                               real_build(module, args, shapes, path, cpp)))
    yield builds


def decode_chain(reference):
    """Greedy chain decoding at budget 4 on the compiled backend."""
    target = tiny_target("llama", logit_scale=3.0).set_backend("compiled")
    drafter = tiny_drafter(target, block_size=4)
    stats = Stats()
    out = run(target, oracle("chain", target, drafter, PROMPT + reference, 4), PROMPT, N, stats=stats)
    return out, stats, target


def test_target_steps_are_lossless_load_from_disk_and_rebuild_a_corrupt_entry(packages, tmp_path, capsys):
    ref = vanilla(tiny_target("llama", logit_scale=3.0), PROMPT, N)
    out, stats, target = decode_chain(ref)
    assert target.runner.aot and out == ref and stats.mean_acceptance_length > 1.5
    assert packages == ["step-2-64.pt2"]
    (folder,) = (tmp_path / "aot").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == sorted(packages)

    packages.clear()  # a later target with the same weights loads the packages
    assert decode_chain(ref)[0] == ref and packages == []

    (folder / "step-2-64.pt2").write_bytes(b"not a package")
    capsys.readouterr()
    assert decode_chain(ref)[0] == ref and packages == ["step-2-64.pt2"]
    assert "treeflash: rebuilding" in capsys.readouterr().err


@pytest.mark.parametrize("check, files", [
    (lossless.test_compiled_backend_is_lossless, {"step-2-64.pt2", "block.pt2", "extend-block.pt2"}),
    (lossless.test_compiled_treeflash_heads_build_the_eager_tables, {"tables.pt2"}),
])
def test_the_compiled_checks_hold_with_packages(packages, check, files):
    check()
    assert set(packages) == files


def test_the_key_follows_the_weights_and_the_options():
    target = tiny_target("llama")
    model, config = target.model, target.model.config.to_json_string()
    a = aot.key_dir("target", model, config, False, taps=[0, 1])
    assert aot.key_dir("target", model, config, False, taps=[0, 1]) == a
    assert aot.key_dir("target", model, config, False, taps=[1]) != a
    assert aot.key_dir("target", model, config, True, taps=[0, 1]) != a
    assert aot.key_dir("drafter", model, config, False, taps=[0, 1]) != a
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1
    assert aot.key_dir("target", model, config, False, taps=[0, 1]) != a


def test_a_target_the_export_cannot_take_compiles_in_process(packages, monkeypatch, capsys):
    def fail(*args):
        raise RuntimeError("unsupported operator")
    monkeypatch.setattr(aot, "build", fail)
    ref = vanilla(tiny_target("llama", logit_scale=3.0), PROMPT, N)
    assert decode_chain(ref)[0] == ref
    assert "compiling in this process instead" in capsys.readouterr().err


def test_auto_backend_picks_the_faster_one_once_per_machine(tmp_path, monkeypatch):
    """auto times static and compiled once (here: given times), keeps the faster, and a later call
    reads the saved choice without timing; without packages, or on an unsupported model, it does
    not time anything."""
    monkeypatch.setenv("TREEFLASH_AOT", "1")
    monkeypatch.setattr(costmodel, "CACHE_FILE", tmp_path / "costs.json")
    target = tiny_target("llama")
    for fast in ("static", "compiled"):
        timed = []

        def measure(t, sizes, use_cache=True, fast=fast):
            timed.append(t.backend)
            return {n: (1.0 if t.backend == fast else 2.0) * n for n in sizes}
        monkeypatch.setattr(costmodel, "measure", measure)
        costmodel.CACHE_FILE.unlink(missing_ok=True)
        assert costmodel.auto_backend(target) == fast and timed == ["static", "compiled"] * 2
        timed.clear()
        assert costmodel.auto_backend(target) == fast and timed == []  # saved
    monkeypatch.setenv("TREEFLASH_AOT", "0")
    costmodel.CACHE_FILE.unlink()
    assert costmodel.auto_backend(target) == "static" and timed == []
    monkeypatch.setattr("treeflash.models.fastpath.supported", lambda config: False)
    assert costmodel.auto_backend(target) == "hf"
