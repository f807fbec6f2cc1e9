import json

import pytest
import yaml

from phalanx.config.loader import load_config
from phalanx.run.prepare import save_config
from phalanx.errors import PhalanxError


def write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_no_config_is_the_demo_preset():
    config = load_config()
    assert config.run.name == "demo"
    assert config.model.preset == "tiny"
    assert config.data.sources == ["builtin:shakespeare"]


def test_extends_preset_and_file_chain_with_deep_merge(tmp_path):
    write(tmp_path / "base.yaml", {"extends": "demo", "train": {"max_steps": 50, "lr": 1e-3}})
    (tmp_path / "sub").mkdir()
    child = write(tmp_path / "sub" / "child.yaml", {"extends": "../base.yaml", "train": {"lr": 2e-3}})
    config = load_config(child)
    assert config.train.max_steps == 50  # from base
    assert config.train.lr == 2e-3  # child wins
    assert config.model.preset == "tiny"  # from the preset at the root of the chain


def test_overrides_parse_yaml_values(tmp_path):
    config = load_config(None, ["train.max_steps=50", "train.compile=true", "data.sources=[a.txt, b.txt]",
                                "train.peak_tflops=1.5", "checkpoint.resume=never"])
    assert config.train.max_steps == 50 and config.train.compile is True
    assert config.train.peak_tflops == 1.5
    assert [s.split("/")[-1] for s in config.data.sources] == ["a.txt", "b.txt"]
    assert all(s.startswith("/") for s in config.data.sources)  # pinned to the working directory


def test_unknown_key_suggests_the_closest():
    with pytest.raises(PhalanxError) as exc:
        load_config(None, ["train.max_step=5"])
    assert str(exc.value) == "unknown config key 'train.max_step' (did you mean 'train.max_steps'?)"


def test_unknown_key_in_file_and_unknown_section(tmp_path):
    with pytest.raises(PhalanxError, match=r"'modle' \(did you mean 'model'\?\)"):
        load_config(write(tmp_path / "c.yaml", {"modle": {"preset": "tiny"}}))
    with pytest.raises(PhalanxError, match=r"unknown config key 'parallel.stratgy' \(did you mean 'parallel.strategy'"):
        load_config(write(tmp_path / "d.yaml", {"parallel": {"stratgy": "ddp"}}))


def test_wrong_type_names_key_value_and_expectation():
    with pytest.raises(PhalanxError) as exc:
        load_config(None, ["train.max_steps=many"])
    message = str(exc.value)
    assert "train.max_steps" in message and "'many'" in message and "integer" in message


def test_cross_field_checks():
    with pytest.raises(PhalanxError, match="global_batch_size=10 is not a multiple of train.micro_batch_size=4"):
        load_config(None, ["train.global_batch_size=10", "train.micro_batch_size=4"])
    with pytest.raises(PhalanxError, match="halt_at_step=900 is beyond train.max_steps=250"):
        load_config(None, ["train.halt_at_step=900"])


@pytest.mark.parametrize("bad", ["nonsense", "=3", "train..x=1", "train.max_steps.x=1"])
def test_malformed_overrides(bad):
    with pytest.raises(PhalanxError):
        load_config(None, [bad])


def test_file_errors(tmp_path):
    with pytest.raises(PhalanxError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(PhalanxError, match="neither a file nor a preset"):
        load_config("no-such-preset")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(PhalanxError, match="not valid YAML"):
        load_config(bad)
    write(tmp_path / "list.yaml", [1, 2])
    with pytest.raises(PhalanxError, match="must be a mapping"):
        load_config(tmp_path / "list.yaml")
    write(tmp_path / "a.yaml", {"extends": "b.yaml"})
    write(tmp_path / "b.yaml", {"extends": "a.yaml"})
    with pytest.raises(PhalanxError, match="loops back"):
        load_config(tmp_path / "a.yaml")


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, ["train.max_steps=7", f"run.dir={tmp_path}"])
    saved = save_config(config, config.run_dir)
    assert saved == tmp_path / "demo" / "config.yaml"
    again = load_config(saved)
    assert again == config
    assert json.loads(json.dumps(again.model_dump(mode="json")))["train"]["max_steps"] == 7


def test_run_is_named_after_its_config_file(tmp_path):
    assert load_config(write(tmp_path / "my-exp.yaml", {"extends": "demo"})).run.name == "my-exp"
    named = write(tmp_path / "other.yaml", {"run": {"name": "kept"}})
    assert load_config(named).run.name == "kept"
    assert load_config(named, ["run.name=cli"]).run.name == "cli"
