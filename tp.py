"""Tensor parallel, gpt-fast style: shard attention by KV heads and the MLP by hidden units.

Started with torchrun, one process per device (gloo on CPU, nccl on CUDA):

    torchrun --nproc_per_node 2 generate.py --prompt long_niah.txt --cache_strategy heavy_hitter \
        --max_cache_length 0.25 --prompt_compression_strategy heavy_hitter

Each rank holds n_head / world query heads, n_local_heads / world KV heads (the query heads that
share them stay on the same rank) and intermediate_size / world MLP units; the outputs of `wo` and
`w2` are summed over ranks. Embeddings, norms and the output projection are replicated. Because
every KV head lives on exactly one rank, each rank's caches hold only its local heads and every
cache strategy (head-constant or head-specific) runs unchanged on them.
"""

import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from cache import SUMMED_STATISTICS
from model import Transformer


def world_size() -> int:
    """The torchrun world size (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    """This process's rank as torchrun set it (0 when not launched by torchrun); no process group needed."""
    return int(os.environ.get("RANK", "0"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def maybe_init_dist(device: torch.device | str | None = None) -> int | None:
    """Joins the torchrun process group when WORLD_SIZE > 1 and returns this rank, else None.

    The backend is nccl for CUDA devices (each rank takes cuda:LOCAL_RANK) and gloo otherwise.
    """
    size = world_size()
    if size < 2:
        return None
    rank, local_rank = env_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    device_type = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not is_distributed():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=size)
    return rank


def maybe_destroy_dist() -> None:
    """Leaves the process group. The barrier first lets every rank finish its collectives: a rank
    that tears gloo down while its peer still has traffic in flight can abort at exit. The collection
    after it frees what still references the group now, not during interpreter exit, where a run can
    abort ("terminate called without an active exception")."""
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()


def local_device(device: torch.device) -> torch.device:
    """Under torchrun on CUDA, this rank's own GPU (cuda:LOCAL_RANK); otherwise the device unchanged."""
    if device.type == "cuda" and world_size() > 1 and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def check_tp(config, size: int) -> None:
    """Raises ValueError (one line) when the model cannot be split evenly over `size` ranks."""
    for name, what in (
        ("n_local_heads", "KV-head count"),
        ("n_head", "query-head count"),
        ("intermediate_size", "MLP hidden size"),
    ):
        value = getattr(config, name)
        if value % size:
            raise ValueError(
                f"tensor parallel over {size} processes needs the {what} ({name}={value}) to be divisible by "
                f"the world size; use a --nproc_per_node that divides {value}"
            )


def _shard(param: torch.Tensor, dim: int, rank: int, size: int) -> nn.Parameter:
    return nn.Parameter(param.chunk(size, dim=dim)[rank].clone(), requires_grad=False)


def _all_reduce_hook(group):
    import torch.distributed._functional_collectives as funcol

    def hook(_module, _inputs, output):
        if torch.compiler.is_compiling():  # functional collective: traceable by torch.compile
            return funcol.all_reduce(output, "sum", group)
        dist.all_reduce(output, group=group)  # eager: in place, synchronous
        return output

    return hook


def _shard_attention(attention: nn.Module, rank: int, size: int) -> None:
    head_dim = attention.head_dim
    q_size, kv_size = attention.n_head * head_dim, attention.n_local_heads * head_dim
    # Rows of wqkv are [q heads | k heads | v heads]; each part is split by heads, contiguously, so
    # rank r gets query heads r*G*H/w ... and exactly the KV heads those queries share (G = group).
    for name in ("weight", "bias"):
        param = getattr(attention.wqkv, name)
        if param is None:
            continue
        q, k, v = param.split([q_size, kv_size, kv_size], dim=0)
        parts = [p.chunk(size, dim=0)[rank] for p in (q, k, v)]
        setattr(attention.wqkv, name, nn.Parameter(torch.cat(parts, dim=0).clone(), requires_grad=False))
    attention.wqkv.out_features = attention.wqkv.weight.shape[0]
    attention.wo.weight = _shard(attention.wo.weight, 1, rank, size)
    attention.wo.in_features = attention.wo.weight.shape[1]
    attention.n_head //= size
    attention.n_local_heads //= size


def _shard_feed_forward(feed_forward: nn.Module, rank: int, size: int) -> None:
    for linear in (feed_forward.w1, feed_forward.w3):
        linear.weight = _shard(linear.weight, 0, rank, size)
        linear.out_features = linear.weight.shape[0]
    feed_forward.w2.weight = _shard(feed_forward.w2.weight, 1, rank, size)
    feed_forward.w2.in_features = feed_forward.w2.weight.shape[1]


@torch.no_grad()
def apply_tp(model: Transformer, rank: int | None = None, size: int | None = None) -> Transformer:
    """Shards `model` in place for this rank of the process group; returns it.

    `model.config` keeps the full model's sizes; the attention modules' `n_head`/`n_local_heads`
    become the local counts, and generation.setup_caches sizes caches from them.
    """
    rank = dist.get_rank() if rank is None else rank
    size = dist.get_world_size() if size is None else size
    check_tp(model.config, size)
    if size == 1:
        return model
    hook = _all_reduce_hook(dist.group.WORLD)
    for layer in model.layers:
        _shard_attention(layer.attention, rank, size)
        _shard_feed_forward(layer.feed_forward, rank, size)
        layer.attention.wo.register_forward_hook(hook)
        layer.feed_forward.w2.register_forward_hook(hook)
    model.tp_world_size = size
    return model


# Cache statistics gathered over ranks: memory adds up, ratios and losses average (every rank
# holds the same number of KV heads, so the mean of rank means is the mean over all heads).
# Adaptive head budgets share a layer's budget among a rank's own heads.
AVERAGED_STATISTICS = ("compression_ratio", "attention_loss")


def all_reduce_statistics(stats: dict) -> dict:
    """The cache statistics of the whole model from each rank's local-head statistics (collective)."""
    if not is_distributed():
        return stats
    size = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    out = dict(stats)
    for key, value in stats.items():
        summed = key.startswith(SUMMED_STATISTICS)
        if not (summed or any(name in key for name in AVERAGED_STATISTICS)):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float, list)):
            continue
        if isinstance(value, list) and not all(isinstance(v, (int, float)) for v in value):
            continue
        tensor = torch.tensor(value if isinstance(value, list) else [value], dtype=torch.float64, device=device)
        dist.all_reduce(tensor)
        tensor = (tensor if summed else tensor / size).cpu()
        values = [int(v) if isinstance(value, int) or summed else float(v) for v in tensor.tolist()]
        out[key] = values if isinstance(value, list) else values[0]
    return out
