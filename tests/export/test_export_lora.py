"""A LoRA run (its checkpoints hold only adapters, models/lora.py) loads as its base with the adapters merged:
it computes what the unmerged adapter model computes, generates, and exports as that merged model to
Hugging Face (transformers agrees) and GGUF (phalanx's reader agrees); `--format peft` writes the adapters
alone in peft's layout, which peft puts on transformers' base model with the same logits. A base that is
gone or changed since training, or a peft export of a run without adapters, is refused in one line."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from phalanx.errors import PhalanxError
from phalanx.export.peft_adapter import write_peft_adapter
from phalanx.models.lora import apply_lora, is_adapter
from phalanx.run.hf_format import read_hf_model
from phalanx.run.model_loader import LoraAdapters, LoraRecord, load_model, read_adapters
from tests.conftest import TINY
from tests.export.test_export_hf_families import CASES, hf_model, save_checkpoint
from tests.helpers import phalanx, train_json
from tests.train.test_train_pretrained import checkpoint, pretrained_run, tokenizer_file  # noqa: F401 (fixtures)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0
LORA = [f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "train.max_steps=6", "train.lr=1e-2"]
PROMPT = "ROMEO:\nBut, soft! what light through yonder window breaks?"
# f32 throughout; every comparison below measured at or under a few 1e-6 (logits of std ~0.3 to 1).
TOLERANCE = 1e-5


def one_line(proc) -> str:
    """The one error line of a refused command (exit code 2, no traceback)."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.fixture(scope="module")
def run_args(corpus, runs_root, checkpoint) -> list[str]:  # noqa: F811
    args = TINY + [f"data.sources=[{corpus}]", f"run.dir={runs_root}"]
    return pretrained_run(args, checkpoint)


@pytest.fixture(scope="module")
def lora_run(run_args) -> Path:
    """A LoRA run on the (untied, sharded) Llama checkpoint, all seven linears of each block adapted."""
    return Path(train_json(*run_args, "run.name=export-lora", *LORA)["run_dir"])


@pytest.fixture(scope="module")
def ids(lora_run) -> torch.Tensor:
    loaded = load_model(lora_run)
    return torch.tensor([[loaded.specials.bos_id, *loaded.tokenizer.encode(PROMPT).ids]])


@pytest.fixture(scope="module")
def merged(lora_run, ids) -> torch.Tensor:
    """The logits of the run as the model loader gives it (merged)."""
    with torch.no_grad():
        return load_model(lora_run).model(ids)


def adapter_model(base: Path, step: Path) -> torch.nn.Module:
    """The unmerged model, put together here: the base read from its HF files, LoRA layers on it, the
    adapters read from the DCP checkpoint with torch's own reader."""
    import torch.distributed.checkpoint as dcp

    model = read_hf_model(base)
    apply_lora(model, RANK, ALPHA, 0.0, "all")
    adapters = {name: tensor for name, tensor in model.state_dict().items() if is_adapter(name)}
    with warnings.catch_warnings():  # one process loading alone
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": adapters}, checkpoint_id=step)
    model.load_state_dict(adapters, strict=False)
    return model.eval()


