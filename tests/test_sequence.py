"""One per-sequence state (decoding/sequence.py): each rule behaves the same for a sequence decoded
alone (`generate.decode`, batch 1) and in a batch beside others (`batch.BatchDecoder`): prompt
checks, the KV reservation, stop ids and stop strings inside one step's accepted tokens,
max_new_tokens and the context window mid-step, cancels, and the stats."""
import pytest
import torch

from treeflash.config import GenerationConfig
from treeflash.decoding.batch import BatchDecoder
from treeflash.decoding.generate import decode
from treeflash.decoding.stats import Stats
from treeflash.decoding.proposers import TreeParams, Vanilla, make_proposer, verify_rows
from treeflash.decoding.sampling import SamplingParams
from treeflash.decoding.text import TextAssembler
from treeflash.errors import TreeflashError

from conftest import oracle, tiny_drafter, tiny_target, vanilla

PROMPT = list(range(3, 20))
OTHERS = [list(range(40, 52)), [7, 8, 9, 7, 8, 9, 7]]  # decoded beside it in the batch
N = 40


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", logit_scale=3.0).set_backend("static")
    drafter = tiny_drafter(target, block_size=8)
    return target, drafter, vanilla(target, PROMPT, N)


def text_for(target, stop):
    return TextAssembler(target.tokenizer, set(), [stop]) if stop else None


def both(setup, n=N, stop_ids=frozenset(), stop=None, prompt=PROMPT, target=None, ref=None):
    """[(tokens, stats, text)] of the oracle treeflash proposer's sequence decoded alone, then in a
    batch beside two other sequences (with their own trees)."""
    tgt, drafter, greedy = setup
    target, ref = target or tgt, ref or greedy
    out = []
    text, stats = text_for(target, stop), Stats()
    p = oracle("treeflash", target, drafter, prompt + ref, 8)
    toks = list(decode(target, p, prompt, n, SamplingParams(), stats=stats, stop_ids=set(stop_ids), text=text))
    out.append((toks, stats, text))
    dec = BatchDecoder(target, drafter)
    cfg = GenerationConfig(method="treeflash", tree_size=8, max_new_tokens=20)
    others = [dec.add(o, cfg, stop_ids=set()) for o in OTHERS if len(o) < target.max_length]
    text = text_for(target, stop)
    sid = dec.add(prompt, GenerationConfig(max_new_tokens=n), stop_ids=set(stop_ids), text=text,
                  proposer=oracle("treeflash", target, drafter, prompt + ref, 8))
    (toks, stats), *_ = dec.run([sid] + others)
    out.append((toks, stats, text))
    return out


def steps_of(stats: Stats) -> list[tuple[int, int]]:
    """(first token index, tokens) of each emitting step of a run (the prefill's token is step 0)."""
    spans, i = [(0, 1)], 1
    for n in stats.acceptance_lengths:
        spans.append((i, n))
        i += n
    return spans


def assert_same(runs):
    (a, sa, _), (b, sb, _) = runs
    assert a == b
    assert (sa.new_tokens, sa.steps, sa.acceptance_lengths, sa.finish_reason) == \
           (sb.new_tokens, sb.steps, sb.acceptance_lengths, sb.finish_reason)


def test_oracle_steps_accept_several_tokens(setup):
    """The cases below need steps that emit 3 tokens or more (else they test nothing mid-step)."""
    (toks, stats, _), _ = both(setup)
    assert toks == setup[2] and max(stats.acceptance_lengths) >= 3


def test_a_stop_string_split_across_one_steps_tokens(setup):
    """A stop string spanning two tokens in the middle of one step's accepted tokens ends the
    sequence at the token completing it, alone and in a batch: the same ids, text and stats."""
    target, _, ref = setup
    (_, full, _), _ = both(setup)
    text = target.tokenizer.decode(ref)
    for first, n in steps_of(full):
        if n < 3:
            continue
        a, b = str(ref[first]), str(ref[first + 1])
        stop = f"{a[-1]} {b[0]}"  # the last digit of one token, the first of the next
        cut = len(target.tokenizer.decode(ref[:first + 1])) - 1  # where the stop string starts
        if text.find(stop) == cut:
            break
    else:
        pytest.skip("no step whose tokens hold a first-seen split stop string")
    runs = both(setup, stop=stop)
    assert_same(runs)
    for toks, stats, txt in runs:
        assert toks == ref[:first + 2] and stats.finish_reason == "stop" and stats.new_tokens == first + 2
        assert txt.final_text() == text[:cut]


def test_a_stop_id_inside_an_accepted_path(setup):
    """A stop id in the middle of one step's accepted tokens: emitted, and nothing after it."""
    _, _, ref = setup
    (_, full, _), _ = both(setup)
    k = next(first + 1 for first, n in steps_of(full) if n >= 3 and ref[first + 1] not in ref[:first + 1])
    runs = both(setup, stop_ids={ref[k]})
    assert_same(runs)
    assert runs[0][0] == ref[:k + 1] and runs[0][1].finish_reason == "stop"


def test_max_new_tokens_reached_mid_step(setup):
    """max_new_tokens ending where an unbounded step would have gone on: the trees are cut to it,
    and both stop at exactly that many tokens ("length")."""
    _, _, ref = setup
    (_, full, _), _ = both(setup)
    first, n = next((f, n) for f, n in steps_of(full) if n >= 3)
    runs = both(setup, n=first + 1)
    assert_same(runs)
    assert runs[0][0] == ref[:first + 1] and runs[0][1].finish_reason == "length"


