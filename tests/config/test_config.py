import json

import pytest
import yaml

from phalanx.config.loader import load_config
from phalanx.errors import PhalanxError
from phalanx.run.prepare import save_config


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
    config = load_config(
        None,
        [
            "train.max_steps=50",
            "train.compile=true",
            "data.sources=[a.txt, b.txt]",
            "train.peak_tflops=1.5",
            "checkpoint.resume=never",
        ],
    )
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


def _off_keys() -> list[tuple[str, object]]:
    """Every key where YAML's `off` has a meaning, with that meaning: found from the schema itself, so a
    new key with choices (or an optional number) is covered without being listed here."""
    from phalanx.config.schema import _NO_MEANING, Config, _off_meaning

    found = []
    for section, field in Config.model_fields.items():
        model = field.annotation
        for key, sub in model.model_fields.items():
            meaning = model.OFF_MEANS[key] if key in model.OFF_MEANS else _off_meaning(sub.annotation)
            if meaning is not _NO_MEANING:
                found.append((f"{section}.{key}", meaning))
    return found


def test_off_keys_include_the_yaml_traps():
    keys = dict(_off_keys())
    assert keys["safe.preflight"] == "off" and keys["safe.numerics"] == "none"
    assert keys["parallel.strategy"] == "none" and keys["observe.store"] == "none"
    assert keys["checkpoint.resume"] == "never" and keys["observe.metrics_port"] is None
    assert "train.compile" not in keys and "run.name" not in keys  # a switch, and a name


@pytest.mark.parametrize("key, meaning", _off_keys())
@pytest.mark.parametrize("spelling", ["off", "Off", "'off'", "no"])
def test_off_as_people_write_it(tmp_path, key, meaning, spelling):
    section, leaf = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {leaf}: {spelling}\n")
    from_file = load_config(path)
    from_line = load_config(None, [f"{key}={spelling}"])
    for config in (from_file, from_line):
        value = getattr(getattr(config, section), leaf)
        assert value == meaning, f"{key}: {spelling} gave {value!r}"


def test_metrics_port_off_is_not_port_zero():
    """pydantic would take false as 0, which means "any free port": the opposite of off."""
    assert load_config(None, ["observe.metrics_port=off"]).observe.metrics_port is None
    assert load_config(None, ["observe.metrics_port=0"]).observe.metrics_port == 0


def test_a_boolean_where_none_fits_says_why():
    with pytest.raises(PhalanxError) as exc:
        load_config(None, ["run.name=no"])
    assert "run.name" in str(exc.value) and "quote it" in str(exc.value)
    with pytest.raises(PhalanxError, match="'quick', 'full' or 'off'.*quote it"):
        load_config(None, ["safe.preflight=on"])


def test_the_readme_config_block_loads(tmp_path):
    """The README's own config block, as the issue found it failing (`preflight: off`)."""
    from tests.test_readme import readme_config

    path = tmp_path / "my.yaml"
    path.write_text(readme_config())
    config = load_config(path)
    assert config.safe.preflight == "off" and config.run.name == "my-exp"


def test_micro_batch_is_derived_from_the_global_batch_per_rank_count():
    config = load_config(None)  # the demo leaves it null
    assert config.train.micro_batch_size is None
    assert [config.train.micro_batch(n) for n in (1, 2, 4, 8)] == [16, 8, 4, 2]
    assert config.train.eval_windows == 8 * 16  # the same held-out windows on any rank count
    fixed = load_config(None, ["train.micro_batch_size=4"])
    assert [fixed.train.micro_batch(n) for n in (1, 2)] == [4, 4] and fixed.train.eval_windows == 8 * 4


def test_derived_micro_batch_must_share_evenly():
    from phalanx.data.loader import check_batch_sizes

    for ranks in (1, 2, 4, 8, 16):
        check_batch_sizes(16, None, ranks)
    with pytest.raises(PhalanxError, match=r"multiple of the 3 data-parallel ranks"):
        check_batch_sizes(16, None, 3)
    with pytest.raises(PhalanxError, match=r"multiple of the 32 data-parallel ranks"):
        check_batch_sizes(16, None, 32)
