"""`--fsdp`: shard weights, gradients and optimizer state across torchrun's processes (PyTorch's FSDP2).

DDP keeps a whole copy of the model, its gradients and AdamW's two moments on every GPU: 16 bytes
per parameter, 125 GB for Moshi 7B, which no GPU holds. FSDP2 (`fully_shard`) keeps 1/N of them
per process and gathers a group's weights only while it computes. Groups: every `ActivationGating`
(the feed-forward blocks, about two thirds of the transformer's weights) on its own, then the rest
as one root group. moshi's attention and transformer layers cannot be groups: FSDP2 swaps a
module's class, and theirs (an `abc.ABC` subclass) refuse it. On CUDA the gathered weights are
bf16 and gradients are reduced in float32.

Checkpoints hold full tensors under the usual names (gathered to rank 0), so eval, export and the
loader read them like any other; the optimizer state is the distributed-checkpoint full form, so a
sharded run resumes sharded (on two or more processes, any number), an unsharded one unsharded.
"""

from __future__ import annotations

import torch
from torch import nn

OPTIMIZER_FORMAT = "fsdp-full"  # checkpoint["optimizer_format"] of a sharded run


def shard(model: nn.Module, device: torch.device) -> int:
    """Shard `model` in place (its parameters become DTensors); how many groups were made. Call
    before the optimizer is built: it must hold the sharded parameters."""
    from moshi.modules.gating import ActivationGating
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # the mesh on the training device: FSDP2's default is the accelerator, even for a --device cpu run
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if device.type == "cuda" else MixedPrecisionPolicy())
    groups = [m for m in model.modules() if isinstance(m, ActivationGating)]
    for module in groups:
        fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return len(groups) + 1


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """(trained weights, optimizer state) as full CPU tensors on rank 0 (empty elsewhere). A
    collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    # frozen weights (a LoRA base: 15 GB on 7B) are not gathered at all
    weights = get_model_state_dict(model, options=_options(cpu_offload=True, ignore_frozen_params=True))
    optim = get_optimizer_state_dict(model, opt, options=_options(cpu_offload=True))
    return {k: v for k, v in weights.items() if k in trained}, optim


def load_state(model: nn.Module, opt: torch.optim.Optimizer, weights: dict[str, torch.Tensor], optim: dict) -> None:
    """Put full weights (only the trained ones) and a full optimizer state back into the shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, weights, options=_options(strict=False))
    set_optimizer_state_dict(model, opt, optim, options=_options())
