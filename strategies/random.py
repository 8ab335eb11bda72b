"""random: evicts a uniformly random unprotected token, the baseline any scoring must beat."""

import torch
from torch import Tensor

from cache import KVCache
from prompt_compression import PromptCompressor

MODULUS = 2**31 - 1  # a Lehmer generator's prime
MULTIPLIER = 48271


def counter_uniform(seed: Tensor, position: Tensor, step: Tensor) -> Tensor:
    """A number in [0, 1) that is a fixed function of a sequence's seed, a slot's position and the
    step's position (a counter-based generator): the same whether the sequence decodes alone or in
    a batch, eagerly or compiled. Three Lehmer rounds, each followed by an xorshift, mix the keys."""
    h = (seed * 1_000_003 + position.long() * 7_919 + step.long()) % MODULUS
    for shift in (13, 11, 15):
        h = (h * MULTIPLIER) % MODULUS
        h = h ^ (h >> shift)
    return h.float() / MODULUS


class RandomCompressor(PromptCompressor):
    def score(self, key_pos, k, v, query, query_pos):
        return torch.rand(1, 1, k.shape[2], device=k.device)


class RandomCache(KVCache):
    name = "random"
    row_state = {**KVCache.row_state, "seed": 0}
    prompt_compressor_class = RandomCompressor

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("seed", torch.zeros(self.pos.shape[0], dtype=torch.long), persistent=False)
        self.reset_state()

    def score(self, key_pos, k, v, query, query_pos):
        seed, step = self.seed.view(-1, 1, 1), query_pos.view(-1, 1, 1)
        return counter_uniform(seed, key_pos[:, :1], step)

    def reset_state(self):
        """Each sequence draws its seed from torch's generator (--seed makes runs repeatable)."""
        self.seed.copy_(torch.randint(0, MODULUS, self.seed.shape, device=self.seed.device))
