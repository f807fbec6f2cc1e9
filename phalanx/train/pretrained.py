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
from phalanx.models.families import hf_names
from phalanx.models.lora import is_adapter
from phalanx.run.checkpoints import dcp_error_line
from phalanx.run.hf_format import check_hf_weights


def load_pretrained(model: nn.Module, args: ModelArgs, checkpoint: Path) -> float:
    """Load the checkpoint's weights into `model` (any layout; a pipeline rank's share); the seconds it took."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    started = time.perf_counter()
    check_hf_weights(checkpoint, args)  # names and shapes from the headers: one line before DCP says more
    names = hf_names(args)
    ours = get_model_state_dict(model)
    wanted = {}
    for name, tensor in ours.items():
        # A tied output head is the embedding's tensor, which loads it (a pipeline's last stage lists its
        # copy of the weight under the embedding's name too: parallel/pipeline.py). LoRA's adapters are
        # the run's own, not the checkpoint's.
        if not (name == "output.weight" and args.tie_embeddings) and not is_adapter(name):
            wanted[names[name]] = tensor
    try:
        # In place: the tensors are the model's parameters (or their local shards).
        dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(checkpoint)))
    except Exception as e:  # DCP wraps every rank's failure in its own exception types
        raise PhalanxError(f"could not load the pretrained checkpoint {checkpoint}: {dcp_error_line(e)}") from None
    return time.perf_counter() - started
