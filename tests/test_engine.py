"""Engine state is the engine's own: engines sharing one (process-cached) target, with different
backends and drafters reading different layers, do not change each other's runs."""
from __future__ import annotations

from treeflash.api import Engine, random_drafter

from conftest import tiny_drafter, tiny_target

PROMPT = list(range(3, 24))


def drafter(target, which: str):
    """Engine "a": taps of a 2-tap drafter; engine "b": a 3-tap drafter (other layers)."""
    if which == "a":
        return tiny_drafter(target, seed=1)
    return random_drafter(target, seed=2, num_layers=1, num_taps=3, block_size=8)


def run(engine: Engine) -> tuple[list[int], list[int], str]:
    """(tokens, acceptance lengths, the target's backend right after the generation)."""
    r = engine.generate(PROMPT, method="treeflash", tree_size=6, top_m=3, top_k=3, max_new_tokens=24,
                        ignore_eos=True)
    return r.token_ids, r.stats.acceptance_lengths, engine.target.backend


def test_two_engines_on_one_target_do_not_interfere():
    setups = {"a": "hf", "b": "static"}
    alone = {}
    for which, backend in setups.items():
        target = tiny_target("llama")
        alone[which] = run(Engine(target, drafter(target, which), backend))

    shared = tiny_target("llama")
    engines = {which: Engine(shared, drafter(shared, which), backend) for which, backend in setups.items()}
    assert engines["a"].drafter.config.target_layer_ids != engines["b"].drafter.config.target_layer_ids
    for _ in range(2):  # interleaved: each runs after the other has set the shared target its way
        for which, engine in engines.items():
            tokens, accepted, backend = run(engine)
            assert backend == setups[which]
            assert tokens == alone[which][0]
            assert accepted == alone[which][1]  # the same drafts: this engine's taps were in place