def newest_step(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step_*"))[-1]


@pytest.mark.slow
def test_the_loaded_run_is_the_adapter_model_merged(lora_run, checkpoint, ids, merged):  # noqa: F811
    loaded = load_model(lora_run)
    assert loaded.format == "dcp" and not any(is_adapter(name) for name, _ in loaded.model.named_parameters())
    model = adapter_model(checkpoint, newest_step(lora_run))
    b = [p for name, p in model.named_parameters() if name.endswith("lora_B")]
    assert len(b) == 2 * 7 and all(torch.count_nonzero(p) for p in b)  # every adapter trained
    with torch.no_grad():
        unmerged, base = model(ids), read_hf_model(checkpoint)(ids)
    diff, moved = max_diff(merged, unmerged), max_diff(merged, base)
    print(f"merged vs unmerged: max abs logit diff {diff:.3g}; the adapters move the logits by {moved:.3g}")
    assert diff < TOLERANCE
    assert moved > 100 * TOLERANCE  # else equality would prove little
    adapters = read_adapters(lora_run)
    assert adapters.tensors.keys() == {n for n, _ in model.named_parameters() if is_adapter(n)}
    assert all(torch.equal(adapters.tensors[n], p) for n, p in model.named_parameters() if is_adapter(n))


@pytest.mark.slow
def test_generate_and_the_hf_export_agree_with_phalanx(lora_run, ids, merged, tmp_path):
    out = tmp_path / "hf"
    phalanx("export", str(lora_run), "--format", "hf", "--out", str(out))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reloaded(ids).logits
    diff = max_diff(theirs, merged)
    print(f"transformers on the merged HF export vs phalanx: max abs logit diff {diff:.3g}")
    assert diff < TOLERANCE

    greedy = ["ROMEO:", "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]
    from_run = phalanx("generate", str(lora_run), *greedy).stdout
    assert from_run.startswith("ROMEO:") and len(from_run) > len("ROMEO:\n")  # this tiny run writes newlines
    assert phalanx("generate", str(out), *greedy).stdout == from_run


@pytest.mark.slow
def test_the_gguf_export_reads_back_as_the_merged_model(lora_run, ids, merged, tmp_path):
    out = tmp_path / "gguf"
    phalanx("export", str(lora_run), "--format", "gguf", "--out", str(out))
    back = load_model(out / "model.gguf")
    assert back.format == "gguf"
    with torch.no_grad():
        diff = max_diff(back.model(ids), merged)
    print(f"phalanx on the GGUF export vs the run: max abs logit diff {diff:.3g}")
    assert diff < TOLERANCE


@pytest.mark.slow
def test_peft_puts_the_exported_adapters_on_transformers_base(lora_run, checkpoint, ids, merged, tmp_path):  # noqa: F811
    out = tmp_path / "adapter"
    report = json.loads(phalanx("export", str(lora_run), "--format", "peft", "--out", str(out), "--json").stdout)
    assert sorted(report["files"]) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (RANK, ALPHA, 0.0)
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert config["base_model_name_or_path"] == str(checkpoint.absolute())

    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(ids).logits
    model = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        theirs = model(ids).logits
    diff = max_diff(theirs, merged)
    print(f"peft's adapters on transformers' base vs phalanx: max abs logit diff {diff:.3g}")
    assert diff < TOLERANCE and max_diff(before, merged) > 100 * TOLERANCE

    # peft saving what it loaded writes the very same tensors under the very same names.
    model.save_pretrained(tmp_path / "resaved")
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as ours:
        with safe_open(str(tmp_path / "resaved" / "adapter_model.safetensors"), "pt") as theirs_file:
            assert set(ours.keys()) == set(theirs_file.keys())
            assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in set(ours.keys())
            assert all(torch.equal(ours.get_tensor(k), theirs_file.get_tensor(k)) for k in ours.keys())


def run_on_copy_of_base(lora_run: Path, base_checkpoint: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run whose checkpoints name a copy of its base: (run, base)."""
    base = shutil.copytree(base_checkpoint, tmp_path / "base")
    run = shutil.copytree(lora_run, tmp_path / "run")
    for trainer in run.glob("checkpoints/step_*/trainer.json"):
        state = json.loads(trainer.read_text())
        state["base"]["path"] = str(base)
        trainer.write_text(json.dumps(state))
    return run, base


@pytest.mark.slow
def test_a_changed_or_missing_base_is_refused_in_one_line(lora_run, checkpoint, ids, merged, tmp_path):  # noqa: F811
    run, base = run_on_copy_of_base(lora_run, checkpoint, tmp_path)
    with torch.no_grad():
        assert max_diff(load_model(run).model(ids), merged) == 0  # the copy is the same base

    config = base / "config.json"
    config.write_text(config.read_text() + "\n")  # any byte of its files
    line = one_line(phalanx("export", str(run), "--format", "hf", "--out", str(tmp_path / "out"), check=False))
    assert f"the base model {base} has changed since LoRA checkpoint" in line and "restore the original" in line
    assert not (tmp_path / "out").exists()
    line = one_line(phalanx("generate", str(run), "ROMEO:", "--device", "cpu", check=False))
    assert "has changed since" in line

    shutil.rmtree(base)
    line = one_line(phalanx("generate", str(run), "ROMEO:", "--device", "cpu", check=False))
    assert f"the base model {base} of LoRA checkpoint" in line and "is missing" in line


@pytest.mark.slow
def test_a_run_without_adapters_is_refused(run_args, checkpoint, tmp_path):  # noqa: F811
    """A run from the same checkpoint trained whole: no peft export; and a checkpoint claiming LoRA
    settings without holding the adapters is refused, not loaded with empty adapters."""
    whole = Path(train_json(*run_args, "run.name=export-lora-whole", "train.max_steps=2")["run_dir"])
    line = one_line(phalanx("export", str(whole), "--format", "peft", "--out", str(tmp_path / "a"), check=False))
    assert "is not from a LoRA run" in line and "no adapters" in line
    line = one_line(phalanx("export", str(checkpoint), "--format", "peft", "--out", str(tmp_path / "a"), check=False))
    assert "is not a LoRA run" in line
    assert not (tmp_path / "a").exists()

    claimed = shutil.copytree(whole, tmp_path / "claimed")
    trainer = newest_step(claimed) / "trainer.json"
    record = json.loads((newest_step(claimed).parent.parent / "pretrained.json").read_text())
    state = json.loads(trainer.read_text())
    state |= {"lora": {"rank": RANK, "alpha": ALPHA, "dropout": 0.0, "targets": "all"}, "base": record}
    trainer.write_text(json.dumps(state))
    with pytest.raises(
        PhalanxError,
        match=r"lacks the LoRA adapter layers\.0\.attention\.wk\.lora_A \(and 27 more\) that its trainer\.json",
    ):
        load_model(claimed)


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3"])
def test_peft_loads_the_written_adapters_of_every_family(case, tmp_path):
    """Without training: random adapters on a transformers checkpoint of each family, written by
    write_peft_adapter, give peft on transformers' model phalanx's unmerged logits (q/k/v biases and
    q/k norms included)."""
    hf = hf_model(case)
    base = save_checkpoint(hf, tmp_path / "base")
    model = read_hf_model(base)
    apply_lora(model, RANK, ALPHA, 0.0, "all")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.normal_(0.0, 0.2)
    tensors = {name: p.detach().clone() for name, p in model.named_parameters() if is_adapter(name)}
    record = LoraRecord(RANK, ALPHA, 0.0, "all", base, "")
    (tmp_path / "adapter").mkdir()
    write_peft_adapter(LoraAdapters(base, model.args, record, tensors), tmp_path / "adapter")
    ids = torch.randint(2, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, before = model.eval()(ids), hf(ids).logits
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(ids).logits
    diff, moved = max_diff(ours, theirs), max_diff(ours, before)
    print(f"{case}: peft vs phalanx unmerged, max abs logit diff {diff:.3g}; the adapters move them by {moved:.3g}")
    assert diff < TOLERANCE and moved > 100 * TOLERANCE and CASES[case][2] == model.args.family
