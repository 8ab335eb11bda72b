"""Eviction semantics of every cache strategy on tiny hand-made tensors, exact.

Caches are driven the way model.Attention drives them: `update_kv(input_pos, k, v)` for one decode
token (then `update_state(..., attn)` with hand-made attention [B, H, G, 1, L] for caches that need
it), or `update_kv(..., is_prefill=True, query=q)` for a prompt. Expected contents are written out by
hand, or (for long random runs) computed by a plain-Python reference of the eviction rule.
"""

import math

import pytest
import torch

import attention
import strategies
from attention import attention_with_probs
from cache import layer_cache_lengths, layer_strategies, resolve_recent_window
from cache_args import check_cache_lengths, check_compatibility, default_cache_kwargs
from quantization_utils import QuantizedTensor, dequantize
from strategies.heavy_hitter import HeavyHitterCache, keep_top_fraction

HEAD_DIM = 8
EVICTING = strategies.compressing_strategies()  # every registered strategy that evicts


def make_cache(name, length=8, heads=2, global_tokens=1, recent_window=0, dtype=torch.float32, **kwargs):
    compressor = kwargs.pop("compressor", "recent_global")
    recent_for_compressor = resolve_recent_window(recent_window, length, global_tokens)
    kwargs["prompt_compressor"] = strategies.compressor_class(compressor)(global_tokens, recent_for_compressor)
    return strategies.strategy_class(name)(
        1, heads, HEAD_DIM, length, dtype, global_tokens=global_tokens, recent_window=recent_window, **kwargs
    )


def held(cache, head=0):
    """Positions held by one head, as a set."""
    return {p for p in cache.pos[0, head].tolist() if p >= 0}


def random_kv(n, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, n, HEAD_DIM, generator=g), torch.randn(1, heads, n, HEAD_DIM, generator=g)


def decode(cache, pos, k=None, v=None, attn=None):
    """One decode step at `pos`; `attn` [H, L] (or [L], shared by heads) is recorded when the cache wants it."""
    heads = cache.pos.shape[1]
    if k is None:
        k, v = random_kv(1, heads, seed=pos)
    cache.update_kv(torch.tensor([pos]), k, v)
    if cache.return_attn():
        if attn is None:  # uniform over filled slots
            filled = (cache.pos[0] >= 0).float()
            attn = filled / filled.sum(-1, keepdim=True)
        attn = torch.as_tensor(attn, dtype=torch.float32).expand(heads, cache.max_cache_length)
        cache.update_state(torch.tensor([pos]), k, v, False, attn.reshape(1, heads, 1, 1, -1))


def prefill(cache, n, heads=2, seed=0, n_query_heads=None):
    k, v = random_kv(n, heads, seed)
    q = torch.randn(1, n_query_heads or heads, n, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1))
    cache.update_kv(torch.arange(n), k, v, is_prefill=True, query=q)
    return q, k, v


# -- recent_global ------------------------------------------------------------------------------
def test_recent_global_by_decode_holds_globals_and_latest():
    cache = make_cache("recent_global", length=8, global_tokens=2, recent_window=10)
    assert cache.recent_window == 0  # recent_global evicts by position, it needs no protected window
    for pos in range(21):
        decode(cache, pos)
    for head in range(2):
        assert held(cache, head) == {0, 1, 15, 16, 17, 18, 19, 20}


@pytest.mark.parametrize("prompt_length", [5, 8, 21])
def test_recent_global_prefill_then_decode(prompt_length):
    """Prompt shorter than, equal to, and longer than the cache (compressed by recent_global)."""
    cache = make_cache("recent_global", length=8, global_tokens=2, recent_window=3)
    prefill(cache, prompt_length)
    for pos in range(prompt_length, 21):
        decode(cache, pos)
    assert held(cache, 0) == held(cache, 1) == {0, 1, 15, 16, 17, 18, 19, 20}


