"""Autoregressive sampling with a KV cache: prefill the prompt once, then one token per step."""

import torch

from phalanx.errors import PhalanxError
from phalanx.models.llama import KVCache, Transformer


def sample_next(logits_V: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits_V.argmax())
    logits_V = logits_V.float() / temperature
    if top_k is not None and top_k < logits_V.numel():
        kth_largest = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth_largest, float("-inf"))
    probs_V = torch.softmax(logits_V, dim=-1)
    return int(torch.multinomial(probs_V, 1, generator=generator))


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 200,
    seed: int | None = None,
    eos_id: int | None = None,
) -> list[int]:
    """The new token ids only (eos_id, if met, ends generation and is left out). temperature 0 is greedy."""
    max_len, n_prompt = model.args.max_seq_len, len(prompt_ids)
    if n_prompt == 0:
        raise PhalanxError("the prompt is empty: generation needs at least one token")
    if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
        raise PhalanxError("max_new_tokens and temperature must be >= 0, and top_k >= 1")
    if n_prompt > max_len:
        raise PhalanxError(f"prompt of {n_prompt} tokens exceeds the model's max_seq_len {max_len}")
    if n_prompt + max_new_tokens > max_len:
        raise PhalanxError(
            f"prompt of {n_prompt} tokens plus {max_new_tokens} new ones exceeds the model's max_seq_len "
            f"{max_len}; use --max-new-tokens {max_len - n_prompt} or less"
        )
    if max_new_tokens == 0:
        return []

    weight = model.tok_embeddings.weight
    cache = KVCache(model.args, 1, n_prompt + max_new_tokens, dtype=weight.dtype, device=weight.device)
    generator = torch.Generator(device=weight.device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    prompt_1T = torch.tensor([prompt_ids], dtype=torch.long, device=weight.device)
    logits_V = model(prompt_1T, cache, start_pos=0)[0, -1]
    new_ids: list[int] = []
    while True:
        token = sample_next(logits_V, temperature, top_k, generator)
        if token == eos_id:
            break
        new_ids.append(token)
        if len(new_ids) == max_new_tokens:
            break  # no need to run the model on the last token
        token_11 = torch.tensor([[token]], dtype=torch.long, device=weight.device)
        logits_V = model(token_11, cache, start_pos=n_prompt + len(new_ids) - 1)[0, -1]
    return new_ids
