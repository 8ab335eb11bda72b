"""Prompt compressors: exactly `budget` tokens, in position order, global and recent
always kept, and the tokens each rule names."""

import math

import pytest
import torch

import strategies

SNAPKV_POOLING = 7  # the default width of SnapKV's pooling

HEAD_DIM = 16
N_KV, N_HEAD = 2, 4


def inputs(seqlen=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, N_HEAD, seqlen, HEAD_DIM, generator=g)
    k = torch.randn(1, N_KV, seqlen, HEAD_DIM, generator=g)
    v = torch.randn(1, N_KV, seqlen, HEAD_DIM, generator=g)
    return torch.arange(seqlen), k, v, q


def compress(name, budget, global_tokens=2, recent_window=4, seqlen=40, seed=0, data=None):
    input_pos, k, v, q = data or inputs(seqlen, seed)
    keep = strategies.compressor_class(name)(global_tokens, recent_window)(input_pos, k, v, q, budget)
    return keep.expand(1, N_KV, -1)


@pytest.mark.parametrize("name", [n for n, c in strategies.compressors().items() if c.compresses])
@pytest.mark.parametrize("budget", [7, 16, 39])
def test_budget_order_global_and_recent(name, budget):
    torch.manual_seed(0)
    keep = compress(name, budget)
    assert keep.shape == (1, N_KV, budget)
    for head in range(N_KV):
        kept = keep[0, head].tolist()
        assert kept == sorted(set(kept)), "sorted, no duplicates"
        assert {0, 1, 36, 37, 38, 39} <= set(kept)
        assert all(0 <= p < 40 for p in kept)


def test_full_compressor_refuses_to_compress():
    with pytest.raises(ValueError, match="does not fit"):
        compress("full", 16)


def test_recent_global_keeps_the_last_tokens():
    keep = compress("recent_global", 12, global_tokens=3)
    assert keep[0, 0].tolist() == keep[0, 1].tolist() == [0, 1, 2] + list(range(31, 40))


def test_keep_it_odd_keeps_odd_positions():
    # 20 tokens, 1 global, 2 recent (18, 19): the 9 odd positions 1..17 fill the rest exactly
    keep = compress("keep_it_odd", 12, global_tokens=1, recent_window=2, seqlen=20)
    assert keep[0, 0].tolist() == [0, 1, 3, 5, 7, 9, 11, 13, 15, 17, 18, 19]
    # a smaller budget keeps only odd ones besides the protected tokens
    keep = compress("keep_it_odd", 8, global_tokens=1, recent_window=2, seqlen=20)
    assert all(p % 2 for p in set(keep[0, 0].tolist()) - {0, 18, 19})


def test_l2_keeps_lowest_norms_per_head():
    input_pos, k, v, q = inputs()
    norms = k.norm(dim=-1)[0]
    keep = compress("l2", 14, data=(input_pos, k, v, q))
    protected = {0, 1, 36, 37, 38, 39}
    for head in range(N_KV):
        lowest = norms[head, 2:36].argsort()[: 14 - len(protected)] + 2
        assert set(keep[0, head].tolist()) == protected | set(lowest.tolist())
    assert keep[0, 0].tolist() != keep[0, 1].tolist()


def snapkv_inputs(seqlen=40, targets=(10, 25)):
    """Queries of KV head h's group point at key targets[h] only; every other key is small noise.

    KV head 0 holds e0 at targets[0] and e1 at targets[1]; KV head 1 the reverse. Query heads 0, 1
    (group of KV head 0) are e0, heads 2, 3 (group of KV head 1) are e1: both KV heads must keep
    targets[0] if, and only if, query heads are grouped like model.Attention groups them.
    """
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, N_KV, seqlen, HEAD_DIM, generator=g) * 0.01
    v = torch.randn(1, N_KV, seqlen, HEAD_DIM, generator=g)
    e0, e1 = torch.eye(HEAD_DIM)[0] * 12, torch.eye(HEAD_DIM)[1] * 12
    k[0, 0, targets[0]], k[0, 0, targets[1]] = e0, e1
    k[0, 1, targets[0]], k[0, 1, targets[1]] = e1, e0
    q = torch.zeros(1, N_HEAD, seqlen, HEAD_DIM)
    q[0, :2], q[0, 2:] = e0, e1
    return torch.arange(seqlen), k, v, q


def test_snapkv_keeps_the_most_attended_key_and_its_pooled_neighbours():
    data = snapkv_inputs(targets=(10, 25))
    half = SNAPKV_POOLING // 2
    protected = {0, 1, 36, 37, 38, 39}
    keep = compress("heavy_hitter", len(protected) + SNAPKV_POOLING, data=data)
    for head in range(N_KV):
        assert set(keep[0, head].tolist()) == protected | set(range(10 - half, 10 + half + 1))
    # with room for one more, the single extra token is from the pooled neighbourhood of 10
    keep = compress("heavy_hitter", len(protected) + 1, data=data)
    for head in range(N_KV):
        (extra,) = set(keep[0, head].tolist()) - protected
        assert abs(extra - 10) <= half


def test_snapkv_is_head_specific():
    _, k, v, q = snapkv_inputs(targets=(10, 25))
    k[0, 1, 10], k[0, 1, 25] = k[0, 1, 25].clone(), k[0, 1, 10].clone()  # KV head 1 now points its queries at 25
    half = SNAPKV_POOLING // 2
    keep = compress("heavy_hitter", 6 + SNAPKV_POOLING, data=(torch.arange(40), k, v, q))
    assert set(keep[0, 0].tolist()) - {0, 1, 36, 37, 38, 39} == set(range(10 - half, 10 + half + 1))
    assert set(keep[0, 1].tolist()) - {0, 1, 36, 37, 38, 39} == set(range(25 - half, 25 + half + 1))


def test_snapkv_scores_are_pooled_window_attention():
    input_pos, k, v, q = inputs(seqlen=24)
    compressor = strategies.compressor_class("heavy_hitter")(global_tokens=1, recent_window=5)
    score = compressor.score(input_pos, k, v, q, input_pos.view(-1)[-q.shape[2] :])
    # brute force: softmax of each of the last 5 queries over the keys it can see, averaged over the
    # window and the query heads of each KV head, then a width-7 average pool (zero padded)
    keys = k.repeat_interleave(N_HEAD // N_KV, dim=1)
    logits = q @ keys.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    logits = logits.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), -math.inf)
    attn = torch.softmax(logits, -1)[:, :, -5:].mean(2).view(1, N_KV, N_HEAD // N_KV, 24).mean(2)
    padded = torch.nn.functional.pad(attn, (3, 3))
    pooled = torch.stack([padded[..., i : i + 7].sum(-1) / 7 for i in range(24)], -1)
    torch.testing.assert_close(score, pooled)


def test_random_is_seeded_and_head_constant():
    def run(seed):
        torch.manual_seed(seed)
        return compress("random", 16)

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[0, 0], a[0, 1])


@pytest.mark.parametrize("name", [n for n, c in strategies.compressors().items() if c.compresses])
def test_head_specific_flag_says_whether_heads_keep_different_tokens(name):
    keep = compress(name, 16)
    assert (keep[0, 0].tolist() != keep[0, 1].tolist()) == strategies.compressor_class(name).head_specific