def test_keys_and_values_follow_positions():
    """Each slot holds the key and value of the position it records; the mask marks filled slots."""
    cache = make_cache("recent_global", length=8, global_tokens=2)
    k, v = random_kv(22)
    for pos in range(5):
        keys, values, mask = cache.update_kv(torch.tensor([pos]), k[:, :, pos : pos + 1], v[:, :, pos : pos + 1])
    assert mask[0].tolist() == [[True] * 5 + [False] * 3] * 2
    for pos in range(5, 22):
        keys, values, mask = cache.update_kv(torch.tensor([pos]), k[:, :, pos : pos + 1], v[:, :, pos : pos + 1])
    order = cache.pos[0].long().unsqueeze(-1).expand(-1, -1, HEAD_DIM)
    assert mask.all() and held(cache) == {0, 1, 16, 17, 18, 19, 20, 21}
    assert torch.equal(keys[0], k[0].gather(1, order)) and torch.equal(values[0], v[0].gather(1, order))


# -- heavy_hitter ---------------------------------------------------------------------------------
def feed_attention(cache, steps):
    """Decodes positions 0.. with per-step attention rows ([L] or [H, L])."""
    for pos, attn in enumerate(steps):
        decode(cache, pos, attn=attn)


# Per-step attention over 4 slots; slot i holds position i. Head 0 and head 1 differ at the last step.
HH_STEPS = [
    [1.0, 0, 0, 0],
    [0.5, 0.5, 0, 0],
    [0.4, 0.3, 0.3, 0],
    [[0.1, 0.6, 0.15, 0.15], [0.05, 0.05, 0.4, 0.5]],
]


def test_heavy_hitter_evicts_least_mean_attention_per_head():
    # head 0: means 1.4/3, 0.45/2, 0.15/1 -> evicts position 3
    # head 1: means 0.85/3 = 0.283, 0.7/2, 0.5/1 -> evicts position 1 (a raw sum would evict 3)
    cache = make_cache("heavy_hitter", length=4, global_tokens=1, recent_window=0)
    feed_attention(cache, HH_STEPS)
    torch.testing.assert_close(cache.attn_counter[0], torch.tensor([[4.0, 3, 2, 1]] * 2))
    expected_means = torch.tensor([[2.0 / 4, 1.4 / 3, 0.45 / 2, 0.15], [1.95 / 4, 0.85 / 3, 0.7 / 2, 0.5]])
    torch.testing.assert_close(cache.score(cache.pos, *cache.read(), None, torch.tensor([4]))[0], expected_means)
    decode(cache, 4)
    assert held(cache, 0) == {0, 1, 2, 4}
    assert held(cache, 1) == {0, 2, 3, 4}
    # the new slot's history starts empty, then records its own first step
    assert cache.attn_counter[0, 0, 3] == 1 and cache.attn_counter[0, 1, 1] == 1


def test_heavy_hitter_windowed_history_forgets_old_attention():
    # Position 1 got 0.8 early, then 0.1 twice. Whole history: mean 1.0/3 = 0.33 > position 3's 0.3,
    # so position 3 goes. A 2-step window only remembers 0.1 + 0.1 -> position 1 goes.
    steps = [[1.0, 0, 0, 0], [0.2, 0.8, 0, 0], [0.3, 0.1, 0.6, 0], [0.3, 0.1, 0.3, 0.3]]
    whole = make_cache("heavy_hitter", length=4, heads=1, global_tokens=1, recent_window=0)
    windowed = make_cache("heavy_hitter", length=4, heads=1, global_tokens=1, recent_window=0, history_window_size=2)
    feed_attention(whole, steps)
    feed_attention(windowed, steps)
    torch.testing.assert_close(
        windowed.score(windowed.pos, *windowed.read(), None, torch.tensor([4]))[0, 0, 1:],
        torch.tensor([0.1, 0.45, 0.3]),
    )
    decode(whole, 4)
    decode(windowed, 4)
    assert held(whole) == {0, 1, 2, 4}
    assert held(windowed) == {0, 2, 3, 4}