def test_a_reused_stats_lets_each_generation_decode_its_own_tokens(setup):
    """max_new_tokens counts the sequence's own tokens, not those of a `Stats` it shares: the auto
    tree size's calibration passes one Stats to several generations (each decodes all it asked)."""
    target, drafter, ref = setup
    stats = Stats()
    for _ in range(2):
        p = oracle("treeflash", target, drafter, PROMPT + ref, 8)
        toks = list(decode(target, p, PROMPT, 12, SamplingParams(), stats=stats, stop_ids=set()))
        assert toks == ref[:12] and stats.new_tokens == 12 and stats.finish_reason == "length"


def test_a_full_context_window_ends_both_alike(setup):
    _, drafter, _ = setup
    target = tiny_target("llama", max_pos=40, logit_scale=3.0).set_backend("static")
    target.set_taps(drafter.config.target_layer_ids)
    ref = vanilla(target, PROMPT, 100)
    runs = both(setup, n=100, target=target, ref=ref)
    assert_same(runs)
    assert runs[0][0] == ref and len(PROMPT) + len(ref) == 40 and runs[0][1].finish_reason == "length"


@pytest.mark.parametrize("prompt, n, message", [([], 4, "empty prompt"), (list(range(600)), 4, "context window"),
                                                (PROMPT, 0, "max_new_tokens must be >= 1")])
def test_a_bad_request_is_refused_with_the_same_line(setup, prompt, n, message):
    target, drafter, _ = setup
    errors = []
    for fn in (lambda: next(decode(target, Vanilla(None, target.embed, target.lm_head, TreeParams()), prompt, n,
                                   SamplingParams())),
               lambda: BatchDecoder(target, drafter).add(prompt, GenerationConfig(method="vanilla").replace(
                   max_new_tokens=n))):
        with pytest.raises(TreeflashError, match=message) as e:
            fn()
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "\n" not in errors[0]


@pytest.mark.parametrize("method, budget, rows", [("vanilla", 8, 1), ("treeflash", 8, 8), ("lookup", 5, 5),
                                                  ("treeflash", 1, 1)])
def test_the_kv_reservation_is_the_proposers_rows_past_the_tokens(setup, monkeypatch, method, budget, rows):
    """Alone and in a batch a sequence reserves its tokens (within the window) plus the rows one
    tree of its proposer verifies: plain decoding the root alone, whatever the budget."""
    target, drafter, _ = setup
    assert verify_rows(method, budget) == rows
    p = make_proposer(method, drafter, target.embed, target.lm_head, TreeParams(budget))
    asked = []
    new_cache = target.new_cache
    monkeypatch.setattr(target, "new_cache", lambda need=None: asked.append(need) or new_cache(need))
    list(decode(target, p, PROMPT, 9, SamplingParams(), stop_ids=set()))
    dec = BatchDecoder(target, drafter)
    dec.add(PROMPT, GenerationConfig(max_new_tokens=9), proposer=p)
    assert asked == [dec.waiting[0].reserved] == [len(PROMPT) + 9 + rows]
    assert (dec.waiting[0].dcache is not None) == (method == "treeflash" and budget >= 2)  # drafts: a drafter, budget 2+


def test_a_cancel_mid_step_counts_what_was_taken(setup):
    """A reader that closes the generation after 3 tokens, and a cancel in a batch: "abort", the
    stats closed, the tokens counted those handed out."""
    target, drafter, ref = setup
    stats = Stats()
    gen = decode(target, oracle("treeflash", target, drafter, PROMPT + ref, 8), PROMPT, N, SamplingParams(),
                 stats=stats, stop_ids=set())
    got = [next(gen) for _ in range(3)]
    gen.close()
    assert got == ref[:3] and stats.new_tokens == 3 and stats.finish_reason == "abort" and stats.total_s > 0
    dec = BatchDecoder(target, drafter)
    sid = dec.add(PROMPT, GenerationConfig(max_new_tokens=N), stop_ids=set(),
                  proposer=oracle("treeflash", target, drafter, PROMPT + ref, 8))
    toks = dec.step().get(sid, []) + dec.step().get(sid, [])
    dec.cancel(sid)
    st = dec.finished[sid].stats
    assert toks == ref[:len(toks)] and st.new_tokens == len(toks) and st.finish_reason == "abort" and st.total_s > 0


def test_the_batch_hands_drafter_states_to_the_proposer(setup):
    """The batch's drafter pass reaches the proposer as an argument: no proposer method is replaced
    at run time, and the trees still equal those of the sequence decoded alone."""
    target, drafter, ref = setup
    p = oracle("treeflash", target, drafter, PROMPT + ref, 8)
    before = set(vars(p))
    dec = BatchDecoder(target, drafter)
    sid = dec.add(PROMPT, GenerationConfig(max_new_tokens=12), proposer=p, stop_ids=set())
    dec.step()
    dec.step()
    assert "propose" not in set(vars(p)) - before
    assert dec.run([sid])[0][0][-1] is not None
    stats = Stats()
    alone = list(decode(target, oracle("treeflash", target, drafter, PROMPT + ref, 8), PROMPT, 12, SamplingParams(),
                        stats=stats, stop_ids=set()))
    assert dec.finished[sid].tokens == alone and dec.finished[sid].stats.tree_sizes == stats.tree_sizes
    assert torch.tensor(stats.acceptance_lengths).max() >= 2
