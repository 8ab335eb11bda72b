"""The field's scorers against plain-Python references on random tensors: the slots each cache keeps
per head when it compresses a prompt, and the slot it overwrites at a decode step."""

import math

import pytest
import torch
import torch.nn.functional as F

import strategies
from cache_args import default_cache_kwargs
from model import apply_rotary_emb, precompute_freqs_cis, rope_frequencies
from strategies.expected_attention import FUTURE_POSITIONS, QUERY_WINDOW, unrotate

HEADS, GROUP, HEAD_DIM, LENGTH, PROMPT, GLOBAL, RECENT = 2, 2, 8, 12, 30, 2, 3
ROPE_BASE = 100.0  # angles that turn visibly within the prompt


def new_cache(name: str, dtype: torch.dtype = torch.float32):
    kwargs = default_cache_kwargs(global_tokens=GLOBAL, recent_window=RECENT)
    compressor = strategies.natural_compressor(name)
    cache = strategies.new_cache(name, compressor, (1, HEADS, HEAD_DIM), LENGTH, PROMPT + 4, dtype, kwargs)
    cache.set_rope_frequencies(rope_frequencies(HEAD_DIM, ROPE_BASE).float())
    return cache


def random_prompt(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(1, HEADS, PROMPT, HEAD_DIM, generator=generator)
    v = torch.randn(1, HEADS, PROMPT, HEAD_DIM, generator=generator)
    q = torch.randn(1, HEADS * GROUP, PROMPT, HEAD_DIM, generator=generator)
    return q, k, v


def dot(a, b) -> float:
    return sum(x * y for x, y in zip(a, b))


def softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    return [e / sum(exps) for e in exps]


def tova_reference(q, k, head: int, positions: list[int]) -> dict[int, float]:
    """Attention from the last query to each position, averaged over every query head (so the same
    for every head)."""
    received = dict.fromkeys(positions, 0.0)
    for query_head in range(HEADS * GROUP):
        query = q[0, query_head, -1].tolist()
        keys = [k[0, query_head // GROUP, p].tolist() for p in positions]
        for p, prob in zip(positions, softmax([dot(query, key) / math.sqrt(HEAD_DIM) for key in keys])):
            received[p] += prob / (HEADS * GROUP)
    return received


def keydiff_reference(q, k, head: int, positions: list[int]) -> dict[int, float]:
    """Minus the cosine of each key with the mean of the normalised keys."""
    unit = {p: [x / math.sqrt(dot(k[0, head, p].tolist(), k[0, head, p].tolist())) for x in k[0, head, p].tolist()]
            for p in positions}  # fmt: skip
    anchor = [sum(unit[p][d] for p in positions) / len(positions) for d in range(HEAD_DIM)]
    norm = math.sqrt(dot(anchor, anchor))
    return {p: -dot(unit[p], anchor) / norm for p in positions}


def rotate(x: list[float], angles: list[float]) -> list[float]:
    """The rotary embedding of one vector: pairs (x[i], x[i + D/2]) turned by angles[i]."""
    half = len(x) // 2
    first = [x[i] * math.cos(a) - x[half + i] * math.sin(a) for i, a in enumerate(angles)]
    return first + [x[half + i] * math.cos(a) + x[i] * math.sin(a) for i, a in enumerate(angles)]


def expected_attention_reference(q, k, head: int, positions: list[int], v=None) -> dict[int, float]:
    """The Gaussian of the head's unrotated recent queries, each future position's rotation applied to
    the mean and covariance and averaged, exp(mu.k/sqrt(d) + k'Sk/(2d)) normalised, times |v|."""
    freqs = rope_frequencies(HEAD_DIM, ROPE_BASE).tolist()
    recent = range(max(0, PROMPT - QUERY_WINDOW), PROMPT)
    samples = [
        rotate(q[0, head * GROUP + g, t].tolist(), [-t * f for f in freqs]) for g in range(GROUP) for t in recent
    ]
    n = len(samples)
    mu = [sum(s[d] for s in samples) / n for d in range(HEAD_DIM)]
    cov = [
        [sum((s[a] - mu[a]) * (s[b] - mu[b]) for s in samples) / n for b in range(HEAD_DIM)] for a in range(HEAD_DIM)
    ]
    rotation = [[0.0] * HEAD_DIM for _ in range(HEAD_DIM)]  # the mean of the future rotations, column by column
    for p in range(PROMPT, PROMPT + FUTURE_POSITIONS):
        for col in range(HEAD_DIM):
            unit = [1.0 if d == col else 0.0 for d in range(HEAD_DIM)]
            turned = rotate(unit, [p * f for f in freqs])
            for row in range(HEAD_DIM):
                rotation[row][col] += turned[row] / FUTURE_POSITIONS
    mu = [dot(rotation[r], mu) for r in range(HEAD_DIM)]
    cov_r = [[dot(cov[a], rotation[b]) for b in range(HEAD_DIM)] for a in range(HEAD_DIM)]  # cov R'
    cov = [
        [sum(rotation[a][c] * cov_r[c][b] for c in range(HEAD_DIM)) for b in range(HEAD_DIM)] for a in range(HEAD_DIM)
    ]
    logits = {}
    for p in positions:
        key = k[0, head, p].tolist()
        quadratic = sum(key[a] * cov[a][b] * key[b] for a in range(HEAD_DIM) for b in range(HEAD_DIM))
        logits[p] = dot(mu, key) / math.sqrt(HEAD_DIM) + quadratic / (2 * HEAD_DIM)
    probs = softmax(list(logits.values()))
    return {p: prob * math.sqrt(dot(v[0, head, p].tolist(), v[0, head, p].tolist())) for p, prob in zip(logits, probs)}


REFERENCES = {"tova": tova_reference, "keydiff": keydiff_reference}


def kept_by_reference(scores: dict[int, float], budget: int, last: int) -> list[int]:
    """Global tokens and the last RECENT positions, then the highest scores."""
    protected = [p for p in scores if p < GLOBAL or p > last - RECENT]
    rest = sorted((p for p in scores if p not in protected), key=lambda p: -scores[p])
    return sorted(protected + rest[: budget - len(protected)])


@pytest.mark.parametrize("name", REFERENCES)
def test_prompt_compression_keeps_the_reference_slots(name):
    q, k, v = random_prompt()
    cache = new_cache(name)
    cache.attend_prompt(torch.arange(PROMPT), q, k, v)
    for head in range(HEADS):
        scores = REFERENCES[name](q, k, head, list(range(PROMPT)))
        held = [p for p in cache.pos[0, head].tolist() if p >= 0]
        assert held == kept_by_reference(scores, LENGTH, PROMPT - 1), head


def test_expected_attention_prompt_compression_keeps_the_reference_slots():
    q, k, v = random_prompt(seed=3)
    positions = torch.arange(PROMPT)
    freqs_cis = precompute_freqs_cis(PROMPT, HEAD_DIM, ROPE_BASE)
    q, k = (apply_rotary_emb(x.transpose(1, 2), freqs_cis).transpose(1, 2) for x in (q, k))  # as the model hands them
    cache = new_cache("expected_attention")
    cache.attend_prompt(positions, q, k, v)
    for head in range(HEADS):
        scores = expected_attention_reference(q, k, head, list(range(PROMPT)), v)
        held = [p for p in cache.pos[0, head].tolist() if p >= 0]
        assert held == kept_by_reference(scores, LENGTH, PROMPT - 1), head
    assert torch.allclose(unrotate(q, positions, cache.rope_frequencies), random_prompt(seed=3)[0], atol=1e-5)


@pytest.mark.parametrize("name", REFERENCES)
def test_a_decode_step_overwrites_the_reference_slot(name):
    q, k, v = random_prompt(seed=1)
    cache = new_cache(name)
    cache.attend_prompt(torch.arange(PROMPT), q, k, v)
    held = [[p for p in cache.pos[0, h].tolist()] for h in range(HEADS)]
    new_k, new_v = torch.randn(1, HEADS, 1, HEAD_DIM), torch.randn(1, HEADS, 1, HEAD_DIM)
    cache.update_kv(torch.tensor([PROMPT]), new_k, new_v, query=q[:, :, -1:])
    for head in range(HEADS):
        if name == "tova":  # the last prompt query's attention over the whole prompt, kept tokens' share
            scores = tova_reference(q, k, head, list(range(PROMPT)))
            scores = {p: scores[p] for p in held[head]}
        else:
            scores = REFERENCES[name](q, k, head, held[head])
        evictable = [p for p in held[head] if GLOBAL <= p < PROMPT - RECENT]
        evicted = min(evictable, key=lambda p: scores[p])
        after = cache.pos[0, head].tolist()
        assert sorted(after) == sorted([p for p in held[head] if p != evicted] + [PROMPT]), head


def test_tova_scores_with_the_latest_query_only():
    """After a decode step's attention, the scores are that step's attention alone, not a sum."""
    q, k, v = random_prompt(seed=2)
    cache = new_cache("tova")
    cache.attend_prompt(torch.arange(PROMPT), q, k, v)
    attn = torch.softmax(torch.randn(1, HEADS, GROUP, 1, LENGTH), dim=-1)
    cache.update_state(torch.tensor([PROMPT]), None, None, False, attn)
    expected = attn[:, :, :, -1].mean(dim=(1, 2)).unsqueeze(1).expand(-1, HEADS, -1)
    assert torch.allclose(cache.score(cache.pos, *cache.read(), None, torch.tensor([PROMPT + 1])), expected)


def reconstruction_chunk(q, k, v, cache, n: int = 7):
    """The prompt into a kvzip cache, held whole, then a reconstruction chunk of n tokens read and
    dropped; returns the chunk's queries, keys, values and the cache's output for it."""
    cache.attend_prompt(torch.arange(PROMPT), q, k, v)
    assert cache.reconstruction_prompt() == [] and int((cache.pos >= 0).sum(-1).max()) == PROMPT
    generator = torch.Generator().manual_seed(5)
    rq, rk, rv = (
        torch.randn(1, h, n, HEAD_DIM, generator=generator).to(q.dtype) for h in (HEADS * GROUP, HEADS, HEADS)
    )
    cache.set_peeking(True)
    out = cache.attend_chunk(torch.arange(PROMPT, PROMPT + n), rq, rk, rv)
    cache.set_peeking(False)
    return rq, rk, rv, out


def largest_attention_received(k, rq, rk, head: int) -> dict[int, float]:
    """Each context token's largest attention from the chunk's queries of the head's group."""
    received = dict.fromkeys(range(PROMPT), 0.0)
    keys = [k[0, head, p].tolist() for p in range(PROMPT)] + [rk[0, head, i].tolist() for i in range(rk.shape[2])]
    for g in range(GROUP):
        for i in range(rq.shape[2]):
            query = rq[0, head * GROUP + g, i].tolist()
            probs = softmax([dot(query, key) / math.sqrt(HEAD_DIM) for key in keys[: PROMPT + i + 1]])
            for p in range(PROMPT):
                received[p] = max(received[p], probs[p])
    return received


def test_kvzip_keeps_what_the_reconstruction_attends_to_most():
    """The context held whole, a reconstruction chunk read and dropped, then the budget by the
    largest attention each context token received from the chunk's queries (max over the group)."""
    q, k, v = random_prompt(seed=4)
    cache = new_cache("kvzip")
    rq, rk, rv, out = reconstruction_chunk(q, k, v, cache)
    n = rq.shape[2]
    sees = torch.ones(n, PROMPT + n, dtype=torch.bool).tril(PROMPT)  # the context, then the chunk causally
    both = [torch.cat([x, r], dim=2).repeat_interleave(GROUP, dim=1) for x, r in ((k, rk), (v, rv))]
    assert torch.allclose(out, F.scaled_dot_product_attention(rq, *both, attn_mask=sees), atol=1e-5)
    cache.finish_reconstruction()
    assert cache.reconstruction_prompt() is None and cache.pos.shape[-1] == LENGTH
    for head in range(HEADS):
        received = largest_attention_received(k, rq, rk, head)
        held = [p for p in cache.pos[0, head].tolist() if p >= 0]
        assert held == kept_by_reference(received, LENGTH, PROMPT - 1), head
        assert torch.equal(cache.k_cache[0, head, : len(held)], k[0, head, held])


@pytest.mark.parametrize(("work", "rtol"), [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)], ids=["float32", "bfloat16"])
def test_kvzip_half_precision_records_the_largest_attention(work, rtol, monkeypatch):
    """A bfloat16 cache's reconstruction scores, with the score product in float32 (CPUs that emulate
    half precision) or in bfloat16 (its log-sum-exp carried in two parts), are the largest attention of
    its bfloat16 values: to float32's precision, or to bfloat16's rounding."""
    monkeypatch.setattr(strategies.kvzip, "score_dtype", lambda x: work)
    monkeypatch.setattr(strategies.kvzip, "SCORE_BLOCK", 4)  # the chunk's 14 query rows in 4 blocks
    q, k, v = (x.bfloat16() for x in random_prompt(seed=4))
    cache = new_cache("kvzip", torch.bfloat16)
    rq, rk, _, _ = reconstruction_chunk(q, k, v, cache)
    for head in range(HEADS):
        expected = torch.tensor(list(largest_attention_received(k, rq, rk, head).values()))
        torch.testing.assert_close(cache.max_received[0, head, :PROMPT].double(), expected.double(), rtol=rtol, atol=0)
