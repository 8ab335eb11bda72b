"""Shared test helpers: a tiny random Transformer that runs in milliseconds on CPU."""

import torch

from cpu_backend import one_token_projections
from model import ModelArgs, Transformer

TINY_CONFIG = dict(
    block_size=256,
    vocab_size=128,
    n_layer=2,
    n_head=4,
    n_local_heads=2,
    dim=64,
    intermediate_size=128,
)


def tiny_model_args(**overrides) -> ModelArgs:
    """ModelArgs of the tiny model (2 layers, dim 64, 4 query heads sharing 2 KV heads, vocab 128)."""
    return ModelArgs(**{**TINY_CONFIG, **overrides})


def tiny_transformer(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    """A seeded tiny random Transformer in eval mode, without gradients; `overrides` change ModelArgs fields."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Transformer(tiny_model_args(**overrides))
    finally:
        torch.random.set_rng_state(generator_state)
    return model.to(dtype=dtype).eval().requires_grad_(False)


def tiny_prompt(length: int, seed: int = 0, vocab_size: int = TINY_CONFIG["vocab_size"]) -> torch.Tensor:
    """Seeded random token ids [length] for the tiny model."""
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def packed_copies(model: torch.nn.Module) -> list[bool]:
    """Whether each one-token projection of the model has its packed copy (w1 and w3: their FeedForward's)."""
    return [m.packed_weight is not None for m in one_token_projections(model)]