def test_heavy_hitter_thresholding_counts_uniform_or_above():
    # Raw means: position 1 (0.5 + 0.05 + 0.52) / 3 = 0.357, position 2 (0.65 + 0.03) / 2 = 0.34, position 3 0.26.
    # Thresholded (>= 1 / filled slots): position 1 -> 2/3, position 2 -> 1/2, position 3 -> 1 (0 -> 2/4).
    steps = [[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.3, 0.05, 0.65, 0], [0.19, 0.52, 0.03, 0.26]]
    raw = make_cache("heavy_hitter", length=4, heads=1, global_tokens=1, recent_window=0)
    binary = make_cache("heavy_hitter", length=4, heads=1, global_tokens=1, recent_window=0, attn_thresholding=True)
    feed_attention(raw, steps)
    feed_attention(binary, steps)
    torch.testing.assert_close(
        binary.score(binary.pos, *binary.read(), None, torch.tensor([4]))[0, 0], torch.tensor([0.5, 2 / 3, 1 / 2, 1.0])
    )
    decode(raw, 4)
    decode(binary, 4)
    assert held(raw) == {0, 1, 2, 4}
    assert held(binary) == {0, 1, 3, 4}


def test_keep_top_fraction():
    attn = torch.tensor([[[0.1, 0.4, 0.2, 0.3, 0.0, 0.0, 0.0, 0.0]]])
    filled = torch.tensor([[[1.0, 1, 1, 1, 0, 0, 0, 0]]])
    out = keep_top_fraction(attn, 0.25, filled, torch.tensor([8]))  # ceil(0.25 * 8) = 2 weights survive
    torch.testing.assert_close(out, torch.tensor([[[0.0, 0.4, 0.0, 0.3, 0, 0, 0, 0]]]))


def test_heavy_hitter_attn_top_k_changes_the_choice():
    # All weights: position 1 (0.4 + 0.2 + 0.15) / 3 = 0.25, position 2 (0.3 + 0.15) / 2 = 0.225 -> 2 goes.
    # Top half (2 of 4 slots, ties kept): position 1 loses its 0.2 -> 0.55 / 3 = 0.183 -> 1 goes.
    steps = [[1.0, 0, 0, 0], [0.6, 0.4, 0, 0], [0.5, 0.2, 0.3, 0], [0.1, 0.15, 0.15, 0.6]]
    full = make_cache("heavy_hitter", length=4, heads=1, global_tokens=1, recent_window=0)
    top = make_cache("heavy_hitter", length=4, heads=1, global_tokens=1, recent_window=0, attn_top_k=0.5)
    feed_attention(full, steps)
    feed_attention(top, steps)
    torch.testing.assert_close(top.attn_history[0, 0, :, 0], torch.tensor([2.1, 0.55, 0.45, 0.6]))
    decode(full, 4)
    decode(top, 4)
    assert held(full) == {0, 1, 3, 4}
    assert held(top) == {0, 2, 3, 4}


def reference_heavy_hitter(steps, length, global_tokens, recent_window, window, thresholding):
    """Plain-Python H2O: positions held after decoding len(steps) tokens.

    `steps[t]` is a function (held positions by slot) -> attention per slot, called after token t
    is inserted. Returns the slot contents after every step.
    """
    slots = [None] * length
    records = [[] for _ in range(length)]
    history = []
    for t, attn_fn in enumerate(steps):
        if None in slots:
            slot = slots.index(None)
        else:

            def score(i, t=t):
                p = slots[i]
                if p < global_tokens or p >= t - recent_window:
                    return math.inf
                kept = records[i] if window == 1 else records[i][-window:]
                return sum(kept) / max(1, len(kept))

            slot = min(range(length), key=score)
        slots[slot], records[slot] = t, []
        attn = attn_fn(slots)
        n_filled = sum(p is not None for p in slots)
        for i, p in enumerate(slots):
            if p is not None:
                a = float(attn[i])
                records[i].append(float(a >= 1.0 / n_filled) if thresholding else a)
        history.append(list(slots))
    return history


