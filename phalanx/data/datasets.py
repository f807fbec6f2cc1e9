"""What a run's prepared data trains and evaluates on: text windows, or fine-tuning rows."""

from __future__ import annotations

from phalanx.data.loader import TokenDataset
from phalanx.data.prepare import PreparedData
from phalanx.data.sft import SftExamples
from phalanx.data.sft_batches import ExampleRows


def split_datasets(data: PreparedData, seq_len: int, pack: bool = True) -> tuple:
    """The training and validation datasets (each with `micro_batch`, data/loader.py), refusing in one
    line data too small for one sequence. `pack` packs fine-tuning examples several to a row."""
    if data.kind == "sft":
        return tuple(
            ExampleRows(SftExamples(tokens, masks, lengths), seq_len, pack, f"the {name} split")
            for name, tokens, masks, lengths in (
                ("training", data.train_shards, data.train_mask_shards, data.train_length_shards),
                ("validation", data.val_shards, data.val_mask_shards, data.val_length_shards),
            )
        )
    return (
        TokenDataset(data.train_shards, seq_len, "the training split"),
        TokenDataset(data.val_shards, seq_len, "the validation split"),
    )
