"""The Ollama Modelfile written next to an exported GGUF, so `ollama create NAME -f Modelfile` works as is.

Ollama templates are Go templates, so phalanx's Jinja chat template (data/chat_template.py) is spelt
again here: each message as its role in capitals, a colon, a newline, the text and a blank line, then
`ASSISTANT:` and a newline. Go templates have no `upper`, hence the branch per role. BOS is not written:
Ollama prepends it itself because the GGUF says add_bos_token. The stop strings are CHAT_STOP without
their leading blank line (a Modelfile value cannot hold a newline).
"""

from __future__ import annotations

from phalanx.data.chat_template import CHAT_STOP, CHAT_TEMPLATE

_TEMPLATE = (
    "{{- range .Messages }}"
    '{{- if eq .Role "user" }}USER{{ else if eq .Role "assistant" }}ASSISTANT'
    '{{ else if eq .Role "system" }}SYSTEM{{ else }}{{ .Role }}{{ end }}:\n'
    "{{ .Content }}\n\n"
    "{{ end }}ASSISTANT:\n"
)


def modelfile(gguf_file: str, chat_template: str = CHAT_TEMPLATE) -> str:
    """The Modelfile for a model with `chat_template`. A model with a template of its own (one from a
    pretrained checkpoint) gets no TEMPLATE: a Jinja template is not translated into Go by hand here, and
    Ollama takes the template from the GGUF's tokenizer.chat_template for the families it knows, with the
    stop tokens the GGUF names (EOS, end of turn)."""
    if chat_template != CHAT_TEMPLATE:
        return f"FROM ./{gguf_file}\n"
    stops = "".join(f'PARAMETER stop "{stop.strip()}"\n' for stop in CHAT_STOP)
    return f'FROM ./{gguf_file}\nTEMPLATE """{_TEMPLATE}"""\n{stops}'