@pytest.mark.parametrize(
    "window,thresholding",
    [(1, False), (3, False), (1, True), (3, True)],
    ids=["whole", "window3", "threshold", "window3-threshold"],
)
def test_heavy_hitter_matches_reference_on_random_attention(window, thresholding):
    length, global_tokens, recent_window, n_steps = 8, 2, 2, 40
    g = torch.Generator().manual_seed(window * 10 + thresholding)
    logits = torch.randn(n_steps, length, generator=g) * 2

    def attn_for(t):
        def fn(slots):
            mask = torch.tensor([p is not None for p in slots])
            return torch.softmax(logits[t].masked_fill(~mask, -math.inf), -1).tolist()

        return fn

    expected = reference_heavy_hitter(
        [attn_for(t) for t in range(n_steps)], length, global_tokens, recent_window, window, thresholding
    )
    cache = make_cache(
        "heavy_hitter",
        length=length,
        heads=1,
        global_tokens=global_tokens,
        recent_window=recent_window,
        history_window_size=window,
        attn_thresholding=thresholding,
    )
    for t in range(n_steps):
        k, v = random_kv(1, 1, seed=t)
        cache.update_kv(torch.tensor([t]), k, v)
        slots = [p if p >= 0 else None for p in cache.pos[0, 0].tolist()]
        assert slots == expected[t], f"step {t}"
        attn = torch.tensor(attn_for(t)(slots)).view(1, 1, 1, 1, -1)
        cache.update_state(torch.tensor([t]), k, v, False, attn)
    assert len({tuple(s) for s in expected[length:]}) > n_steps - length - 2  # evictions really happened


# -- l2 ------------------------------------------------------------------------------------------
def keys_with_norms(norms):
    """k [1, H, 1, D] whose per-head L2 norms are `norms` [H]."""
    k = torch.zeros(1, len(norms), 1, HEAD_DIM)
    k[0, :, 0, 0] = torch.tensor(norms, dtype=torch.float32)
    return k


def test_l2_keeps_lowest_norms_per_head():
    length, global_tokens = 6, 1
    g = torch.Generator().manual_seed(0)
    norms = torch.rand(30, 2, generator=g) + 0.5
    cache = make_cache("l2", length=length, global_tokens=global_tokens, recent_window=0)
    for pos in range(30):
        k = keys_with_norms(norms[pos].tolist())
        decode(cache, pos, k, k)
    for head in range(2):
        # the newest token is always inserted; the others are the lowest norms of the evictable ones
        candidates = norms[global_tokens:29, head]
        lowest = set((candidates.argsort()[: length - global_tokens - 1] + global_tokens).tolist())
        assert held(cache, head) == {0, 29} | lowest
        torch.testing.assert_close(
            cache.key_norm[0, head], norms[cache.pos[0, head].long(), head], rtol=1e-6, atol=1e-6
        )
    assert held(cache, 0) != held(cache, 1)


def test_l2_evicts_the_largest_norm():
    cache = make_cache("l2", length=4, heads=2, global_tokens=1, recent_window=0)
    norms = [[9.0, 9.0], [1.0, 5.0], [3.0, 2.0], [2.0, 1.0]]
    for pos, n in enumerate(norms):
        decode(cache, pos, keys_with_norms(n), keys_with_norms(n))
    decode(cache, 4, keys_with_norms([1.0, 1.0]), keys_with_norms([1.0, 1.0]))
    assert held(cache, 0) == {0, 1, 3, 4}  # norm 3 of position 2 was the largest evictable
    assert held(cache, 1) == {0, 2, 3, 4}  # norm 5 of position 1


# -- random and keep_it_odd -------------------------------------------------------------------
def test_random_is_head_constant_and_seeded():
    def run(seed):
        torch.manual_seed(seed)
        cache = make_cache("random", length=8, heads=3, global_tokens=2, recent_window=2)
        for pos in range(40):
            decode(cache, pos)
        return cache.pos.clone()

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(a[0, 0], a[0, 1]) and torch.equal(a[0, 0], a[0, 2])
    assert {0, 1, 37, 38, 39} <= set(a[0, 0].tolist())


def test_keep_it_odd_evicts_even_positions_first():
    cache = make_cache("keep_it_odd", length=8, global_tokens=1, recent_window=2)
    for pos in range(8):
        decode(cache, pos)
    for pos in range(8, 31):
        before = held(cache)
        evictable = before - {0} - set(range(pos - 2, pos))
        decode(cache, pos)
        (evicted,) = before - held(cache)
        assert evicted in evictable
        if any(p % 2 == 0 for p in evictable):
            assert evicted % 2 == 0, (pos, before)
    # the odd positions pile up: every evictable token left is odd
    assert {0, 28, 29, 30} <= held(cache) and all(p % 2 for p in held(cache) - {0, 28, 29, 30})


