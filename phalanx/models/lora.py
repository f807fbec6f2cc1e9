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
"""

from __future__ import annotations

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


class LoraLinear(nn.Linear):
    """nn.Linear with a trainable low-rank update; see the module's docstring."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, alpha: float, dropout: float):
        super().__init__(in_features, out_features, bias=bias)
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank))
        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
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
