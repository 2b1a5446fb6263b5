"""KV-cache compaction and tree attention against fresh causal forwards."""
import pytest
import torch

from treeflash.decoding.trees import marginal_tree

from conftest import tiny_target


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compacted_cache_equals_fresh_forward(arch):
    target = tiny_target(arch)
    target.set_taps([1, 2])
    prefix = torch.arange(5, 25)
    cache = target.new_cache()
    target.forward(prefix, torch.arange(len(prefix)), cache)
    start = len(prefix)
    tree = marginal_tree(int(prefix[-1]) + 1, torch.randn(4, 128).log_softmax(-1), 14)
    mask = torch.cat([torch.ones(len(tree), start, dtype=torch.bool), tree.ancestor_mask()], 1)
    logits, feats = target.forward(tree.tokens, start + tree.depths, cache, mask=mask)

    # a deepest path through the tree
    leaf = int(tree.depths.argmax())
    path, node = [], leaf
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    path = path[::-1]
    keep = torch.tensor(path)
    target.compact(cache, start, keep)

    fresh_cache = target.new_cache()
    seq = torch.cat([prefix, tree.tokens[keep]])
    f_logits, f_feats = target.forward(seq, torch.arange(len(seq)), fresh_cache)
    for a, b in zip(cache.layers, fresh_cache.layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
    # the tree forward saw exactly the causal context of each path node
    torch.testing.assert_close(logits[keep], f_logits[start:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(feats[keep], f_feats[start:], atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == len(seq)


def test_tree_logits_of_every_node_match_its_own_path():
    """Sibling branches must not see each other (ancestor-only mask)."""
    target = tiny_target("qwen2")
    prefix = torch.arange(3, 13)
    cache = target.new_cache()
    target.forward(prefix, torch.arange(len(prefix)), cache)
    tree = marginal_tree(50, torch.randn(3, 128).log_softmax(-1), 10)
    mask = torch.cat([torch.ones(len(tree), len(prefix), dtype=torch.bool), tree.ancestor_mask()], 1)
    logits, _ = target.forward(tree.tokens, len(prefix) + tree.depths, cache, mask=mask)
    pars = tree.parents.tolist()
    for i in range(len(tree)):
        path, node = [], i
        while node >= 0:
            path.append(int(tree.tokens[node]))
            node = pars[node]
        seq = torch.cat([prefix, torch.tensor(path[::-1])])
        ref, _ = target.forward(seq, torch.arange(len(seq)), target.new_cache(), logits_rows=slice(-1, None))
        torch.testing.assert_close(logits[i], ref[0], atol=1e-4, rtol=1e-4)