# -- invariants of every scored strategy ------------------------------------------------------------
@pytest.mark.parametrize("name", EVICTING)
def test_global_and_recent_never_evicted(name):
    torch.manual_seed(0)
    global_tokens, recent_window = 2, 3
    cache = make_cache(name, length=8, global_tokens=global_tokens, recent_window=recent_window)
    recent = cache.recent_window  # recent_global evicts by position and needs no protected window
    g = torch.Generator().manual_seed(1)
    for pos in range(40):
        k, v = random_kv(1, seed=pos)
        attn = torch.softmax(torch.randn(2, 8, generator=g) * 3, -1)
        decode(cache, pos, k * (1 + pos % 5), v, attn=attn)
        for head in range(2):
            must = set(range(min(global_tokens, pos + 1))) | set(range(max(0, pos - recent), pos + 1))
            assert must <= held(cache, head), (pos, head, held(cache, head))


@pytest.mark.parametrize("name", [n for n, c in strategies.STRATEGIES.items() if c.compiles])
def test_empty_slots_fill_first_and_reset_empties(name):
    cache = make_cache(name, length=8, global_tokens=1, recent_window=0)
    prefill(cache, 3)
    for pos in range(3, 8):
        decode(cache, pos, attn=torch.tensor([0.0] * 8))  # zero attention would make new slots the cheapest
        assert cache.pos[0, :, pos].tolist() == [pos, pos], "the new token must take the next empty slot"
    assert held(cache) == set(range(8))
    cache.reset()
    assert (cache.pos == -1).all()
    for buffer_name in ("attn_history", "attn_counter", "step", "key_norm"):
        if hasattr(cache, buffer_name):
            assert not getattr(cache, buffer_name).any(), buffer_name
    decode(cache, 0)
    assert held(cache) == {0} and cache.pos[0, :, 0].tolist() == [0, 0]


def test_head_specific_flags():
    specific = {n for n, c in strategies.STRATEGIES.items() if c.head_specific}
    assert specific >= {"l2", "heavy_hitter", "hybrid"}
    assert not specific & {"full", "recent_global", "random", "keep_it_odd"}


# -- prefill state ------------------------------------------------------------------------------
def brute_force_attention_received(q, k, thresholding=False):
    bsz, n_head, seqlen, head_dim = q.shape
    group = n_head // k.shape[1]
    keys = k.repeat_interleave(group, dim=1)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(head_dim)
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, -math.inf), -1)
    if thresholding:
        probs = (probs >= 1.0 / torch.arange(1, seqlen + 1).view(-1, 1)).float() * causal
    probs = probs.view(bsz, k.shape[1], group, seqlen, seqlen).mean(2)
    return probs.sum(-2) / torch.arange(seqlen, 0, -1)


@pytest.mark.parametrize("thresholding", [False, True])
def test_prompt_attention_matches_brute_force_and_sdpa(thresholding, monkeypatch):
    """The chunked pass gives the causal attention output and the attention each key received."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 13, HEAD_DIM, generator=g) for h in (4, 2, 2))
    expected = brute_force_attention_received(q, k, thresholding)
    expected_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    results = [attention.prompt_attention(q, k, v, thresholding)]
    for chunk_rows in (13, 3):
        monkeypatch.setattr(attention, "PREFILL_CHUNK_ELEMENTS", 4 * 13 * chunk_rows)
        results.append(attention.chunked_prompt_attention(q, k, v, thresholding))
    for out, received in results:
        torch.testing.assert_close(received, expected)
        torch.testing.assert_close(out, expected_out)
    # kept keys only (each KV head its own, in position order), in one chunk and in chunks of 2 queries
    keep = torch.tensor([[[0, 3, 4, 9, 12], [1, 2, 7, 8, 12]]])
    for chunk_rows in (13, 2):
        monkeypatch.setattr(attention, "PREFILL_CHUNK_ELEMENTS", 4 * 5 * chunk_rows)
        out, received = attention.prompt_attention(q, k, v, thresholding, keep)
        torch.testing.assert_close(received, expected.gather(2, keep))
        torch.testing.assert_close(out, expected_out)


def test_prompt_attention_statistics_keep_their_precision_in_bfloat16():
    """The log-sum-exp passes (all keys, kept keys) stay within 0.1% of float64 on the same bfloat16 inputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 300, HEAD_DIM, generator=g) for h in (4, 2, 2))
    q = q * 3  # peaked attention: the log-sum-exp is far from 0
    expected = brute_force_attention_received(q.bfloat16().double(), k.bfloat16().double(), False).float()
    received = attention.prompt_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())[1]
    torch.testing.assert_close(received, expected, rtol=1e-3, atol=0)
    keep = torch.arange(0, 300, 7).view(1, 1, -1).expand(1, 2, -1)
    received = attention.prompt_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), keep=keep)[1]
    torch.testing.assert_close(received, expected.gather(2, keep), rtol=1e-3, atol=0)


