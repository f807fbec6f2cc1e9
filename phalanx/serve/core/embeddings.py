"""Embeddings from the served model: the final norm's hidden states, mean-pooled over the input's tokens
and L2-normalised (so a dot product is a cosine similarity).

Each input is framed as in training (BOS, then the text's tokens). BOS feeds the model but is left out
of the mean: at position 0 its state is the same for every input and would pull all embeddings towards
one point; an empty input has nothing else, so its embedding is BOS's own.

The model is shared with the decode engine, whose thread is the only one that runs it in steps. An
embedding request does not join those steps (they are shaped for decoding); it runs on one worker thread
of its own, in inference mode, in forwards of at most MAX_BATCH_TOKENS padded tokens, at a lower CPU
priority than the decode thread. A forward only reads the weights, so the two threads never see each
other's work; they share the CPU, and a long batch is cut into pieces.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from phalanx.models.llama import Transformer

MAX_BATCH_TOKENS = 512  # padded tokens per forward: bounds memory and how long one piece holds the cores
MAX_INPUTS = 2048  # inputs per request, as OpenAI's embeddings endpoint allows
EMBED_NICENESS = 10  # how much lower than the decode thread the embedding thread runs


class InputTooLong(ValueError):
    """An input longer than the context when the request did not allow truncating it (HTTP 400)."""


def fit_to_context(ids: list[int], context: int, truncate: bool) -> list[int]:
    """The input's ids, cut to the context's first `context` tokens when truncating is allowed."""
    if len(ids) <= context:
        return ids
    if not truncate:
        raise InputTooLong(f"an input is {len(ids)} tokens but the context holds {context}; shorten it "
                           "(or allow truncating it)")
    return ids[:context]


def pooled_embeddings(model: Transformer, inputs: list[list[int]], bos_id: int,
                      max_batch_tokens: int = MAX_BATCH_TOKENS) -> list[list[float]]:
    """One unit vector per input (lists of token ids, each starting with BOS), in the inputs' order.
    Inputs of similar length share a forward, right-padded (causal attention: the padding changes no
    real position's state)."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out: list[list[float]] = [[] for _ in inputs]
    device = model.tok_embeddings.weight.device
    with torch.inference_mode():
        at = 0
        while at < len(order):
            batch = [order[at]]
            # Sorted by length, so the last one added is the longest so far.
            while at + len(batch) < len(order) and \
                    (len(batch) + 1) * len(inputs[order[at + len(batch)]]) <= max_batch_tokens:
                batch.append(order[at + len(batch)])
            longest = len(inputs[batch[-1]])
            tokens_BT = torch.zeros(len(batch), longest, dtype=torch.long, device=device)
            mask_BT = torch.zeros(len(batch), longest, dtype=torch.float32, device=device)
            for row, i in enumerate(batch):
                ids = inputs[i]
                tokens_BT[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
                first = 1 if len(ids) > 1 and ids[0] == bos_id else 0  # BOS is context, not content
                mask_BT[row, first:len(ids)] = 1.0
            hidden_BTD = model.hidden_states(tokens_BT).float()
            mean_BD = (hidden_BTD * mask_BT[..., None]).sum(1) / mask_BT.sum(1, keepdim=True)
            unit_BD = F.normalize(mean_BD, dim=-1)
            for row, i in enumerate(batch):
                out[i] = unit_BD[row].tolist()
            at += len(batch)
    return out


def _yield_to_decoding() -> None:
    """Lower this worker thread's CPU priority (Linux sets it per thread; the threads it starts for its
    ops inherit it), so that where the cores are contended the engine's decode steps go first."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + EMBED_NICENESS))
    except (AttributeError, OSError):  # not Linux, or not allowed: the thread runs at normal priority
        pass


class Embedder:
    """Runs pooled_embeddings on its own worker thread, one request's batch after another."""

    def __init__(self, model: Transformer, bos_id: int):
        self.model, self.bos_id = model, bos_id
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-embed",
                                          initializer=_yield_to_decoding)

    @property
    def dimensions(self) -> int:
        return self.model.args.dim

    async def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        if not inputs:
            return []
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, pooled_embeddings, self.model, inputs, self.bos_id)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
