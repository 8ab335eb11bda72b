"""Adaptive head budgets (AdaKV): a layer's KV heads share its budget, ranked together, each keeping
a floor and at most its capacity; the cache then holds exactly what it allocated, decode never grows a
head past its share, and the statistics report allocated and kept bytes apart."""

import math

import pytest
import torch
from helpers import tiny_prompt, tiny_transformer

import generation
import strategies
from cache import UNALLOCATED, state_bytes
from cache_args import check_compatibility, default_cache_kwargs
from prompt_compression import HEAD_FLOOR, PromptCompressor

HEAD_DIM = 8


def reference_share(scores: list[list[float]], budget: int, capacity: int, floor: int) -> list[set[int]]:
    """Plain Python: each head's `floor` best first, then the best remaining of any head until the
    layer holds budget x heads, no head above `capacity`."""
    kept = [set(sorted(range(len(s)), key=lambda i: -s[i])[:floor]) for s in scores]
    rest = sorted(((s[i], h, i) for h, s in enumerate(scores) for i in range(len(s)) if i not in kept[h]), reverse=True)
    for _, head, i in rest:
        if sum(map(len, kept)) == budget * len(scores):
            break
        if len(kept[head]) < capacity:
            kept[head].add(i)
    return kept


@pytest.mark.parametrize("seed", range(4))
def test_shared_budget_matches_a_plain_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, 3, 40, generator=generator) + torch.tensor([2.0, 0.0, -2.0]).view(1, 3, 1)
    budget, capacity = 10, 18
    compressor = PromptCompressor(global_tokens=0, recent_window=0)
    keep = compressor.keep_top(torch.arange(40).view(1, 1, -1), scores, budget, capacity)
    assert keep.shape == (1, 3, capacity)
    floor = max(math.ceil(HEAD_FLOOR * budget), 1)
    expected = reference_share(scores[0].tolist(), budget, capacity, floor)
    for head in range(3):
        chosen = [i for i in keep[0, head].tolist() if i >= 0]
        assert chosen == sorted(chosen) and set(chosen) == expected[head]
        assert keep[0, head, len(chosen) :].eq(-1).all(), "a head's unused indices come last"
    counts = [len(e) for e in expected]
    assert counts[0] == capacity and counts[2] == floor and sum(counts) == 3 * budget


def l2_cache(budget: int, capacity: int, heads: int = 3):
    compressor = strategies.compressor_class("l2")(global_tokens=1, recent_window=2)
    return strategies.strategy_class("l2")(
        1, heads, HEAD_DIM, budget, torch.float32, global_tokens=1, recent_window=2,
        prompt_compressor=compressor, head_budgets="adaptive", capacity=capacity,
    )  # fmt: skip


def test_cache_holds_its_share_through_decode_and_reports_allocated_bytes():
    """Head 0's keys are short (kept by l2), head 2's long: head 0 takes more than the uniform share."""
    budget, capacity, prompt = 8, 16, 30
    cache = l2_cache(budget, capacity)
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, prompt, HEAD_DIM, generator=generator) * torch.tensor([0.2, 1.0, 5.0]).view(1, 3, 1, 1)
    k[:, 0, ::2] *= 50  # half of head 0's keys are long: its share stays below the capacity
    v = torch.randn(1, 3, prompt, HEAD_DIM, generator=generator)
    cache.update_kv(torch.arange(prompt), k, v, is_prefill=True, query=torch.randn(1, 3, prompt, HEAD_DIM))
    counts = (cache.pos[0] >= 0).sum(-1).tolist()
    assert sum(counts) == 3 * budget and counts[0] > budget > counts[2]
    assert ((cache.pos[0] >= 0) | (cache.pos[0] == UNALLOCATED)).all(), "kept or unallocated, nothing free"
    for step in range(prompt, prompt + 12):
        cache.update_kv(torch.tensor([step]), torch.randn(1, 3, 1, HEAD_DIM), torch.randn(1, 3, 1, HEAD_DIM))
        assert (cache.pos[0] >= 0).sum(-1).tolist() == counts, "decode evicts within each head's share"
        assert all({0, step, step - 1, step - 2} <= {p for p in cache.pos[0, h].tolist() if p >= 0} for h in range(3))
    stats = cache.compute_statistics(prompt + 12)
    allocated = sum(
        b.numel() * b.element_size()
        for name, b in cache.named_buffers()
        if name not in ("row_offsets", "recent_window")
    )
    assert stats["cache_memory_bytes"] == state_bytes(cache) == allocated
    assert stats["kept_memory_bytes"] == round(allocated * sum(counts) / 3 / capacity)
    assert stats["compression_ratio"] == pytest.approx(1 - budget / (prompt + 12))


