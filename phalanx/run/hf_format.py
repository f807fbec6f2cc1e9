"""The Hugging Face directory format as both sides see it: file names, and reading one back.

phalanx's model computes exactly what HF's Llama, Mistral, Qwen2 and Qwen3 compute (RoPE already in HF's
rotate_half layout), so the two differ only in config keys and tensor names, which models/families/
maps. phalanx/export/hf.py writes such a directory; this module reads one (phalanx's own export, or a
checkpoint from elsewhere, in one model.safetensors or in shards beside model.safetensors.index.json)
for the model loader. Weights come from safetensors only: pickled .bin files are never opened.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from tokenizers import Tokenizer

from phalanx.data.chat_template import read_template
from phalanx.data.tokenizer import read_specials
from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.families import expert_slice, hf_names, unused_tensors
from phalanx.models.from_config import pretrained_args

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint: tensor name -> shard file
TOKENIZER_FILE, TOKENIZER_CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# torch.save weights (and their index): unpickling can run code, so they are refused, never opened.
PICKLE_WEIGHTS = ("pytorch_model*.bin", "pytorch_model.bin.index.json", "model*.bin")
# Buffers that old transformers versions saved beside the weights; derived from the config, HF's models
# skip them on load, and so does phalanx.
DERIVED_BUFFERS = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def is_hf_export(path: Path) -> bool:
    """An HF model directory: config.json and weights, in one file or in shards. One with pickled weights
    counts too, so that loading it says why it is refused rather than that it is no model."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        return False
    return (path / WEIGHTS_FILE).is_file() or (path / INDEX_FILE).is_file() or _pickle_weights(path) is not None


def _pickle_weights(path: Path) -> str | None:
    return next((p.name for pattern in PICKLE_WEIGHTS for p in sorted(path.glob(pattern)) if p.is_file()), None)


