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
            wanted[theirs] = expert_slice(ours, name)
    try:
        # In place: the tensors are the model's parameters (or their local shards).
        dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(checkpoint)))
    except Exception as e:  # DCP wraps every rank's failure in its own exception types
        raise PhalanxError(f"could not load the pretrained checkpoint {checkpoint}: {dcp_error_line(e)}") from None
    return time.perf_counter() - started