def test_decode_attention_probabilities_in_bfloat16():
    """Scores of bfloat16 queries and keys are exact float32 products on every CPU (no rounding of the
    scores to bfloat16, as SDPA accumulates); outputs in bfloat16."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, HEAD_DIM, generator=g).bfloat16() for n in (3, 40, 40))
    mask = torch.arange(40).view(1, 1, 1, -1) < 35
    out, probs = attention_with_probs(q, k, v, mask)
    exact = torch.softmax(
        (q.double() @ k.double().transpose(-1, -2) / math.sqrt(HEAD_DIM)).masked_fill(~mask, -math.inf), -1
    )
    torch.testing.assert_close(probs.double(), exact, rtol=1e-5, atol=1e-5)
    assert out.dtype == torch.bfloat16 and probs[..., 35:].eq(0).all()
    torch.testing.assert_close(out.double(), exact @ v.double(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("compressor", ["recent_global", "heavy_hitter", "l2", "keep_it_odd"])
def test_heavy_hitter_state_after_compressed_prefill(compressor):
    """Whatever the compressor, the cache holds the kept tokens with their prefill attention."""
    cache = make_cache("heavy_hitter", length=8, global_tokens=1, recent_window=2, compressor=compressor)
    q, k, v = prefill(cache, 20, n_query_heads=4)
    received = attention.prompt_attention(q, k, v)[1]
    keep = cache.pos[0].long()
    assert (keep.diff(dim=-1) > 0).all() and {0, 18, 19} <= held(cache, 0)
    torch.testing.assert_close(cache.attn_history[0, :, :, 0], received[0].gather(1, keep))
    assert (cache.attn_counter == 1).all() and int(cache.step) == 1
    torch.testing.assert_close(cache.k_cache[0], k[0].gather(1, keep.unsqueeze(-1).expand(-1, -1, HEAD_DIM)))
    torch.testing.assert_close(cache.v_cache[0], v[0].gather(1, keep.unsqueeze(-1).expand(-1, -1, HEAD_DIM)))


def test_l2_state_after_compressed_prefill():
    cache = make_cache("l2", length=8, global_tokens=1, recent_window=2, compressor="recent_global")
    _, k, _ = prefill(cache, 20)
    kept = [0, 13, 14, 15, 16, 17, 18, 19]
    assert held(cache, 0) == held(cache, 1) == set(kept)
    torch.testing.assert_close(cache.key_norm[0], k[0].norm(dim=-1)[:, kept])


def test_heavy_hitter_prefill_then_decode_scores_prompt_tokens_by_prefill_attention():
    """After a fitting prefill, the first eviction follows the prompt's attention received."""
    cache = make_cache("heavy_hitter", length=6, heads=2, global_tokens=1, recent_window=0, compressor="recent_global")
    q, k, v = prefill(cache, 6, n_query_heads=4)
    received = attention.prompt_attention(q, k, v)[1][0]
    # decode position 6 with attention 0 everywhere except the new token: scores stay prefill means
    decode(cache, 6, attn=torch.tensor([0.0] * 6))
    for head in range(2):
        # position 6 took the slot of the prompt token with the least attention received (not global)
        victim = int(received[head, 1:].argmin()) + 1
        assert held(cache, head) == set(range(7)) - {victim}


