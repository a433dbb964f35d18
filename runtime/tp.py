"""Tensor parallelism: one TALE model over N processes (torchrun), through transformers' own TP plan.

transformers shards the base model (q/k/v column-wise, o_proj and the MLP's down_proj row-wise with an all-reduce,
embeddings by vocabulary, lm_head gathered). TALE adds its factors to the same plan, cut at latent-group boundaries:
rank r holds groups r*G/N .. (r+1)*G/N - 1, i.e. the KV heads r*K/N .. and the query heads r*H/N .. that read them,
which are exactly the heads the base plan gives it (heads are contiguous in q/k/v and in O^r's rows):

    u_v     [G, d, R]      Shard(0)  the latent projection h = x A, per group
    v_v     [G, R, R]      Shard(0)  B (factored output path)
    o_fused [d, H*R]       Shard(1)  O^r: each rank's latent outputs z give a partial sum of the layer's output,
                                     all-reduced by the plan's `all_reduce` style on `self_attn.tale`

So each rank caches its own KV heads and latent groups only (cache bytes per rank are 1/N), and a decode step costs
the base plan's all-reduces and nothing more. A number of groups that N does not divide is refused.

Every rank reads only its own slices of the artifact's tensors (transformers' DtensorShardOperation over safetensors
slices). Failures before the model is ready (a bad path on one rank, a corrupt shard) are agreed on by all ranks
(`all_ranks`), so every rank ends with the same one-line error instead of waiting forever in a collective.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn

from .artifact import ArtifactError

# Plan entries for the TALE modules, on top of the model's own base_model_tp_plan (full names, as
# DistributedConfig(tp_plan=...) takes them).
TALE_PLAN = {
    "model.layers.*.self_attn.tale.u_v": "tale_groups",
    "model.layers.*.self_attn.tale.v_v": "tale_groups",
    "model.layers.*.self_attn.tale.o_fused": "rowwise",  # the parameter: Shard(-1), the input dim of O^r
    "model.layers.*.self_attn.tale": "all_reduce",  # its forward (the fused output) gives a partial sum
    # the exact prefill and the factored output feed o_proj this rank's heads: Phi-3's plan splits a whole input
    # ("rowwise_split_input", after its qkv_proj's gathered output); the other families' plans say this already
    "model.layers.*.self_attn.o_proj": "rowwise",
}


@dataclass(frozen=True)
class TP:
    """A loaded model's place in tensor parallelism (`model.tale_spec.tp`)."""

    size: int
    rank: int
    mesh: object  # the torch DeviceMesh of the "tp" dimension


def _register_styles() -> None:
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    if "tale_groups" in ALL_PARALLEL_STYLES:
        return

    class GroupShard(TensorParallelLayer):
        """A TALE factor [G, ...] split by latent group (dim 0)."""

        def shard_param(self, module, param, mesh):
            meta = module._parameters.get(param)
            if meta is None:
                return
            module._parameters[param] = nn.Parameter(
                distribute_tensor(meta, mesh, [Shard(0)], src_data_rank=None), requires_grad=meta.requires_grad
            )

    ALL_PARALLEL_STYLES.register("tale_groups", GroupShard())


# transformers.distributed (its TP plan styles, DTensor sharding helpers) as this module uses it appeared in 5.22
MIN_TRANSFORMERS = "5.22"


