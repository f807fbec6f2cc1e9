"""The chat template a model is served and exported with: phalanx's own, or a checkpoint's.

phalanx trains base models on plain text such as plays (`ROMEO:` then the speech), so a chat is
rendered the same way: each message as its role in capitals, a colon, the text and a blank line, then
`ASSISTANT:` for the model to continue. The template is Jinja in Hugging Face's convention (`messages`,
`bos_token`, `eos_token`, `add_generation_prompt`), so transformers, llama.cpp and Ollama render it
identically. A model from a Hugging Face checkpoint (or a run started from one) keeps the checkpoint's
template instead: read_template finds it where transformers puts it.

Templates may come from files someone else wrote, so they are only ever rendered in jinja2's immutable
sandbox (no attribute of Python's internals, no mutation of what it is given), never executed as code.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from phalanx.errors import PhalanxError

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] | upper }}:\n{{ message['content'] | trim }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)

# Where the model's turn ends with phalanx's template: it would start the next speaker's line.
CHAT_STOP = ["\n\nUSER:", "\n\nSYSTEM:"]

# Where a checkpoint keeps its template: this file beside tokenizer.json (transformers writes it there
# since 4.50 and prefers it on load), else tokenizer_config.json's "chat_template".
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def read_template(directory: Path) -> str | None:
    """The chat template of the tokenizer in `directory`, or None if it has none. tokenizer_config.json's
    chat_template may also be a list of named templates (older transformers): the one named "default"."""
    directory = Path(directory)
    file = directory / CHAT_TEMPLATE_FILE
    if file.is_file():
        try:
            text = file.read_text()
        except UnicodeDecodeError:
            raise PhalanxError(f"{file} is not UTF-8 text") from None
        return text or None
    config = directory / _TOKENIZER_CONFIG_FILE
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise PhalanxError(f"{config} is not valid JSON (an object)") from None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def render_chat(
    messages: list[dict[str, Any]],
    bos_token: str,
    template: str = CHAT_TEMPLATE,
    add_generation_prompt: bool = True,
    eos_token: str = "",
) -> str:
    """The prompt text for a list of {role, content} messages, in the sandbox. The environment is the
    one transformers renders with (trim_blocks, lstrip_blocks, loop controls, lenient undefined names,
    `raise_exception`, a `tojson` that keeps non-ASCII text), so a checkpoint's template gives here the
    text it gives there."""
    return _compiled(template).render(
        messages=messages, bos_token=bos_token, eos_token=eos_token, add_generation_prompt=add_generation_prompt
    )


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    # Compiling takes about 1 ms, rendering about 0.01: preparing fine-tuning data renders each record
    # several times (data/sft.py), so a template is compiled once.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _raise_exception(message: str) -> None:
    # Templates call it to refuse a conversation they cannot render (roles out of order, say).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; templates write JSON into prompts, not pages.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