# -- statistics -------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [None, 2, 4, 8])
def test_statistics_count_every_buffer(bits):
    length, heads, n_tokens = 16, 2, 24
    cache = make_cache("heavy_hitter", length=length, heads=heads, dtype=torch.bfloat16, cache_bits=bits,
                       history_window_size=3)  # fmt: skip
    for pos in range(n_tokens):
        decode(cache, pos)
    stats = cache.compute_statistics(n_tokens)
    slots = heads * length
    kv = 2 * slots * HEAD_DIM * 2 if bits is None else 2 * (slots * HEAD_DIM * bits // 8 + 2 * slots * 2)
    expected_bytes = kv + slots * 4 + slots * 3 * 4 + slots * 4 + 8  # pos, history, counter, step
    assert stats["cache_memory_bytes"] == expected_bytes
    kept = length * (bits / 16 if bits else 1)
    assert stats["compression_ratio"] == pytest.approx((n_tokens - kept) / n_tokens)


def test_statistics_of_a_partly_filled_cache():
    cache = make_cache("l2", length=16, heads=2)
    for pos in range(10):
        decode(cache, pos)
    stats = cache.compute_statistics(10)
    assert stats["compression_ratio"] == 0.0
    assert stats["cache_memory_bytes"] == 2 * 2 * 16 * HEAD_DIM * 4 + 2 * 16 * 4 + 2 * 16 * 4


def test_quantized_cache_round_trip():
    cache = make_cache("recent_global", length=8, dtype=torch.bfloat16, cache_bits=8)
    k, v = random_kv(5)
    cache.update_kv(torch.arange(5), k, v, is_prefill=True, query=k)
    keys, values, mask = cache.update_kv(torch.tensor([5]), k[:, :, :1], v[:, :, :1])
    assert isinstance(keys, QuantizedTensor) and mask[0, 0].tolist() == [True] * 6 + [False] * 2
    for packed, original in ((keys, k), (values, v)):
        stored = dequantize(*packed, torch.bfloat16)
        scale = (original.amax(-1, keepdim=True) - original.amin(-1, keepdim=True)) / 255
        assert ((stored[:, :, :5].float() - original).abs() <= scale * 0.6 + original.abs() * 2**-7).all()
    assert cache.k_packed.dtype == torch.uint8 and not hasattr(cache, "k_cache")


# -- per-layer patterns -------------------------------------------------------------------------
def lengths(values, pattern, n_layer=4, prompt=100, new=28):
    kwargs = default_cache_kwargs(max_cache_length=values, cache_length_pattern=pattern)
    return layer_cache_lengths(kwargs, n_layer, prompt, new)


def test_tile_and_repeat_lengths():
    assert lengths([16, 32], "tile") == [16, 16, 32, 32]
    assert lengths([16, 32], "repeat") == [16, 32, 16, 32]
    assert lengths([0.25], "tile") == [32] * 4  # 0.25 * 128
    assert lengths([0.3], "tile") == [40] * 4  # 38.4 rounded up to a multiple of 8
    assert lengths([1.0, 500], "repeat") == [128] * 4  # never more than the sequence
    assert lengths([10, 20, 30, 40], "tile") == [16, 24, 32, 40]


def test_tile_and_repeat_strategies():
    kwargs = default_cache_kwargs(cache_strategy=["full", "l2"], prompt_compression_strategy=["full", "l2"])
    assert layer_strategies(kwargs, 4) == [("full", "full"), ("full", "full"), ("l2", "l2"), ("l2", "l2")]
    kwargs["cache_strategy_pattern"] = "repeat"
    assert layer_strategies(kwargs, 4) == [("full", "full"), ("l2", "l2")] * 2
    kwargs = default_cache_kwargs(cache_strategy=["l2", "random"], prompt_compression_strategy=["recent_global"])
    assert layer_strategies(kwargs, 2) == [("l2", "recent_global"), ("random", "recent_global")]


@pytest.mark.parametrize("pattern", ["pyramid", "funnel"])
def test_pyramid_and_funnel(pattern):
    n_layer, prompt, new = 30, 4000, 96
    result = lengths([0.25], pattern, n_layer, prompt, new)
    requested = 0.25 * (prompt + new)
    steps = [b - a for a, b in zip(result, result[1:])]
    if pattern == "pyramid":
        assert all(s <= 0 for s in steps) and result[0] > 2 * result[-1]
    else:
        assert all(s >= 0 for s in steps) and result[-1] > 2 * result[0]
    assert abs(sum(result) / n_layer - requested) <= 8
    assert all(r % 8 == 0 for r in result)


def test_pyramid_funnel_mirror_each_other():
    assert lengths([0.25], "funnel", 6, 1000, 24) == lengths([0.25], "pyramid", 6, 1000, 24)[::-1]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(max_cache_length=[0.5, 0.25, 0.1]),
        dict(cache_strategy=["l2", "random", "keep_it_odd"], prompt_compression_strategy=["recent_global"]),
        dict(max_cache_length=[0.5, 0.25], cache_length_pattern="pyramid"),
    ],
)
def test_lists_not_dividing_layers_rejected(overrides):
    kwargs = default_cache_kwargs(**{"cache_strategy": ["l2"], "max_cache_length": [0.5], **overrides})
    with pytest.raises(ValueError):
        check_compatibility(kwargs, n_layer=4)
    with pytest.raises(ValueError):
        layer_cache_lengths(kwargs, 4, 100, 28) if "max_cache_length" in overrides else layer_strategies(kwargs, 4)


