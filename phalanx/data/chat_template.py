"""The chat template phalanx models are served and exported with.

phalanx trains base models on plain text such as plays (`ROMEO:` then the speech), so a chat is
rendered the same way: each message as its role in capitals, a colon, the text and a blank line, then
`ASSISTANT:` for the model to continue. The template is Jinja in Hugging Face's convention (`messages`,
`bos_token`, `add_generation_prompt`), so transformers, llama.cpp and Ollama render it identically.
"""

from __future__ import annotations

from typing import Any

import jinja2
import jinja2.sandbox

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] | upper }}:\n{{ message['content'] | trim }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)

# Where the model's turn ends: it would start the next speaker's line.
CHAT_STOP = ["\n\nUSER:", "\n\nSYSTEM:"]


def render_chat(
    messages: list[dict[str, Any]], bos_token: str, template: str = CHAT_TEMPLATE, add_generation_prompt: bool = True
) -> str:
    """The prompt text for a list of {role, content} messages (sandboxed: templates may come from files)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
    )
    return env.from_string(template).render(
        messages=messages, bos_token=bos_token, add_generation_prompt=add_generation_prompt
    )
