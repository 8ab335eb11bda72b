"""The KV cache's shared mechanics, its hyper-parameters, and the per-layer factory.

Every cache holds fixed-size buffers of `max_cache_length` slots per head (with adaptive head budgets,
a larger capacity within which the heads of a layer share their budget). The base class owns what all
strategies share -- filling empty slots first, never evicting global or recent tokens, overwriting
the lowest-scored slot, prompt compression at prefill, quantized storage and statistics -- so that a
strategy (one module in `strategies/`) is a `score()` method plus whatever state that score needs.
Shapes never change after construction and the decode path has no data-dependent Python control
flow, so it compiles.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from attention import attention_probs, causal_attention, rope_frequencies, sliding_window_mask
from quantization_utils import SUPPORTED_BITS, QuantizedTensor, dense, packed_dim, quantize

PATTERNS = ("tile", "repeat", "pyramid", "funnel")
HEAD_BUDGETS = ("uniform", "adaptive")
HEAD_CAPACITY = 2  # with adaptive head budgets, a head's slots as a multiple of the uniform budget
SUMMED_STATISTICS = ("cache_memory_bytes", "kept_memory_bytes")  # over layers; the rest are averaged
EMPTY, UNALLOCATED = -1, -2  # `pos` of a free slot, and of a slot its head may not use (adaptive budgets)


@dataclass(frozen=True)
class Param:
    """A hyper-parameter a cache reads: its command-line flag, YAML key and result-folder name.

    `minimum`/`maximum` bound it (inclusive), `above` excludes its bound; `choices` lists the valid
    values; `check` names a function that raises ValueError for a value no bound describes.
    """

    name: str
    type: type
    default: object
    help: str
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    choices: tuple | None = None
    nargs: str | None = None
    check: object = None

    def validate(self, value) -> None:
        """Raises ValueError naming the flag, the value and the valid range."""
        if value is None or self.type is bool:
            return
        for item in value if isinstance(value, list) else [value]:
            check_value(f"--{self.name}", item, self.minimum, self.maximum, self.above, self.choices)
            if self.check is not None:
                self.check(item)


def check_value(flag: str, value, minimum=None, maximum=None, above=None, choices=None) -> None:
    """One-line ValueError when a number is outside [minimum, maximum] or not above `above`, or a
    value is not among `choices`."""
    if choices is not None and value not in choices:
        raise ValueError(f"{flag} {value} is not valid; choose from: {', '.join(map(str, choices))}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{flag} {value} is too small; give at least {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{flag} {value} is too large; give at most {maximum}")
    if above is not None and value <= above:
        raise ValueError(f"{flag} {value} is too small; give more than {above}")


# Hyper-parameters every scored strategy reads; a strategy declares its own in `params`.
SHARED_PARAMS = (
    Param("global_tokens", int, 1, "leading tokens (attention sinks) never evicted", minimum=0),
    Param("recent_window", float, 10, "most recent tokens never evicted; < 1 = fraction of the cache", minimum=0),
    Param("cache_bits", int, None, "store keys and values as packed codes of 2, 4 or 8 bits", choices=SUPPORTED_BITS),
    Param(
        "head_budgets",
        str,
        "uniform",
        "adaptive: a layer's KV heads share its budget, ranked together by a head-specific compressor (AdaKV); "
        f"each head holds up to {HEAD_CAPACITY}x the uniform budget, so more memory is allocated than kept",
        choices=HEAD_BUDGETS,
    ),
)


class KVCache(nn.Module):
    """Base cache: the eviction mechanics. Subclasses override `score` (higher = keep) and declare
    their facts below; the registry (`strategies/`) derives flags, checks and presets from them."""

    name = ""
    head_specific = False  # each KV head evicts on its own
    needs_attention = False  # update_state receives the decode step's attention probabilities
    spans_sequence = False  # its length is the whole sequence: only --max_cache_length 1.0
    baseline = False  # keeps every token: what the others are compared against
    reconstructs_context = False  # scores the context by the attention of a reconstruction pass (kvzip)
    compiles = True
    natural_compressor = None  # the prompt compressor for it in sweeps and benchmarks (None: the default one)
    prompt_compressor_class = None  # its own compressor, registered under its name
    params: tuple[Param, ...] = ()  # its own hyper-parameters
    # Buffers other than the per-slot ones that hold one value per sequence, by the dim that indexes it.
    row_state: dict[str, int] = {"recent_window": 0}
    # A sliding-window layer's cache: its queries see only keys less than `window` positions back
    # (create_caches sets it; None: global attention).
    window: int | None = None
    shared_kwargs = ("max_cache_length", "global_tokens", "recent_window", "cache_bits")  # the shared ones it reads

    @classmethod
    def relevant_kwargs(cls) -> list[str]:
        """The hyper-parameters it reads: they name result folders."""
        return list(cls.shared_kwargs) + [p.name for p in cls.params]

    @classmethod
    def lossless_kwargs(cls) -> dict:
        """Hyper-parameters under which, at --max_cache_length 1.0, it keeps every token."""
        return {}

    @classmethod
    def tokenizer_kwargs(cls, tokenizer) -> dict:
        """What the cache needs from the tokenizer (hybrid: special and punctuation ids)."""
        return {}

    def __init__(
        self,
        max_batch_size: int,
        n_heads: int,
        head_dim: int,
        max_cache_length: int,
        dtype: torch.dtype = torch.bfloat16,
        global_tokens: int = 1,
        recent_window: float = 10,
        cache_bits: int | None = None,
        prompt_compressor=None,
        head_budgets: str = "uniform",
        capacity: int | None = None,
        **kwargs,
    ):
        """`max_cache_length` slots per head, or with adaptive head budgets that many on average
        within `capacity` slots per head."""
        super().__init__()
        self.budget = max_cache_length
        self.head_budgets = head_budgets
        max_cache_length = capacity or max_cache_length
        self.max_cache_length = max_cache_length
        self.head_dim = head_dim
        self.global_tokens = global_tokens
        window = resolve_recent_window(recent_window, self.budget, global_tokens)
        # Per sequence: in a batch each row keeps the window of its own cache length.
        self.register_buffer("recent_window", torch.full((max_batch_size,), window), persistent=False)
        self.cache_bits = cache_bits
        self.dtype = dtype
        self.prompt_compressor = prompt_compressor
        self.reserved_slots = 0  # kept free at prefill for tokens still to come (context-only: the question)
        self.peeking = False
        self.rope_frequencies = rope_frequencies(head_dim, 10000.0).float()  # until the model sets its own
        shape = (max_batch_size, n_heads, max_cache_length)
        if cache_bits is None:
            self.register_buffer("k_cache", torch.zeros(*shape, head_dim, dtype=dtype))
            self.register_buffer("v_cache", torch.zeros(*shape, head_dim, dtype=dtype))
        else:
            for name in ("k", "v"):
                packed = torch.zeros(*shape, packed_dim(head_dim, cache_bits), dtype=torch.uint8)
                self.register_buffer(f"{name}_packed", packed)
                self.register_buffer(f"{name}_scale", torch.zeros(*shape, 1, dtype=dtype))
                self.register_buffer(f"{name}_zero", torch.zeros(*shape, 1, dtype=dtype))
        self.register_buffer("pos", torch.full(shape, EMPTY, dtype=torch.int))
        self.pos[:, :, self.budget :] = UNALLOCATED
        # First flat row of each (batch, head) in a [B, H, L, ...] buffer viewed as [B * H * L, ...].
        offsets = torch.arange(max_batch_size * n_heads).view(max_batch_size, n_heads, 1) * max_cache_length
        self.register_buffer("row_offsets", offsets, persistent=False)

    # -- what a strategy may override -------------------------------------------------------
    def score(self, key_pos: Tensor, k, v, query: Tensor | None, query_pos: Tensor) -> Tensor:
        """Importance [B, H or 1, L] of each slot (higher = keep), scored as a prompt compressor scores
        its candidates: key_pos is `pos`, k and v the slots' keys and values (a low-bit cache's
        QuantizedTensor: see quantization_utils.dense), query [B, H_q, 1, D] the decode step's query
        at query_pos ([1], or one per sequence [B, 1]) whose token is still to be inserted. The lowest
        evictable slot is overwritten."""
        return key_pos.float()

    def return_attn(self) -> bool:
        return self.needs_attention

    def prefill_state(self, input_pos: Tensor, k: Tensor, v: Tensor, query: Tensor, keep: Tensor | None):
        """State [B, H, n] the strategy scores with, for the kept prompt tokens `keep` (None: all),
        from the whole prompt: what a token received from tokens the cache drops still counts."""
        return {}

    def insert_state(self, slots: Tensor, k: Tensor, state: dict[str, Tensor]) -> None:
        """Records the state of newly inserted slots [B, H, n]; `state` is empty during decode."""

    def update_state(self, input_pos: Tensor, k: Tensor, v: Tensor, is_prefill: bool, attn: Tensor) -> None:
        """Records attention [B, H, G, T, L] after a decode step (only called when return_attn())."""

    def reset_state(self) -> None:
        """Clears strategy state between examples."""

    def set_rope_frequencies(self, frequencies: Tensor) -> None:
        """The model's rotary angle per position of each pair of dimensions [D / 2], for scorers
        that model queries at future positions (the model sets it with the caches)."""
        self.rope_frequencies = frequencies
        if self.prompt_compressor is not None:
            self.prompt_compressor.rope_frequencies = frequencies

    # -- the shared mechanics ---------------------------------------------------------------
    def reset(self) -> None:
        self.reset_state()
        self.pos.fill_(EMPTY)
        self.pos[:, :, self.budget :].fill_(UNALLOCATED)  # until adaptive budgets share the capacity out

    def update_kv(self, input_pos: Tensor, k: Tensor, v: Tensor, is_prefill: bool = False, query=None, **kwargs):
        """Inserts k/v [B, H, T, D] (decode: T = 1 at input_pos [1] or one per sequence [B, 1]); returns
        the keys, values and slot mask attention must use."""
        if is_prefill:
            self.prefill(input_pos, k, v, query)
        else:
            slots = self.eviction_slots(input_pos, query)
            self.write(slots, input_pos.view(-1, 1, 1).expand_as(slots), k, v)
            self.insert_state(slots, k, {})
        keys, values = self.read()
        return keys, values, self.pos >= 0

    def eviction_slots(self, input_pos: Tensor, query: Tensor | None = None) -> Tensor:
        """Slot [B, H, 1] for the next token: an empty one if any, else the least important evictable."""
        score = self.score(self.pos, *self.read(), query, input_pos).expand_as(self.pos)
        recent = input_pos.view(-1, 1, 1) - self.recent_window.view(-1, 1, 1)
        protected = (self.pos < self.global_tokens) | (self.pos >= recent)
        score = torch.where(protected, math.inf, score)
        score = torch.where(self.pos == EMPTY, -math.inf, score)  # unallocated slots count as protected
        return score.argmin(dim=-1, keepdim=True)

    def attend_prompt(self, input_pos: Tensor, query: Tensor, k: Tensor, v: Tensor, token_ids=None) -> Tensor:
        """The prompt's causal attention output [B, H, T, D]; fills the cache on the way."""
        self.update_kv(input_pos, k, v, is_prefill=True, query=query, token_ids=token_ids)
        return causal_attention(query, k, v, self.window)

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, query: Tensor) -> None:
        """Fills the cache from the prompt: the tokens its compressor keeps, with their state."""
        keep = self.kept_prompt_tokens(input_pos, k, v, query)
        chosen = None if keep is None else keep.clamp(min=0)
        self.insert_prompt(input_pos, k, v, keep, self.prefill_state(input_pos, k, v, query, chosen))

    def kept_prompt_tokens(self, input_pos: Tensor, k: Tensor, v: Tensor, query: Tensor) -> Tensor | None:
        """Indices [B, H, n] of the prompt tokens the cache keeps (the prompt compressor's choice when
        the prompt does not fit its budget; -1: a slot left unallocated), None when it keeps them all."""
        if k.shape[2] <= self.budget - self.reserved_slots:
            return None
        keep = self.prompt_compressor(input_pos.view(1, 1, -1), k, v, query, **self.budgets(self.max_cache_length))
        return keep.expand(k.shape[0], k.shape[1], -1)

    def budgets(self, slots: int) -> dict:
        """The compressor's budget for buffers of `slots` slots per head: the same for every head, or
        with adaptive head budgets the layer's total shared out within `slots` (less the reserved)."""
        shared = {"capacity": slots - self.reserved_slots} if self.head_budgets == "adaptive" else {}
        return {"budget": self.budget - self.reserved_slots, **shared}

    def allocate(self, keep: Tensor) -> None:
        """After the first slots took the candidates `keep` [B, H, n]: those of index -1 become
        unallocated, the others free or filled (a chosen unallocated candidate becomes a free slot);
        the slots after them are free (the room reserved for what is still to come)."""
        first = self.pos[:, :, : keep.shape[-1]]
        first.copy_(torch.where(keep < 0, UNALLOCATED, first.clamp(min=EMPTY)))
        self.pos[:, :, keep.shape[-1] :] = EMPTY

    @torch.compiler.disable  # swaps in wider buffers for the chunk's duration
    def attend_chunk(self, input_pos: Tensor, query: Tensor, k: Tensor, v: Tensor, token_ids=None) -> Tensor:
        """A later piece of the prompt, k/v [B, H, N, D] at input_pos [N]: its queries attend to what
        the cache holds and to the chunk (causally); then the held tokens and the chunk's compete for
        the slots, ranked together by the prompt compressor as it ranks a whole prompt. While
        `peeking` (a reconstruction pass) the chunk is read and dropped. Returns the chunk's
        attention output [B, H_q, N, D]."""
        length = self.max_cache_length
        originals, out, keys, values = self.join_chunk(input_pos, query, k, v)
        if self.peeking:  # read and dropped: the original buffers come back untouched
            self.narrow(originals, None)
            return out
        keep = self.prompt_compressor(self.pos, keys, values, query, **self.budgets(length))
        self.narrow(originals, keep.expand(*k.shape[:2], -1))
        return out

    def join_chunk(self, input_pos: Tensor, query: Tensor, k: Tensor, v: Tensor) -> tuple:
        """Widens the cache by the chunk, writes it and attends; returns the original buffers, the
        attention output [B, H_q, N, D] and the keys and values attended to."""
        bsz, n_kv, n, head_dim = k.shape
        group = query.shape[1] // n_kv
        held_keys, held_values = self.dense()
        keys, values = torch.cat([held_keys, k], dim=2), torch.cat([held_values, v], dim=2)
        originals = self.widen(n)
        slots = torch.arange(self.max_cache_length - n, self.max_cache_length, device=k.device).expand(bsz, n_kv, n)
        self.write(slots, input_pos.view(1, 1, -1).expand_as(slots), k, v)
        self.insert_state(slots, k, {})
        out = self.chunk_attention(input_pos, k, v, query.reshape(bsz, n_kv, group * n, head_dim), keys, values)
        return originals, out.view(bsz, n_kv * group, n, head_dim), keys, values

    def chunk_attention(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, keys: Tensor, values: Tensor):
        """The attention output [B, H, G * N, D] of a chunk (k/v [B, H, N, D] at input_pos [N], the
        last N of keys and values [B, H, S, D]) whose queries q [B, H, G * N, D] see the held slots
        up to their own position; records the probabilities where the strategy wants them (not
        while peeking)."""
        group = q.shape[2] // k.shape[2]
        visible = self.held().unsqueeze(-2) & sliding_window_mask(input_pos, self.pos, self.window)  # [B, H, N, S]
        mask = visible.repeat(1, 1, group, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        if self.return_attn() and not self.peeking:
            bsz, n_kv, n = k.shape[:3]
            attn = attention_probs(q, keys, mask)
            self.update_state(input_pos, k, v, True, attn.view(bsz, n_kv, q.shape[2] // n, n, -1))
        return out

    def reconstruction_prompt(self) -> list[int] | None:
        """The tokens asking to repeat the context, when the cache holds a whole context awaiting
        a reconstruction pass to score it (kvzip); None otherwise."""
        return None

    def finish_reconstruction(self) -> None:
        """After the reconstruction pass: compress to the budget by what it recorded."""

    def set_peeking(self, peeking: bool) -> None:
        """During a reconstruction pass chunks are attended and dropped (see attend_chunk)."""
        self.peeking = peeking

    def per_slot_buffers(self) -> list[str]:
        """Names of the buffers indexed [batch, head, slot, ...]: the tokens and their state."""
        return [
            name
            for name, b in self.named_buffers(recurse=False)
            if name != "row_offsets" and b.dim() >= 3 and b.shape[:3] == self.pos.shape
        ]

    def widen(self, n: int) -> dict[str, Tensor]:
        """Appends n empty slots to every per-slot buffer, for a chunk to join; returns the originals."""
        originals = {name: getattr(self, name) for name in self.per_slot_buffers()}
        for name, buffer in originals.items():
            extra = buffer.new_full((*buffer.shape[:2], n, *buffer.shape[3:]), EMPTY if name == "pos" else 0)
            setattr(self, name, torch.cat([buffer, extra], dim=2))
        self.set_length(self.max_cache_length + n)
        return originals

    def narrow(self, originals: dict[str, Tensor], keep: Tensor | None) -> None:
        """Back to the original buffers: their first slots take the widened ones' slots `keep`
        [B, H, n] (-1: unallocated), the rest are emptied; None: back to them as they were."""
        if keep is None:
            for name, buffer in originals.items():
                setattr(self, name, buffer)
            self.set_length(originals["pos"].shape[2])
            return
        n = keep.shape[-1]
        chosen = keep.clamp(min=0)
        for name, buffer in originals.items():
            index = chosen.view(*keep.shape, *[1] * (buffer.dim() - 3)).expand(*keep.shape, *buffer.shape[3:])
            buffer[:, :, :n].copy_(getattr(self, name).gather(2, index))
            buffer[:, :, n:].fill_(EMPTY if name == "pos" else 0)
            setattr(self, name, buffer)
        self.set_length(originals["pos"].shape[2])
        self.allocate(keep)

    def join_batch(self, batch: "KVCache", row: int) -> None:
        """Copies this one-sequence cache into row `row` of `batch` (a cache of the same strategy with
        at least as many slots; the row's slots past ours become unallocated), then becomes a view of
        that row: the batch decodes, and this cache reports the row's statistics as if it ran alone."""
        length = self.pos.shape[2]
        if batch.pos.shape[2] < length:
            raise ValueError(f"a batch cache of {batch.pos.shape[2]} slots cannot take a row of {length}")
        per_slot = self.per_slot_buffers()
        for name in per_slot:
            getattr(batch, name)[row, :, length:].fill_(UNALLOCATED if name == "pos" else 0)
        for name, dim in [(name, 0) for name in per_slot] + list(self.row_state.items()):
            own = getattr(self, name)
            target = getattr(batch, name).narrow(dim, row, 1)[tuple(slice(0, n) for n in own.shape)]
            target.copy_(own)
            setattr(self, name, target)

    def set_length(self, length: int) -> None:
        self.max_cache_length = length
        bsz, n_heads = self.pos.shape[:2]
        offsets = torch.arange(bsz * n_heads, device=self.pos.device).view(bsz, n_heads, 1) * length
        self.row_offsets = offsets

    def held(self) -> Tensor:
        """Slots attention may use [B, H, L]: the filled ones."""
        return self.pos >= 0

    def dense(self) -> tuple[Tensor, Tensor]:
        """Keys and values as [B, H, L, D] tensors of the cache's dtype, dequantized if low-bit."""
        return tuple(dense(x) for x in self.read())

    def insert_prompt(self, input_pos: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, state: dict) -> None:
        """Writes the kept prompt tokens `keep` (-1: a slot left unallocated; state already for those
        tokens) into slots 0..n-1."""
        bsz, n_heads = k.shape[:2]
        if keep is not None:
            chosen = keep.clamp(min=0)
            gather = chosen.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])
            input_pos, k, v = input_pos[chosen], k.gather(2, gather), v.gather(2, gather)
        slots = torch.arange(k.shape[2], device=k.device).expand(bsz, n_heads, -1)
        self.write(slots, input_pos.expand_as(slots), k, v)
        self.insert_state(slots, k, state)
        if keep is not None:
            self.allocate(keep)

    def write(self, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Stores k/v [B, H, n, D] into slots [B, H, n], quantizing when the cache is low-bit."""
        rows = self.flat_rows(slots)
        self.write_rows(self.pos, rows, positions)
        if self.cache_bits is None:
            self.write_rows(self.k_cache, rows, k)
            self.write_rows(self.v_cache, rows, v)
            return
        for name, x in (("k", k), ("v", v)):
            packed, scale, zero = quantize(x.to(self.dtype), self.cache_bits)
            self.write_rows(getattr(self, f"{name}_packed"), rows, packed)
            self.write_rows(getattr(self, f"{name}_scale"), rows, scale)
            self.write_rows(getattr(self, f"{name}_zero"), rows, zero)

    def write_slots(self, buffer: Tensor, slots: Tensor, values) -> None:
        """buffer[b, h, slots[b, h, i]] = values[b, h, i] (or a number) for a [B, H, L, ...] buffer."""
        self.write_rows(buffer, self.flat_rows(slots), values)

    def flat_rows(self, slots: Tensor) -> Tensor:
        """Rows of slots [B, H, n] in a [B, H, L, ...] buffer viewed as [B * H * L, ...]."""
        return (self.row_offsets + slots).flatten()

    def write_rows(self, buffer: Tensor, rows: Tensor, values) -> None:
        """write_slots with flat_rows computed once for several buffers.

        One index_copy_ over flattened (batch, head, slot) rows: scatter_ copies the whole buffer on
        CPU for some dtypes, which made each decode step proportional to the cache length.
        """
        flat = buffer.view(-1, *buffer.shape[3:])
        if isinstance(values, Tensor):
            flat.index_copy_(0, rows, values.reshape(-1, *buffer.shape[3:]).to(buffer.dtype))
        else:
            flat.index_fill_(0, rows, values)

    def read(self) -> tuple:
        """Keys and values for attention; a low-bit cache hands over its packed codes (QuantizedTensor),
        which attention_with_probs multiplies without dequantizing the whole cache."""
        if self.cache_bits is None:
            return self.k_cache, self.v_cache
        return tuple(
            QuantizedTensor(
                getattr(self, f"{n}_packed"), getattr(self, f"{n}_scale"), getattr(self, f"{n}_zero"), self.cache_bits
            )
            for n in ("k", "v")
        )

    def compute_statistics(self, seq_len: int) -> dict:
        """Compression ratio against the model's own full cache (the n = seq_len tokens that passed
        through; a sliding layer's: at most its window), and bytes."""
        held = (self.pos >= 0).sum(-1).float().mean().item()
        kept = held * self.cache_bits / 16 if self.cache_bits is not None else held
        full = seq_len if self.window is None else min(seq_len, self.window)
        stats = {"compression_ratio": (full - kept) / full, "cache_memory_bytes": state_bytes(self)}
        if self.head_budgets == "adaptive":  # allocated slots may outnumber kept ones
            stats["kept_memory_bytes"] = round(state_bytes(self) * held / self.max_cache_length)
        return stats


def state_bytes(cache: nn.Module) -> int:
    """Bytes of a cache's persistent buffers: its memory, without bookkeeping such as row_offsets."""
    return sum(t.numel() * t.element_size() for t in cache.state_dict().values())


def cache_state(caches: list[KVCache]) -> list[dict[str, Tensor]]:
    """A copy of what every cache holds (its persistent buffers), to return to with load_cache_state."""
    return [{name: t.clone() for name, t in cache.state_dict().items()} for cache in caches]


def load_cache_state(caches: list[KVCache], state: list[dict[str, Tensor]]) -> None:
    """Copies saved contents into the caches' own buffers, in place (compiled steps keep using them);
    a state of another layout is a ValueError naming the first buffer that differs."""
    if len(state) != len(caches):
        raise ValueError(f"the saved state has {len(state)} layers, the model {len(caches)}")
    for layer, (cache, saved) in enumerate(zip(caches, state)):
        own = cache.state_dict()
        if set(own) != set(saved):
            raise ValueError(f"layer {layer} holds {sorted(own)}, the saved state {sorted(saved)}")
        for name, t in own.items():
            if t.shape != saved[name].shape or t.dtype != saved[name].dtype:
                raise ValueError(
                    f"layer {layer} {name} is {tuple(t.shape)} {t.dtype}, the saved one "
                    f"{tuple(saved[name].shape)} {saved[name].dtype}"
                )
            t.copy_(saved[name])


def resolve_recent_window(recent_window: float, cache_length: int, global_tokens: int) -> int:
    """A window below 1 is a fraction of the cache; it never covers every evictable slot."""
    window = int(recent_window * cache_length) if recent_window < 1 else int(recent_window)
    return max(0, min(window, cache_length - global_tokens - 1))


# -- per-layer layout -------------------------------------------------------------------------
def spread_over_layers(values: list, n_layer: int, pattern: str, name: str) -> list:
    """`tile`: the first layers take the first value ...; `repeat`: values alternate layer by layer."""
    if n_layer % len(values):
        raise ValueError(f"{len(values)} values of --{name} do not divide the {n_layer} layers; give 1 or a divisor")
    if pattern == "repeat":
        return [values[i % len(values)] for i in range(n_layer)]
    per = n_layer // len(values)
    return [values[i // per] for i in range(n_layer)]


def layer_cache_lengths(cache_kwargs: dict, n_layer: int, prompt_length: int, max_new_tokens: int) -> list[int]:
    """Absolute cache length per layer: rounded up to a multiple of 8, at most the sequence length."""
    seq_len = prompt_length + max_new_tokens
    values, pattern = cache_kwargs["max_cache_length"], cache_kwargs["cache_length_pattern"]
    tokens = [v * seq_len if v <= 1 else v for v in values]
    if pattern in ("pyramid", "funnel"):
        if len(tokens) != 1:
            raise ValueError(f"--cache_length_pattern {pattern} takes one (average) --max_cache_length")
        # Linear from 1.5x the average in the first layer to 0.5x in the last (reversed for funnel).
        slope = [1.5 - i / (n_layer - 1) if n_layer > 1 else 1.0 for i in range(n_layer)]
        tokens = [tokens[0] * s for s in (slope if pattern == "pyramid" else slope[::-1])]
    else:
        tokens = spread_over_layers(tokens, n_layer, pattern, "max_cache_length")
    return [min(seq_len, 8 * math.ceil(t / 8)) for t in tokens]


def layer_length_values(cache_kwargs: dict, n_layer: int) -> list[float]:
    """The --max_cache_length value each layer gets (before pyramid/funnel shaping)."""
    values = cache_kwargs["max_cache_length"]
    if cache_kwargs["cache_length_pattern"] in ("pyramid", "funnel"):
        return values * n_layer
    return spread_over_layers(values, n_layer, cache_kwargs["cache_length_pattern"], "max_cache_length")


def layer_strategies(cache_kwargs: dict, n_layer: int) -> list[tuple[str, str]]:
    """(cache strategy, prompt compressor) per layer."""
    strategies = cache_kwargs["cache_strategy"]
    compressors = cache_kwargs["prompt_compression_strategy"]
    if len(compressors) == 1:
        compressors = compressors * len(strategies)
    pairs = list(zip(strategies, compressors))
    return spread_over_layers(pairs, n_layer, cache_kwargs["cache_strategy_pattern"], "cache_strategy")


def cache_statistics(caches: list[KVCache], seq_len: int) -> dict:
    """Averaged and per-layer statistics of every key the caches report."""
    per_layer = [c.compute_statistics(seq_len) for c in caches]
    stats = {}
    for key in dict.fromkeys(k for s in per_layer for k in s):
        values = [s[key] for s in per_layer if key in s]
        if key in SUMMED_STATISTICS:
            stats[key] = sum(values)
        elif isinstance(values[0], dict):  # e.g. hybrid's share of heads per policy
            stats[key] = {name: sum(v.get(name, 0.0) for v in values) / len(values) for name in values[0]}
        else:
            stats[key] = sum(values) / len(values)
        stats[f"{key}_per_layer"] = values
    if any(c.window is not None for c in caches):  # a model with sliding layers: each kind's own ratio
        kinds = {"global": [], "sliding": []}
        for cache, s in zip(caches, per_layer):
            kinds["global" if cache.window is None else "sliding"].append(s["compression_ratio"])
        stats["compression_ratio_by_kind"] = {k: sum(v) / len(v) for k, v in kinds.items() if v}
    return stats
