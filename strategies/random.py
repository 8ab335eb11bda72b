"""random: evicts a uniformly random unprotected token, the baseline any scoring must beat."""

import torch

from cache import KVCache
from prompt_compression import PromptCompressor


class RandomCompressor(PromptCompressor):
    def score(self, key_pos, k, v, query):
        return torch.rand(1, 1, k.shape[2], device=k.device)


class RandomCache(KVCache):
    name = "random"
    prompt_compressor_class = RandomCompressor

    def score(self, input_pos):
        return torch.rand(self.pos.shape[0], 1, self.pos.shape[2], device=self.pos.device)
