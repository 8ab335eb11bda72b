"""expected_attention (Expected Attention, kvpress 2025): keeps the tokens that future queries are
expected to attend to, per head.

The queries of a KV head's query heads, taken back before the rotary embedding, are modelled as one
Gaussian (mean and covariance); its rotation is averaged over the next FUTURE_POSITIONS positions.
For a Gaussian query q ~ N(mu, S) the expected unnormalised attention to key k is
exp(mu.k / sqrt(d) + k'Sk / (2d)); a token's score is that, normalised over the candidates, times the
norm of its value. The statistics come from the prompt's last QUERY_WINDOW queries, then, during
decode, from every new query, older ones fading with a window of QUERY_WINDOW positions: the only
state is the running moments, nothing is downloaded.
"""

import math

import torch
from torch import Tensor

from attention import rope_frequencies
from cache import KVCache
from prompt_compression import PromptCompressor
from quantization_utils import dense

FUTURE_POSITIONS = 512
QUERY_WINDOW = 128


def unrotate(query: Tensor, positions: Tensor, frequencies: Tensor) -> Tensor:
    """Queries [B, H, T, D] at positions [T] (or one per sequence, [B, 1]) before the rotary embedding
    (pairs x[i], x[i + D/2])."""
    angles = positions.double().unsqueeze(-1) * frequencies.double()
    angles = angles.view(*positions.shape[:-1], 1, *angles.shape[-2:])
    cos, sin = angles.cos().float(), angles.sin().float()
    half = query.shape[-1] // 2
    x1, x2 = query.float()[..., :half], query.float()[..., half:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def average_rotation(next_pos: Tensor, frequencies: Tensor) -> Tensor:
    """The rotary rotation [N, D, D] averaged over positions p .. p + FUTURE_POSITIONS - 1 for each of
    the N next positions p (one, or one per sequence),
    in closed form: the mean of cos(a + p t) over p < P is sin(P t / 2) / (P sin(t / 2)) cos(a + (P - 1) t / 2),
    likewise for sin, so a decode step costs O(D) whatever P."""
    theta = frequencies.double()
    middle = (next_pos.double().view(-1, 1) + (FUTURE_POSITIONS - 1) / 2) * theta
    shrink = torch.sin(FUTURE_POSITIONS * theta / 2) / (FUTURE_POSITIONS * torch.sin(theta / 2))
    cos, sin = torch.diag_embed(shrink * middle.cos()).float(), torch.diag_embed(shrink * middle.sin()).float()
    return torch.cat([torch.cat([cos, -sin], dim=-1), torch.cat([sin, cos], dim=-1)], dim=-2)


def query_samples(query: Tensor, positions: Tensor, frequencies: Tensor, n_kv: int) -> Tensor:
    """The last QUERY_WINDOW positions' queries, unrotated, as samples of their KV head [B, H_kv, n, D]."""
    query, positions = query[:, :, -QUERY_WINDOW:], positions[..., -QUERY_WINDOW:]
    bsz, n_head, n, head_dim = query.shape
    return unrotate(query, positions, frequencies).reshape(bsz, n_kv, n_head // n_kv * n, head_dim)


def expected_attention(key_pos, keys, values, mean, second, next_pos, frequencies) -> Tensor:
    """Scores [B, H, S] of keys/values [B, H, S, D] at key_pos (-1: empty) for queries of mean [B, H, D]
    and second moment [B, H, D, D] (unrotated), rotated as the next positions (next_pos: [1], or one
    per sequence) will be."""
    covariance = second - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    rotation = average_rotation(next_pos, frequencies).unsqueeze(1)  # [B or 1, 1, D, D]
    mean = (rotation @ mean.unsqueeze(-1)).squeeze(-1)
    covariance = rotation @ covariance @ rotation.transpose(-1, -2)
    k = keys.float()
    head_dim = k.shape[-1]
    logits = (k @ mean.unsqueeze(-1)).squeeze(-1) / math.sqrt(head_dim)
    logits = logits + ((k @ covariance) * k).sum(-1) / (2 * head_dim)
    logits = logits.masked_fill(key_pos < 0, float("-inf"))
    return torch.softmax(logits, dim=-1) * values.float().norm(dim=-1)


class ExpectedAttentionCompressor(PromptCompressor):
    """The attention the next positions' queries are expected to give, from the prompt's own queries."""

    head_specific = True
    rope_frequencies: Tensor | None = None  # set with the model's caches; without: RoPE base 10000

    def score(self, key_pos, k, v, query, query_pos):
        frequencies = self.rope_frequencies
        if frequencies is None:
            frequencies = rope_frequencies(k.shape[-1], 10000.0).float().to(k.device)
        samples = query_samples(query, query_pos, frequencies, k.shape[1])
        mean = samples.mean(dim=2)
        second = samples.transpose(-1, -2) @ samples / samples.shape[2]
        return expected_attention(key_pos, k, v, mean, second, query_pos[-1:] + 1, frequencies)


class ExpectedAttentionCache(KVCache):
    """Keeps running query moments per KV head; each step scores what the cache holds afresh."""

    name = "expected_attention"
    row_state = {**KVCache.row_state, "query_sum": 1, "query_outer_sum": 2, "query_weight": 0}
    head_specific = True
    natural_compressor = "expected_attention"
    prompt_compressor_class = ExpectedAttentionCompressor

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        bsz, n_heads, _ = self.pos.shape
        head_dim = self.head_dim
        # Stored [D or D x D, B, H] so that no moment has the [B, H, L] shape of a per-slot buffer.
        self.register_buffer("query_sum", torch.zeros(head_dim, bsz, n_heads))
        self.register_buffer("query_outer_sum", torch.zeros(head_dim, head_dim, bsz, n_heads))
        self.register_buffer("query_weight", torch.zeros(bsz))

    def record_queries(self, input_pos: Tensor, query: Tensor) -> None:
        """Adds the queries [B, H_q, T, D] at input_pos [T] (or [B, 1]) to the moments; older ones fade."""
        samples = query_samples(query, input_pos, self.rope_frequencies, self.pos.shape[1])
        n, group = samples.shape[2], query.shape[1] // self.pos.shape[1]
        fade = (1 - 1 / (QUERY_WINDOW * group)) ** n
        self.query_sum.mul_(fade).add_(samples.sum(dim=2).permute(2, 0, 1))
        self.query_outer_sum.mul_(fade).add_((samples.transpose(-1, -2) @ samples).permute(2, 3, 0, 1))
        self.query_weight.mul_(fade).add_(n)

    def update_kv(self, input_pos, k, v, is_prefill=False, query=None, **kwargs):
        if query is not None:  # the model always hands it; a bare cache scores with what it has seen
            self.record_queries(input_pos, query)
        return super().update_kv(input_pos, k, v, is_prefill, query, **kwargs)

    def attend_chunk(self, input_pos, query, k, v, token_ids=None):
        self.record_queries(input_pos, query)
        return super().attend_chunk(input_pos, query, k, v, token_ids)

    def score(self, key_pos, k, v, query, query_pos):
        weight = self.query_weight.clamp(min=1).view(-1, 1, 1)
        mean = self.query_sum.permute(1, 2, 0) / weight
        second = self.query_outer_sum.permute(2, 3, 0, 1) / weight.unsqueeze(-1)
        return expected_attention(key_pos, dense(k), dense(v), mean, second, query_pos, self.rope_frequencies)

    def reset_state(self):
        self.query_sum.zero_()
        self.query_outer_sum.zero_()
        self.query_weight.zero_()