def hf_weight_map(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it: every tensor of model.safetensors, or of the
    shards model.safetensors.index.json lists (each of which must be there)."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            weight_map = None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise PhalanxError(f"{index} is not a safetensors index (a JSON object with a weight_map)")
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard or not shard.endswith(".safetensors"):
                raise PhalanxError(f"{index} lists {shard!r}, not a .safetensors file beside it")
            if not (path / shard).is_file():
                raise PhalanxError(f"{path} lacks the shard {shard} that {INDEX_FILE} lists (an unfinished copy?)")
        return {name: path / shard for name, shard in weight_map.items()}
    if (path / WEIGHTS_FILE).is_file():
        with _open_safetensors(path / WEIGHTS_FILE) as f:
            return {name: path / WEIGHTS_FILE for name in f.keys()}
    pickled = _pickle_weights(path)
    if pickled is not None:
        raise PhalanxError(
            f"{path} holds PyTorch pickle weights ({pickled}), which phalanx never unpickles; convert them to "
            f'safetensors first: `python -c "import transformers as t; '
            f"t.AutoModelForCausalLM.from_pretrained('{path}').save_pretrained('{path}-safetensors')\"`"
        )
    raise PhalanxError(f"{path} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def _open_safetensors(file: Path):
    """safe_open of `file`, an unreadable or malformed one refused in one line. Opening reads only the
    header: tensors are read one by one, when asked for."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise PhalanxError(f"{file} could not be read as safetensors: {e}") from None


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor an HF file of a model of `args` holds (from the model
    built on the meta device, so the shapes are the model's own)."""
    with torch.device("meta"):
        state = Transformer(args).state_dict()
    return {theirs: tuple(expert_slice(state, ours).shape) for ours, theirs in hf_names(args).items()}


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def check_hf_weights(path: Path, args: ModelArgs) -> dict[str, Path]:
    """HF tensor name -> file, for the tensors a model of `args` loads, after checking the names, shapes
    and dtypes in the safetensors headers against what config.json implies (no tensor data is read).
    The first mismatch is refused in one line."""
    path = Path(path)
    weight_map = hf_weight_map(path)
    expected = expected_shapes(args)
    found: dict[str, tuple[tuple[int, ...], str]] = {}  # name -> (shape, dtype)
    by_file = defaultdict(list)
    for name, file in weight_map.items():
        by_file[file].append(name)
    for file, names in sorted(by_file.items()):
        with _open_safetensors(file) as f:
            held = set(f.keys())
            for name in names:
                if name not in held:
                    raise PhalanxError(f"{file} lacks tensor {name}, which {INDEX_FILE} places there")
                tensor = f.get_slice(name)
                found[name] = (tuple(tensor.get_shape()), tensor.get_dtype())

    # A tied checkpoint may still hold lm_head.weight: HF re-ties it to the embedding and ignores the copy.
    # DeepSeek-V3's multi-token-prediction layers are stored beside the model, which runs without them.
    spare = {name for name in found if name.endswith(DERIVED_BUFFERS)} | unused_tensors(args, found)
    if args.tie_embeddings and "lm_head.weight" in found:
        spare.add("lm_head.weight")
        expected_spare = {"lm_head.weight": expected["model.embed_tokens.weight"]}
    else:
        expected_spare = {}
    missing = [name for name in expected if name not in found]
    if missing:
        raise PhalanxError(f"{path} lacks tensor {missing[0]}{_more(missing)}, which its {CONFIG_FILE} implies")
    unexpected = sorted(set(found) - set(expected) - spare)
    if unexpected:
        raise PhalanxError(
            f"{path} holds tensor {unexpected[0]}{_more(unexpected)}, which its {CONFIG_FILE} does not explain"
        )
    for name, shape in {**expected, **expected_spare}.items():
        have, dtype = found[name]
        if have != shape:
            raise PhalanxError(
                f"{weight_map[name]}: tensor {name} has shape {list(have)}, but {CONFIG_FILE} implies {list(shape)}"
            )
        if dtype not in FLOAT_DTYPES:
            raise PhalanxError(f"{weight_map[name]}: tensor {name} is {dtype}; phalanx reads float weights")
    return {name: weight_map[name] for name in expected}


def read_chat_template(path: Path) -> str | None:
    """The chat template of an HF directory (its chat_template.jinja, else tokenizer_config.json's), or
    None if it has none."""
    return read_template(Path(path))


def read_hf_args(path: Path) -> ModelArgs:
    """The ModelArgs of an HF directory, from its config.json alone (the one reader: models/from_config.py)."""
    return pretrained_args(Path(path))


def read_hf_model(path: Path) -> Transformer:
    """A phalanx model (float32, on the CPU) from an HF directory of any family phalanx runs, its weights
    checked against config.json before any is read, then read one tensor at a time."""
    from safetensors import SafetensorError

    path = Path(path)
    if not is_hf_export(path):
        raise PhalanxError(
            f"{path} is not a Hugging Face model directory (needs {CONFIG_FILE} and safetensors weights)"
        )
    args = read_hf_args(path)
    files = check_hf_weights(path, args)
    ours = {theirs: name for name, theirs in hf_names(args).items()}

    with torch.device("meta"):
        model = Transformer(args)
    # Every parameter is loaded below (check_hf_weights saw them all), so skip init_weights' random draws,
    # slow for a large model: only re-tie the output (to_empty unties it) and build the RoPE tables.
    model.to_empty(device="cpu")
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.init_rope()
    params = model.state_dict()  # shares storage with the parameters
    by_file = defaultdict(list)
    for name, file in files.items():
        by_file[file].append(name)
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            with _open_safetensors(file) as f:
                for name in names:
                    try:
                        # To float32: exact from f16 and bf16. An expert's tensor goes into its slice.
                        expert_slice(params, ours[name]).copy_(f.get_tensor(name))
                    except SafetensorError as e:
                        raise PhalanxError(f"{file}: tensor {name} could not be read: {e}") from None
    return model


def read_hf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of an export or checkpoint as phalanx uses it: encode() adds nothing, callers frame
    texts with its specials (the post-processor, which prepends BOS for HF users, is dropped); it carries
    the special tokens its tokenizer_config.json and generation_config.json name (data/tokenizer.py)."""
    file = Path(path) / TOKENIZER_FILE
    try:
        spec = json.loads(file.read_text())
    except FileNotFoundError:
        raise PhalanxError(f"{path} has no {TOKENIZER_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PhalanxError(f"{file} is not valid JSON") from None
    spec["post_processor"] = None
    try:
        tokenizer = Tokenizer.from_str(json.dumps(spec))
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        raise PhalanxError(f"{file} is not a valid tokenizer: {str(e).splitlines()[0]}") from None
    return read_specials(tokenizer, Path(path), file)
