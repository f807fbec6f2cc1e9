"""train.dtype=float8: torchao's float8 training (dynamic tensor-wise scaling) for the model's linear
layers, on GPUs whose matrix cores do fp8; a clear error anywhere else.

The output projection stays in bf16 (its logits feed the loss, where fp8's range costs accuracy), as do
the embeddings and norms; the rest of the step runs under bf16 autocast / FSDP2's bf16 policy.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.errors import PhalanxError

# ROCm architectures with fp8 matrix cores: MI300X and MI325X (gfx942), MI355X (gfx950).
ROCM_FP8_ARCHS = ("gfx942", "gfx950")
SUPPORTED = "MI300X/MI325X/MI355X or H100/H200/B200-class GPUs"


def check_float8(device: torch.device, tp: int = 1) -> None:
    """Refuse float8 where it cannot run, naming why."""
    if device.type != "cuda":
        raise PhalanxError(
            f"train.dtype=float8 needs a GPU with fp8 matrix cores ({SUPPORTED}); this runs on "
            f"{device.type}: use bfloat16 or auto"
        )
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        if arch not in ROCM_FP8_ARCHS:
            raise PhalanxError(f"train.dtype=float8 needs {SUPPORTED}; this AMD GPU is {arch}")
    elif torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise PhalanxError(
            f"train.dtype=float8 needs {SUPPORTED} (compute capability 8.9+); {name} has "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
        )
    if tp > 1:
        raise PhalanxError("train.dtype=float8 with parallel.tp > 1 is not supported yet; use FSDP (dp_shard)")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise PhalanxError("train.dtype=float8 needs torchao: pip install 'phalanx[fp8]'") from None


def apply_float8(model: nn.Module) -> None:
    """Swap the linear layers (but the output projection) for torchao's Float8Linear, in place."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # fp8 matmuls need both dimensions divisible by 16; the all-gather in fp8 halves FSDP2's traffic.
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(
        model,
        config=config,
        module_filter_fn=lambda module, name: (
            name != "output" and module.in_features % 16 == 0 and module.out_features % 16 == 0
        ),
    )