def test_local_global_alternation_is_compatible():
    kwargs = default_cache_kwargs(
        cache_strategy=["full", "recent_global"],
        cache_strategy_pattern="repeat",
        max_cache_length=[1.0, 0.25],
        cache_length_pattern="repeat",
        prompt_compression_strategy=["full", "recent_global"],
    )
    check_compatibility(kwargs, n_layer=4)
    assert lengths([1.0, 0.25], "repeat") == [128, 32, 128, 32]
    kwargs["cache_length_pattern"] = "tile"  # now a full layer would get 25%
    with pytest.raises(ValueError):
        check_compatibility(kwargs, n_layer=4)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(max_cache_length=[0.5]),
        dict(max_cache_length=[64]),  # absolute: shorter than the sequence once the prompt outgrows it
        dict(cache_length_pattern="pyramid"),  # the upper layers get half of 1.0
        dict(cache_length_pattern="funnel"),
    ],
    ids=["fraction", "absolute", "pyramid", "funnel"],
)
def test_full_cache_needs_the_whole_sequence(overrides):
    """A full cache shorter than the sequence would write slot = position past its end."""
    kwargs = default_cache_kwargs(**{"cache_strategy": ["full"], **overrides})
    with pytest.raises(ValueError, match="full cache"):
        check_compatibility(kwargs, n_layer=4)


def test_check_cache_lengths_needs_the_prompt_length():
    kwargs = default_cache_kwargs(cache_strategy=["recent_global"], max_cache_length=[0.1], global_tokens=12)
    check_compatibility(kwargs, n_layer=2)  # a fraction: unknown until the prompt is tokenized
    with pytest.raises(ValueError, match="--global_tokens 12 exceeds a cache of 8 slots"):
        check_cache_lengths(kwargs, 2, prompt_length=40, max_new_tokens=30)
    check_cache_lengths(kwargs, 2, prompt_length=80, max_new_tokens=30)  # 0.1 * 110 -> 16 slots

    kwargs = default_cache_kwargs(cache_strategy=["l2"], prompt_compression_strategy=["full"], max_cache_length=[0.5])
    check_cache_lengths(kwargs, 2, prompt_length=40, max_new_tokens=60)  # 40 fit in 0.5 * 100 = 56 slots
    with pytest.raises(ValueError, match="does not fit a 56-slot cache"):
        check_cache_lengths(kwargs, 2, prompt_length=60, max_new_tokens=40)
    kwargs["prefill_chunk_size"] = 1  # only the first 56 are prefilled, the rest go through decode
    check_cache_lengths(kwargs, 2, prompt_length=60, max_new_tokens=40)


def test_heavy_hitter_cache_is_a_module_with_fixed_buffers():
    cache = make_cache("heavy_hitter", length=8, history_window_size=4)
    assert isinstance(cache, HeavyHitterCache)
    shapes = {name: tuple(b.shape) for name, b in cache.named_buffers()}
    for pos in range(20):
        decode(cache, pos)
    assert shapes == {name: tuple(b.shape) for name, b in cache.named_buffers()}
