"""debug_<name>: any registered strategy simulated beside a full cache, recording attention loss."""

import torch

from attention import attention_probs
from cache import KVCache
from strategies.full import FullCache


class DebugCache(FullCache):
    """debug_<name>: attends with a full cache while a `<name>` cache is fed the same tokens beside it.

    Each decode step records the attention loss: the attention mass (averaged over query heads)
    that falls on tokens the simulated cache no longer holds. Statistics report the simulated
    cache's compression and memory, plus the loss.
    """

    shared_kwargs = ()
    needs_attention = True
    row_state = {**FullCache.row_state, "attention_loss": 0, "steps": 0}

    def __init__(self, *args, simulated: KVCache, **kwargs):
        super().__init__(*args, **{**kwargs, "cache_bits": None})
        self.simulated = simulated
        self.register_buffer("attention_loss", torch.zeros(self.pos.shape[0], self.max_cache_length))
        self.register_buffer("steps", torch.zeros(self.pos.shape[0], dtype=torch.long))

    def update_kv(self, input_pos, k, v, is_prefill=False, query=None, **kwargs):
        keys, values, mask = self.simulated.update_kv(input_pos, k, v, is_prefill, query, **kwargs)
        if not is_prefill and self.simulated.return_attn():
            bsz, n_kv, _, head_dim = keys.shape
            q = query.reshape(bsz, n_kv, -1, head_dim)
            attn = attention_probs(q, keys, mask.unsqueeze(2))
            self.simulated.update_state(input_pos, k, v, False, attn.unsqueeze(3))
        return super().update_kv(input_pos, k, v, is_prefill, query, **kwargs)

    def attend_chunk(self, input_pos, query, k, v, token_ids=None):
        self.simulated.attend_chunk(input_pos, query, k, v, token_ids)
        return super().attend_chunk(input_pos, query, k, v, token_ids)

    def update_state(self, input_pos, k, v, is_prefill, attn):
        if is_prefill:  # the loss is measured on decode steps only
            return
        held = torch.zeros_like(self.pos, dtype=torch.float)
        simulated_pos = self.simulated.pos
        held.scatter_add_(2, simulated_pos.clamp(min=0), (simulated_pos >= 0).float())  # empties add 0
        held_slots = held.gather(2, self.pos.clamp(min=0)) * (self.pos >= 0)
        lost_mass = (attn[:, :, :, -1].float() * (1.0 - held_slots).unsqueeze(2)).sum(-1)
        self.attention_loss.scatter_(1, self.steps.view(-1, 1), lost_mass.mean(dim=(1, 2)).view(-1, 1))
        self.steps.add_(1)

    def join_batch(self, batch, row):
        super().join_batch(batch, row)
        self.simulated.join_batch(batch.simulated, row)

    def reconstruction_prompt(self):
        return self.simulated.reconstruction_prompt()

    def finish_reconstruction(self):
        self.simulated.finish_reconstruction()

    def set_peeking(self, peeking):
        super().set_peeking(peeking)
        self.simulated.set_peeking(peeking)

    def set_rope_frequencies(self, frequencies):
        super().set_rope_frequencies(frequencies)
        self.simulated.set_rope_frequencies(frequencies)

    def reset_state(self):
        self.simulated.reset()
        self.attention_loss.zero_()
        self.steps.zero_()

    def compute_statistics(self, seq_len):
        stats = self.simulated.compute_statistics(seq_len)
        losses = self.attention_loss[0, : int(self.steps[0])]  # a cache of one sequence, or a batch's row
        stats["attention_loss"] = losses.mean().item() if len(losses) else 0.0
        for first in range(500, len(losses) + 1, 500):
            stats[f"attention_loss_first_{first}"] = losses[:first].mean().item()
        return stats
