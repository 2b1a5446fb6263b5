"""Compiled target steps as AOTInductor packages on disk (`models/aot.py`, TREEFLASH_AOT=1): lossless
against plain decoding, loaded (not rebuilt) by a later target, and rebuilt when an entry is corrupt."""
import torch

from treeflash.decoding.stats import Stats
from treeflash.models import aot

from conftest import oracle, run, tiny_drafter, tiny_target, vanilla

PROMPT = list(range(3, 40, 2))
N = 24


def decode_chain(reference):
    """Greedy chain decoding at budget 2 (buckets 1 and 2) on the compiled backend."""
    target = tiny_target("llama", logit_scale=3.0).set_backend("compiled")
    drafter = tiny_drafter(target, block_size=4)
    stats = Stats()
    out = run(target, oracle("chain", target, drafter, PROMPT + reference, 2), PROMPT, N, stats=stats)
    return out, stats, target


def test_packaged_steps_are_lossless_load_from_disk_and_rebuild_a_corrupt_entry(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TREEFLASH_AOT", "1")
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path))
    ref = vanilla(tiny_target("llama", logit_scale=3.0), PROMPT, N)
    builds = []
    real_build = aot.build
    monkeypatch.setattr(aot, "build", lambda fp, taps, bucket, path: (builds.append(bucket),
                                                                      real_build(fp, taps, bucket, path)))

    out, stats, target = decode_chain(ref)
    assert target.runner.aot and out == ref and stats.mean_acceptance_length > 1.5
    assert 2 in builds and set(builds) <= {1, 2}
    (folder,) = (tmp_path / "aot").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == [f"step-{b}.pt2" for b in sorted(builds)]

    builds.clear()  # a later target with the same weights loads the packages
    assert decode_chain(ref)[0] == ref and builds == []

    (folder / "step-2.pt2").write_bytes(b"not a package")
    capsys.readouterr()
    assert decode_chain(ref)[0] == ref and builds == [2]
    assert "treeflash: rebuilding" in capsys.readouterr().err


def test_the_key_follows_the_weights_and_the_taps():
    target = tiny_target("llama")
    a = aot.package_dir(target.model, False, (0, 1))
    assert aot.package_dir(target.model, False, (0, 1)) == a
    assert aot.package_dir(target.model, False, (1,)) != a
    assert aot.package_dir(target.model, True, (0, 1)) != a
    with torch.no_grad():
        next(target.model.parameters()).view(-1)[0] += 1
    assert aot.package_dir(target.model, False, (0, 1)) != a


def test_a_target_the_export_cannot_take_compiles_in_process(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TREEFLASH_AOT", "1")
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path))

    def fail(*args):
        raise RuntimeError("unsupported operator")
    monkeypatch.setattr(aot, "build", fail)
    ref = vanilla(tiny_target("llama", logit_scale=3.0), PROMPT, N)
    assert decode_chain(ref)[0] == ref
    assert "compiling in this process instead" in capsys.readouterr().err
