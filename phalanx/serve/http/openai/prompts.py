"""/v1/completions' `prompt`, in every form OpenAI's API takes it: a string, a list of strings, a list of
token ids, or a list of token-id lists. Each prompt becomes the ids the engine is given, framed as the
model saw texts in training (BOS first, where the tokenizer has one), and what `echo` shows of it.

Text is encoded as text (special-token strings stay characters: phalanx/data/prompt_tokens.py). Token
ids are taken as given, after the same BOS unless they already start with it, so the ids /tokenize
returns for a text (add_special_tokens false, as lm-evaluation-harness asks) are the same request as
the text itself. `add_special_tokens: false` (vLLM's field) sends every form exactly as given, no BOS.
The BOS phalanx adds is never shown: not in the echoed text, nor among the scored prompt tokens, whose
positions so match the ids the client sent.

A malformed prompt is refused in one line that says where (prompt[2][5]) and why; so is an id outside
the vocabulary, which would otherwise fail inside the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.serve.core.served import ServedModel
from phalanx.serve.http.common import ApiError

FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"


@dataclass
class CompletionPrompt:
    ids: list[int]  # what the engine is given
    added: int  # leading ids phalanx put there (its BOS): neither echoed nor listed among the scores
    echo: str  # the prompt as `echo` shows it


def _refuse(message: str) -> ApiError:
    return ApiError(400, message, param="prompt")


def _kind(value: Any) -> str:
    kinds = {
        bool: "a boolean",
        int: "an integer",
        str: "a string",
        list: "a list",
        dict: "an object",
        float: "a number",
    }
    return kinds.get(type(value), "null" if value is None else type(value).__name__)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values: list[Any], where: str, vocab_size: int) -> list[int]:
    if not values:
        raise _refuse(f"invalid '{where}': an empty list of token ids; a prompt needs at least one token")
    for i, value in enumerate(values):
        if not _is_id(value):
            raise _refuse(f"invalid '{where}[{i}]': {_kind(value)}, not a token id (an integer)")
        if not 0 <= value < vocab_size:
            raise _refuse(f"invalid '{where}[{i}]': {out_of_vocabulary(value, vocab_size)}")
    return list(values)


def out_of_vocabulary(token: int, vocab_size: int) -> str:
    return f"token id {token} is not in the model's vocabulary (ids 0 to {vocab_size - 1})"


def split_prompts(prompt: Any, vocab_size: int) -> list[str | list[int]]:
    """The request's prompts, each a text or token ids (checked against vocab_size); or a 400."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise _refuse(f"invalid 'prompt': must be {FORMS}, not {_kind(prompt)}")
    if not prompt:
        raise _refuse("invalid 'prompt': an empty list; send at least one prompt")
    if all(_is_id(p) for p in prompt):
        return [_token_ids(prompt, "prompt", vocab_size)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [_token_ids(p, f"prompt[{i}]", vocab_size) for i, p in enumerate(prompt)]
    first = prompt[0]
    if _is_id(first):
        expected, fits = "a token id", _is_id
    elif isinstance(first, str):
        expected, fits = "a string", lambda p: isinstance(p, str)
    elif isinstance(first, list):
        expected, fits = "a list of token ids", lambda p: isinstance(p, list)
    else:
        raise _refuse(f"invalid 'prompt': must be {FORMS}; prompt[0] is {_kind(first)}")
    odd = next(i for i, p in enumerate(prompt) if not fits(p))
    raise _refuse(
        f"invalid 'prompt': must be {FORMS}, one form throughout: prompt[0] is {expected} but "
        f"prompt[{odd}] is {_kind(prompt[odd])}"
    )


def completion_prompts(
    served: ServedModel, prompt: Any, vocab_size: int, add_special_tokens: bool
) -> list[CompletionPrompt]:
    """Every prompt of the request, framed for the engine (tokenizing: call it off the event loop)."""
    bos = served.loaded.specials.bos_id if add_special_tokens else None
    prompts = []
    for given in split_prompts(prompt, vocab_size):
        if isinstance(given, str):
            ids, echo = served.prompt_encoder.text_ids(given), given
        else:
            ids, echo = given, served.loaded.tokenizer.decode(given, skip_special_tokens=False)
        added = 1 if bos is not None and ids[:1] != [bos] else 0
        if not ids and not added:
            raise _refuse("invalid 'prompt': an empty text, and this model has no BOS token to start from")
        prompts.append(CompletionPrompt([bos] * added + ids, added, echo))
    return prompts


def model_vocab_size(served: ServedModel, model_vocab: int) -> int:
    """Ids a prompt may hold: those both the tokenizer and the model's embedding have (a padded embedding
    row has no text; a tokenizer id beyond the embedding would fail inside the model)."""
    return min(served.loaded.tokenizer.get_vocab_size(with_added_tokens=True), model_vocab)
