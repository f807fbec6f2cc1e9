"""Starting a run from a Hugging Face checkpoint (`model.pretrained`): its weights into the model this rank
trains, under any layout, without any rank building or reading the whole model.

The model is built on the meta device and parallelised as for any run (parallel/build.py); then torch's
DCP reads the checkpoint through its Hugging Face storage reader, which asks each safetensors file for
exactly the slices of each tensor this rank's shards hold (safetensors `get_slice`: memory-mapped, no
full tensor). The state dict it fills is the model's own, renamed to the checkpoint's tensor names
(models/families/), so FSDP's and tensor parallelism's DTensor shards and a pipeline stage's parameters
load in place. No pickle is read anywhere: the reader takes the metadata from the safetensors headers.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs
from phalanx.models.families import expert_slice, hf_names, state_name
from phalanx.run.checkpoints import dcp_error_line
from phalanx.run.hf_format import check_hf_weights


def load_pretrained(model: nn.Module, args: ModelArgs, checkpoint: Path) -> float:
    """Load the checkpoint's weights into `model` (any layout; a pipeline rank's share); the seconds it took."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    started = time.perf_counter()
    check_hf_weights(checkpoint, args)  # names and shapes from the headers: one line before DCP says more
    ours = get_model_state_dict(model)
    wanted = {}
    for name, theirs in hf_names(args).items():
        # What this rank holds (a pipeline stage holds some layers): the tensor, or an MoE expert's slice
        # of its stacked weights. A tied output head is the embedding's tensor, which loads it (a
        # pipeline's last stage lists its copy under the embedding's name too: parallel/pipeline.py), so
        # hf_names leaves it out. LoRA's adapters are the run's own: hf_names does not name them.
        if state_name(name) in ours:
            held = _held_slice(ours, name)
            if held is not None:
                wanted[theirs] = held
    try:
        # In place: the tensors are the model's parameters (or their local shards).
        dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(checkpoint)))
    except Exception as e:  # DCP wraps every rank's failure in its own exception types
        raise PhalanxError(f"could not load the pretrained checkpoint {checkpoint}: {dcp_error_line(e)}") from None
    return time.perf_counter() - started


def _held_slice(ours: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """What this rank loads for a tensor_names key: the tensor (a DTensor loads its own shards), or an
    MoE expert's slice of the stacked weights. Sharded by expert (FSDP over whole experts, or expert
    parallelism), a rank holds some experts' rows in its local shard and loads only those (indexing the
    DTensor itself would not give a view of the local shard to load into)."""
    stacked = ours[state_name(name)]
    if not hasattr(stacked, "to_local") or "[" not in name:
        return expert_slice(ours, name)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    rows, offset = compute_local_shape_and_global_offset(stacked.shape, stacked.device_mesh, stacked.placements)
    if any(size != whole for size, whole in zip(rows[1:], stacked.shape[1:])):
        raise PhalanxError(
            f"{state_name(name)} is split within its experts on this layout (more ranks share an expert "
            "than there are experts to share): a pretrained checkpoint loads into whole experts; choose "
            "parallel.ep and dp_shard so that each rank holds whole ones"
        )
    expert = int(name.partition("[")[2][:-1])
    local = expert - offset[0]
    return stacked.to_local()[local] if 0 <= local < rows[0] else None
