"""phalanx: train, keep alive, observe and serve Llama-style language models on any accelerator."""

__version__ = "0.1.0"
