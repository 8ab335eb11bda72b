"""hybrid (FastGen): each KV head profiles the prompt and adopts the cheapest policy that still
recovers `min_recovery_frac` of its attention."""

import math

import torch
from torch import Tensor

from attention import window_attention
from cache import KVCache, Param

HYBRID_POLICY_PARTS = ("special", "punc", "heavy_hitter", "window", "full")
FASTGEN_STRATEGIES = [
    "special",
    "special_punc",
    "special_punc_heavy_hitter",
    "special_punc_heavy_hitter_window",
    "full",
]


def parse_hybrid_policy(name: str) -> set[str]:
    """'special_punc_heavy_hitter' -> {'special', 'punc', 'heavy_hitter'}."""
    parts, rest = set(), name
    for part in HYBRID_POLICY_PARTS:
        if part in rest:
            parts.add(part)
            rest = rest.replace(part, "")
    if rest.strip("_") or not parts:
        raise ValueError(
            f"unknown hybrid policy '{name}'; combine {', '.join(HYBRID_POLICY_PARTS)} with '_' (e.g. special_punc)"
        )
    return parts


class HybridCache(KVCache):
    """FastGen: each KV head profiles the prompt and adopts the cheapest policy that still recovers
    `min_recovery_frac` of its attention; heads then keep different tokens (and numbers of them).

    The cache spans the whole sequence; a token a head's policy drops is masked out for good.
    `window` keeps the most recent WINDOW_FRACTION of tokens, `heavy_hitter` the
    HEAVY_HITTER_FRACTION with the most accumulated attention.
    """

    name = "hybrid"
    row_state = {**KVCache.row_state, "policy": 0}
    head_specific = True
    needs_attention = True
    spans_sequence = True
    compiles = False  # heads keep different numbers of tokens: shapes change per head
    shared_kwargs = ("global_tokens", "cache_bits")
    params = (
        Param("min_recovery_frac", float, 0.9, "attention mass each head's policy must recover", minimum=0, maximum=1),
        Param(
            "hybrid_strategies",
            str,
            None,
            "candidate policies, cheapest first, each parts of special, punc, heavy_hitter, window, full "
            "joined by _; none = FastGen's five",
            nargs="+",
            check=parse_hybrid_policy,
        ),
    )
    WINDOW_FRACTION = 0.3
    HEAVY_HITTER_FRACTION = 0.3
    PROFILE_QUERIES = 32

    def __init__(
        self, *args, min_recovery_frac=0.9, hybrid_strategies=None, special_ids=(), punctuation_ids=(), **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.min_recovery_frac = min_recovery_frac
        self.strategies = list(hybrid_strategies or FASTGEN_STRATEGIES)
        policies = [parse_hybrid_policy(s) for s in self.strategies]
        # One row per policy: which parts it combines, in HYBRID_POLICY_PARTS order.
        table = [[part in p for part in HYBRID_POLICY_PARTS] for p in policies] + [[False] * 4 + [True]]
        self.register_buffer("policy_parts", torch.tensor(table))
        self.register_buffer("special_ids", torch.tensor(sorted(special_ids), dtype=torch.long))
        self.register_buffer("punctuation_ids", torch.tensor(sorted(punctuation_ids), dtype=torch.long))
        self.register_buffer("policy", torch.zeros(self.pos.shape[:2], dtype=torch.long))
        self.register_buffer("kept", torch.zeros(self.pos.shape, dtype=torch.bool))
        self.register_buffer("is_special", torch.zeros(self.pos.shape, dtype=torch.bool))
        self.register_buffer("is_punc", torch.zeros(self.pos.shape, dtype=torch.bool))
        self.register_buffer("attn_sum", torch.zeros(self.pos.shape))

    @classmethod
    def lossless_kwargs(cls):
        return {"min_recovery_frac": 1.0}

    @classmethod
    def tokenizer_kwargs(cls, tokenizer):
        return {"special_ids": tokenizer.special_ids, "punctuation_ids": tokenizer.punctuation_ids}

    def update_kv(self, input_pos, k, v, is_prefill=False, query=None, token_ids=None, **kwargs):
        self.new_token_ids = token_ids  # read by insert_state
        keys, values, _ = super().update_kv(input_pos, k, v, is_prefill, query)
        if is_prefill:
            self.profile(input_pos, observation_attention(query, k, self.PROFILE_QUERIES))
        self.kept &= self.policy_mask(input_pos[..., -1:])
        return keys, values, self.held()

    def attend_chunk(self, input_pos, query, k, v, token_ids=None):
        """The chunk joins every head's kept tokens; then each head's policy drops what it no longer keeps."""
        self.new_token_ids = token_ids  # read by insert_state
        out = super().attend_chunk(input_pos, query, k, v, token_ids)
        if not self.peeking:
            self.kept &= self.policy_mask(input_pos[-1:])
        return out

    def held(self):
        return (self.pos >= 0) & self.kept

    def insert_state(self, slots, k, state):
        """Marks new tokens special/punctuation and kept; token ids arrive with the write."""
        rows = self.flat_rows(slots)
        self.write_rows(self.kept, rows, True)
        self.write_rows(self.attn_sum, rows, 0.0)
        ids = self.new_token_ids.view(slots.shape[0], 1, -1).expand_as(slots)
        self.write_rows(self.is_special, rows, torch.isin(ids, self.special_ids))
        self.write_rows(self.is_punc, rows, torch.isin(ids, self.punctuation_ids))

    def policy_mask(self, input_pos: Tensor, policy_parts: Tensor | None = None) -> Tensor:
        """Which slots each head's policy keeps at position input_pos ([1] or one per sequence [B, 1]),
        [B, H, L] (or [P, B, H, L])."""
        input_pos = input_pos.view(-1, 1, 1)
        parts = self.policy_parts[self.policy] if policy_parts is None else policy_parts
        special, punc, heavy, window, full = (parts[..., i, None] for i in range(len(HYBRID_POLICY_PARTS)))
        length = (input_pos + 1).float()
        recent = self.pos >= input_pos + 1 - torch.ceil(self.WINDOW_FRACTION * length)
        filled = self.pos >= 0
        score = torch.where(filled & self.kept, self.attn_sum, -math.inf)
        rank = score.argsort(dim=-1, descending=True).argsort(dim=-1)
        top = rank < torch.ceil(self.HEAVY_HITTER_FRACTION * length)
        keep = full | (special & self.is_special) | (punc & self.is_punc) | (window & recent) | (heavy & top)
        return keep | (self.pos < self.global_tokens) | (self.pos == input_pos)

    def profile(self, input_pos: Tensor, attn: Tensor) -> None:
        """Each head takes the first policy whose kept prompt tokens recover min_recovery_frac of the
        attention [B, H, W, T] of the last W prompt queries; the prompt fills slots 0..T-1 in order."""
        seqlen = attn.shape[-1]
        self.attn_sum[..., :seqlen] = attn.sum(2)
        masks = self.policy_mask(input_pos[-1:], self.policy_parts.view(-1, 1, 1, len(HYBRID_POLICY_PARTS)))
        masks = masks[..., :seqlen]
        recovered = (attn.unsqueeze(0) * masks.unsqueeze(3)).sum(-1).mean(-1) / attn.sum(-1).mean(-1)
        recovered[-1] = 1.0  # the implicit full fallback
        good = recovered >= self.min_recovery_frac
        self.policy.copy_(good.float().argmax(dim=0))

    def update_state(self, input_pos, k, v, is_prefill, attn):
        self.attn_sum += attn.mean(dim=2).sum(dim=2).float()  # over the step's queries: one, or a chunk's

    def reset_state(self):
        for name in ("policy", "kept", "is_special", "is_punc", "attn_sum"):
            getattr(self, name).zero_()

    def compute_statistics(self, seq_len):
        stats = super().compute_statistics(seq_len)
        kept = (self.kept & (self.pos >= 0)).sum(-1).float() * (self.cache_bits or 16) / 16
        stats["compression_ratio"] = ((seq_len - kept) / seq_len).mean().item()
        names = self.strategies + ["full"]
        shares = torch.bincount(self.policy.flatten(), minlength=len(names)).float() / self.policy.numel()
        stats["policy_share"] = {}
        for name, share in zip(names, shares.tolist()):
            stats["policy_share"][name] = stats["policy_share"].get(name, 0.0) + share
        return stats


def observation_attention(query: Tensor, k: Tensor, window: int) -> Tensor:
    """Attention [B, H_kv, W, T] of the last `window` prompt queries, averaged over each KV head's query heads."""
    prompt_pos = torch.arange(k.shape[2], device=k.device).view(1, 1, -1)
    return window_attention(prompt_pos, k, query, window).mean(dim=2)
