"""LoRA: a pretrained model's chosen linear layers learn a low-rank update while their weights stay frozen.

A LoraLinear is the nn.Linear it replaces (the same `weight` and `bias`, under the same names, so
checkpoints, exports, sharding plans and the pretrained loader see the model they always saw) plus two
trainable matrices: `lora_A` (rank, in) and `lora_B` (out, rank), and

    y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T

B starts at zero, so training starts from the pretrained model exactly; A starts normal with std 1 / rank
(peft's "gaussian" initialisation). Everything but the adapters is frozen (requires_grad False), so the
optimizer holds state for the adapters only and checkpoints hold only them (train/checkpoint.py saves
trainable parameters): the base is the pretrained checkpoint the run names (RUN_DIR/pretrained.json).

The names follow peft's layout (`<module>.lora_A`, `<module>.lora_B`), which export/peft_adapter.py
writes under Hugging Face's module names; merge() folds the update into the weights for serving and for
merged exports.

Under tensor parallelism a column-parallel layer's output features are split: its B is split the same way
and A replicated; a row-parallel layer's input features are split: A is split by columns and B
replicated (shard_adapters). Each rank then computes its share of the update exactly as of the product.

QLoRA (quantize_base): once the pretrained weights are in, each adapted layer's frozen weight becomes
torchao's NF4Tensor (4-bit NormalFloat in blocks of 64, about 0.52 bytes a weight with its scales) and the
layer's base product goes through torchao's linear_nf4, which dequantizes it to the input's dtype. The
adapters stay in full precision and are the only thing trained or saved; merge() and the model loader
put them on the pretrained weights themselves, not on their 4-bit copies (as peft's merges do).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# Which linear layers each `lora.targets` choice adapts, by their names inside a block.
TARGETS = {
    "attention": ("attention.wq", "attention.wk", "attention.wv", "attention.wo"),
    "mlp": ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
}
TARGETS["all"] = TARGETS["attention"] + TARGETS["mlp"]
ADAPTERS = ("lora_A", "lora_B")
NF4_BLOCK = 64  # weights per NF4 block, each with its own scale


class LoraLinear(nn.Linear):
    """nn.Linear with a trainable low-rank update; see the module's docstring."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, alpha: float, dropout: float):
        super().__init__(in_features, out_features, bias=bias)
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank))
        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.scale = alpha / rank
        self.quantized_linear = None  # torchao's linear_nf4 once the weight is NF4 (quantize_base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized_linear is None:
            base = F.linear(x, self.weight, self.bias)
        else:
            base = self.quantized_linear(x, self.weight)
            if self.bias is not None:
                base = base + self.bias
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return base + self.scale * F.linear(F.linear(h, self.lora_A), self.lora_B)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}"


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA matrix."""
    return name.rsplit(".", 1)[-1] in ADAPTERS


def adapter_rule(name: str, rank: int) -> tuple[str, float]:
    """How an adapter starts (the init table's form: models/decoder.py's init_rules)."""
    return ("zeros", 0.0) if name.endswith("lora_B") else ("normal", 1.0 / rank)


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: str) -> list[str]:
    """Replace the target linears of every block by LoraLinears (on whatever device the model is, usually
    meta before it is parallelised) and freeze everything else; the adapted modules' names."""
    adapted = []
    for key, block in model.layers.items():
        for path in TARGETS[targets]:
            parent_path, _, attr = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            old = getattr(parent, attr)
            with torch.device(old.weight.device):
                new = LoraLinear(old.in_features, old.out_features, old.bias is not None, rank, alpha, dropout)
            new.to(old.weight.dtype)
            with torch.no_grad():  # on meta these are no-ops; on a real model the weights carry over
                new.weight = old.weight
                if old.bias is not None:
                    new.bias = old.bias
            setattr(parent, attr, new)
            adapted.append(f"layers.{key}.{path}")
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return adapted


def import_nf4():
    """torchao's (to_nf4, linear_nf4), or None where torchao is not installed. Its import warns about each
    CUDA kernel library a CPU machine cannot load, and torch about an Enum it registers: both dropped."""
    import logging

    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        try:  # where newer torchao keeps NF4; older releases keep it in torchao.dtypes
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4
        except ImportError:
            from torchao.dtypes.nf4tensor import linear_nf4, to_nf4
    except ImportError:
        return None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return to_nf4, linear_nf4


@torch.no_grad()
def quantize_base(model: nn.Module) -> int:
    """QLoRA: every LoraLinear's frozen weight as an NF4Tensor (the module's docstring), in place; the
    number of weights quantized. Needs torchao (check import_nf4 first) and a model whose weights are
    plain tensors: not sharded by FSDP or tensor parallelism."""
    to_nf4, linear_nf4 = import_nf4()
    count = 0
    for module in model.modules():
        if not isinstance(module, LoraLinear) or module.quantized_linear is not None:
            continue
        n = module.weight.numel()
        if n % NF4_BLOCK:
            continue  # not whole blocks (a real model's layers always are): left in full precision
        # The blocks' scales are quantized again in groups of 256 (QLoRA's double quantization), or of
        # fewer where a small layer has fewer than 256 blocks.
        scaler_block = math.gcd(256, n // NF4_BLOCK)
        module.weight = nn.Parameter(to_nf4(module.weight.detach(), NF4_BLOCK, scaler_block), requires_grad=False)
        module.quantized_linear = linear_nf4
        count += n
    return count


def shard_adapters(model: nn.Module, tp_mesh) -> None:
    """After tensor parallelism split the model (parallel/tensor_parallel.py): each adapter as a DTensor
    placed to match its layer's split (the module's docstring). Works on the meta device."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    for module in model.modules():
        if not isinstance(module, LoraLinear) or not isinstance(module.weight, DTensor):
            continue
        column = module.weight.placements[0] == Shard(0)  # colwise: out features split; rowwise: Shard(1)
        a_placement, b_placement = (Replicate(), Shard(0)) if column else (Shard(1), Replicate())
        for name, placement in (("lora_A", a_placement), ("lora_B", b_placement)):
            full = getattr(module, name)
            if isinstance(full, DTensor):
                full = torch.empty(full.shape, dtype=full.dtype, device=full.device)
            shard = distribute_tensor(full.detach(), tp_mesh, [placement], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=True))


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight (W + scale * B A) and put plain nn.Linears back: the model a
    merged export writes and a server runs. In place; returns the model."""
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if isinstance(child, LoraLinear):
                with torch.device("meta"):  # its parameters are replaced just below
                    plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                delta = child.scale * (child.lora_B.float() @ child.lora_A.float())
                plain.weight = nn.Parameter((child.weight.float() + delta).to(child.weight.dtype))
                if child.bias is not None:
                    plain.bias = child.bias
                setattr(parent, attr, plain)
    for param in model.parameters():
        param.requires_grad_(True)
    return model
