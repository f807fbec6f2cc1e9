"""Data pipeline: corpus sources -> byte-level BPE tokenizer -> token shards -> deterministic batch loader.

corpus.py (what to read), readers/ (record files: JSON Lines, Parquet, Hugging Face datasets),
tokenizer.py (HF tokenizers), shards.py (binary format), prepare.py (cached preparation), loader.py
(rank-sliced, resumable batches). Import the module you need; this package imports nothing, so
`phalanx prepare` never pays for torch.
"""