def check_transformers() -> None:
    """One line (ValueError) where the installed transformers predates the tensor-parallel API used here."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ValueError(
            f"tensor parallelism needs transformers >= {MIN_TRANSFORMERS} (installed: {transformers.__version__}): "
            f"pip install -U 'transformers>={MIN_TRANSFORMERS},<5.25'"
        )


def check_whole(tp_size) -> None:
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be a whole number >= 1, got {tp_size!r}")


def check_size(tp_size: int, num_groups: int, group_size: int, root=None) -> None:
    """Refuse a TP size that does not split the model at latent-group boundaries (ValueError, one line)."""
    if num_groups % tp_size:
        where = f"{root}: " if root is not None else ""
        raise ValueError(
            f"{where}tp_size {tp_size} does not divide the {num_groups} latent groups of {group_size} KV heads "
            f"(each rank holds whole groups): use a tp size that divides {num_groups}, or convert with a smaller "
            "--group"
        )


def start(tp_size: int, device: torch.device | None):
    """Join the torchrun job as one of tp_size ranks: (DistributedConfig, this rank's device, transformers' mesh).
    One line (ValueError) when not started by torchrun with tp_size processes, or for a device of another kind."""
    check_transformers()
    from transformers import DistributedConfig, PreTrainedModel

    world = os.environ.get("WORLD_SIZE")
    if world is None or "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        raise ValueError(
            f"tp_size {tp_size} needs one process per rank: start it with torchrun --nproc-per-node {tp_size} ..."
        )
    if int(world) != tp_size:
        raise ValueError(f"tp_size {tp_size} but torchrun started {world} processes (--nproc-per-node {tp_size})")
    accel = torch._C._get_accelerator().type  # what transformers builds the mesh on: cuda (nccl), else cpu (gloo)
    if device is not None and device.type != accel:
        raise ValueError(f"tensor parallelism runs on {accel} here (one device per rank); got device {device}")
    if device is not None and device.index is not None and device.index != int(os.environ["LOCAL_RANK"]):
        raise ValueError(
            f"each rank takes the device of its LOCAL_RANK ({accel}:{os.environ['LOCAL_RANK']}): pass cuda"
        )
    _register_styles()
    cfg = DistributedConfig(tp_size=tp_size, tp_plan=dict(TALE_PLAN))
    try:
        cfg, dev, mesh = PreTrainedModel.prepare_distribute_model(cfg)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"tensor parallelism could not start: {' '.join(str(e).split())}") from None
    return cfg, torch.device(dev), mesh


def distribute(model, cfg, mesh_manager) -> TP:
    """Apply the model's TP plan with TALE's entries (parameters become DTensor placeholders, still on meta)."""
    type(model).maybe_distribute_model(model, cfg, mesh_manager)
    mesh = mesh_manager.get_mesh("tp")
    return TP(size=cfg.tp_size, rank=mesh.get_local_rank(), mesh=mesh)


def read_sharded(st, name: str, param, device, dtype) -> torch.Tensor:
    """The tensor `name` of an open safetensors file as `param` needs it: this rank's slice as a DTensor for a
    sharded parameter (only that slice is read), else the whole tensor."""
    from torch.distributed.tensor import DTensor
    from transformers.distributed.sharding_utils import DtensorShardOperation, _dtensor_from_local_like

    if isinstance(param, DTensor):
        whole = st.get_slice(name)
        if list(whole.get_shape()) != list(param.shape):
            raise ArtifactError(
                f"tensors do not match config.json/manifest: {name} is {list(whole.get_shape())}, "
                f"the model's is {list(param.shape)}"
            )
        local = DtensorShardOperation(param).shard_tensor(whole, device=device, dtype=dtype)
        return _dtensor_from_local_like(local, param)
    return st.get_tensor(name).to(device=device, dtype=dtype)


def localize(model, tp: TP) -> None:
    """TALE's factors as this rank's plain tensors (the attention backends, the cache and the compiled decode step read
    plain tensors; the base model's DTensors stay as transformers keeps them); each TALE layer counts its own heads."""
    from torch.distributed.tensor import DTensor

    for layer in model.model.layers:
        a = layer.self_attn
        for name, p in list(a.tale.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                a.tale._parameters[name] = nn.Parameter(p.to_local(), requires_grad=False)
        a.shard_heads(tp.size, tp.rank)


_KNOWN = {"ArtifactError": ArtifactError, "ValueError": ValueError}


@contextlib.contextmanager
def all_ranks(tp_size: int):
    """Run the block on every rank, then agree: if it failed on any rank, every rank raises the first failure (its
    type when it is ArtifactError, ValueError or UserError, else RuntimeError), named by rank. No rank is left waiting
    in a collective for one that gave up. tp_size 1: the block as it is."""
    if tp_size <= 1:
        yield
        return
    import torch.distributed as dist

    from .console import UserError

    err = None
    try:
        yield
    except Exception as e:  # noqa: BLE001  (shared with the other ranks below, then raised)
        err = e
    mine = None if err is None else (type(err).__name__, " ".join(str(err).split()))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    failed = [(r, e) for r, e in enumerate(every) if e is not None]
    if not failed:
        return
    r, (kind, msg) = failed[0]
    if err is not None and r == dist.get_rank() and kind not in (*_KNOWN, "UserError"):
        raise err
    cls = {**_KNOWN, "UserError": UserError}.get(kind, RuntimeError)
    text = msg if kind in (*_KNOWN, "UserError") else f"{kind}: {msg}"
    if len(failed) < len(every) or any(e != every[0] for e in every):  # not the same on all: say where
        text = f"rank {r} of {len(every)}: {text}"
    raise cls(text) from None