def test_reset_returns_to_the_uniform_share():
    cache = l2_cache(8, 16)
    cache.update_kv(torch.arange(30), torch.randn(1, 3, 30, HEAD_DIM), torch.randn(1, 3, 30, HEAD_DIM), True)
    cache.reset()
    assert cache.pos[0, :, :8].eq(-1).all() and cache.pos[0, :, 8:].eq(UNALLOCATED).all()
    for step in range(20):  # a short prompt fed token by token: each head keeps the uniform budget
        cache.update_kv(torch.tensor([step]), torch.randn(1, 3, 1, HEAD_DIM), torch.randn(1, 3, 1, HEAD_DIM))
    assert (cache.pos[0] >= 0).sum(-1).tolist() == [8, 8, 8]


def adaptive_strategies() -> list[str]:
    """Every compressing strategy whose natural compressor (or the cache itself) ranks heads apart."""
    return [
        n
        for n in strategies.compressing_strategies()
        if strategies.ranks_heads_apart(n, strategies.natural_compressor(n))
    ]


@pytest.fixture(scope="module")
def tiny():
    return tiny_transformer(seed=0)


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("name", adaptive_strategies())
def test_every_head_specific_strategy_shares_its_budget(name, chunk, tiny):
    """On the tiny model, one pass or in chunks: every layer holds heads x budget tokens in all, no
    head more than its capacity, no position twice, the global tokens in every head."""
    kwargs = default_cache_kwargs(
        cache_strategy=[name], prompt_compression_strategy=[strategies.natural_compressor(name)],
        max_cache_length=[0.25], global_tokens=2, recent_window=4, head_budgets="adaptive", prefill_chunk_size=chunk,
    )  # fmt: skip
    check_compatibility(kwargs, tiny.config.n_layer)
    torch.manual_seed(0)
    tokens, stats = generation.generate(tiny, tiny_prompt(60, seed=3), 8, kwargs)
    assert len(tokens) == 8
    for layer in tiny.layers:
        cache = layer.attention.kv_cache
        assert cache.max_cache_length > cache.budget
        assert int((cache.pos >= 0).sum()) == cache.pos.shape[1] * cache.budget
        for head_pos in cache.pos[0].tolist():
            kept = [p for p in head_pos if p >= 0]
            assert len(kept) == len(set(kept)) and {0, 1} <= set(kept)
    assert stats["cache_memory_bytes"] > stats["kept_memory_bytes"]


@pytest.mark.parametrize(
    "layers",
    [
        dict(cache_strategy=["kvzip", "l2"], prompt_compression_strategy=["recent_global", "l2"]),
        dict(cache_strategy=["full", "l2"], prompt_compression_strategy=["full", "l2"], max_cache_length=[1.0, 0.25]),
    ],
    ids=["beside_kvzip", "beside_full"],
)
def test_shares_survive_a_reconstruction_pass_and_a_question(layers, tiny):
    """Context-only in chunks, beside a kvzip layer (whose reconstruction pass every layer reads) or
    a full one: each compressing layer ends holding heads x budget tokens, no head grown past its share."""
    kwargs = default_cache_kwargs(
        **{"max_cache_length": [0.25], **layers}, global_tokens=2, recent_window=4, head_budgets="adaptive",
        context_only=True, prefill_chunk_size=16,
    )  # fmt: skip
    check_compatibility(kwargs, tiny.config.n_layer)
    torch.manual_seed(0)
    generation.generate(tiny, tiny_prompt(80, seed=3), 8, kwargs, context_length=70)
    for layer in tiny.layers:
        cache = layer.attention.kv_cache
        if cache.budget < cache.pos.shape[-1]:
            assert int((cache.pos >= 0).sum()) == cache.pos.shape[1] * cache.budget
