"""Expert parallelism (parallel/expert_parallel.py) through the real launcher on gloo: a tiny mixture of
experts with its 8 experts split over 2 ranks trains to one process's losses, resumes to the bit after a
halt or a killed rank, and its checkpoints reshard to one process; what it cannot run is one line."""

import json
from pathlib import Path

import pytest

from phalanx.run.records import read_events
from tests.helpers import launched, losses_by_step, phalanx, train_json


@pytest.fixture
def moe_args(tiny_args):
    """Micro-batches of 2 rows on any layout: the load-balancing loss is each micro-batch's own, so
    layouts match only where they cut the same micro-batches."""
    model = ["model.preset=tiny-moe", "model.max_seq_len=64", "train.micro_batch_size=2"]
    return [a for a in tiny_args if not a.startswith(("model.", "train.micro_batch_size="))] + model


def named(args, suffix):
    return [a + suffix if a.startswith("run.name=") else a for a in args]


def assert_close_losses(one: dict, many: dict) -> None:
    assert one.keys() == many.keys()
    for step in one:
        assert many[step] == pytest.approx(one[step], rel=1e-5), (step, one[step], many[step])


@pytest.fixture
def one_process(moe_args):
    """6 steps: as under FSDP alone (tests/models/test_models_moe.py), later steps may flip a routing
    decision between summation orders."""
    return losses_by_step(train_json(*named(moe_args, "-one"), "train.max_steps=6")["run_dir"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,ranks",
    [
        (["parallel.strategy=fsdp", "parallel.ep=2"], "2"),  # each rank holds 4 of the 8 experts
        (["parallel.strategy=fsdp", "parallel.ep=2"], "4"),  # dp_shard=4: two groups of 2 split the experts
        (["parallel.tp=2"], "2"),  # each tp rank routes the whole sequence through whole experts
        (["parallel.strategy=fsdp", "parallel.ep=2", "parallel.tp=2"], "4"),  # dp_shard=2 x tp=2
        # Two stages of 2 layers; the schedule cuts each rank's share into one process's 2-row micro-batches.
        (["parallel.pp=2", "parallel.pp_microbatches=4", "train.micro_batch_size=8"], "2"),
        (["parallel.strategy=fsdp", "parallel.ep=2", "parallel.pp=2", "train.micro_batch_size=4"], "4"),
        # Each rank holds half of every sequence, all the experts; the balancing loss is the sequences'.
        (["parallel.cp=2"], "2"),
    ],
    ids=["ep2", "ep2-dp_shard4", "tp2", "ep2-tp2", "pp2", "ep2-pp2", "cp2"],
)
def test_expert_parallel_matches_one_process(moe_args, one_process, layout, ranks):
    run = train_json(*named(moe_args, f"-ep-{ranks}"), *layout, "train.max_steps=6", "--nproc", ranks)
    assert_close_losses(one_process, losses_by_step(run["run_dir"]))


@pytest.mark.slow
def test_compiled_expert_parallel_matches_one_process(moe_args, one_process):
    """Each block compiled, the all-to-all's split sizes break its graph; in float32 the experts' grouped
    GEMM gives way to the loop (torch traces it in bfloat16 only: models/moe.py)."""
    ep = ["parallel.strategy=fsdp", "parallel.ep=2", "train.max_steps=6", "--nproc", "2"]
    compiled = losses_by_step(train_json(*named(moe_args, "-compiled"), "train.compile=true", *ep)["run_dir"])
    assert one_process.keys() == compiled.keys()
    for step in one_process:  # inductor's fused kernels sum in their own order: 1e-4, as for a dense model
        assert compiled[step] == pytest.approx(one_process[step], rel=1e-4), (step, one_process, compiled)


@pytest.mark.slow
def test_deepseek_under_expert_and_tensor_parallelism_matches_one_process(moe_args):
    """Sigmoid routing over groups, a shared expert, a dense first layer and MLA, with the routing biases
    moved every step from every rank's counts: ep=2 keeps one process's losses, and so does tp=2, which
    splits the latent attention's heads (parallel/tensor_parallel.py)."""
    deepseek = [*moe_args, "model.preset=deepseek-v3-tiny", "train.max_steps=6"]
    one = losses_by_step(train_json(*named(deepseek, "-one"))["run_dir"])
    ep = ["parallel.strategy=fsdp", "parallel.ep=2", "--nproc", "2"]
    assert_close_losses(one, losses_by_step(train_json(*named(deepseek, "-ep"), *ep)["run_dir"]))
    tp = ["parallel.tp=2", "--nproc", "2"]
    assert_close_losses(one, losses_by_step(train_json(*named(deepseek, "-tp"), *tp)["run_dir"]))


@pytest.mark.slow
def test_expert_parallel_resumes_exactly_and_its_checkpoint_resumes_on_one_process(moe_args):
    ep = ["parallel.strategy=fsdp", "parallel.ep=2", "train.max_steps=8", "checkpoint.interval=4"]
    whole = losses_by_step(train_json(*named(moe_args, "-whole"), *ep, "--nproc", "2")["run_dir"])
    halted = named(moe_args, "-halted")
    assert train_json(*halted, *ep, "train.halt_at_step=4", "--nproc", "2")["steps"] == 4
    resumed = losses_by_step(train_json(*halted, *ep, "--nproc", "2")["run_dir"])
    assert resumed == whole  # bit-identical
    # A rank killed in step 7: the restart takes step 6's in-memory snapshot (each rank's own experts).
    kill = json.dumps([{"fault": "kill", "rank": 1, "step": 7}])
    drill = [*ep, "checkpoint.memory_interval=1", "safe.hang_floor_s=2", f"safe.inject={kill}", "--nproc", "2"]
    killed = train_json(*named(moe_args, "-killed"), *drill)
    assert killed["restarts"] == 1 and losses_by_step(killed["run_dir"]) == whole
    loaded = [e for e in read_events(Path(killed["run_dir"])) if e["kind"] == "checkpoint_loaded"]
    assert [e["source"] for e in loaded] == ["memory"]
    # The same step-4 checkpoint, its experts read whole by one process.
    alone = named(moe_args, "-alone")
    train_json(*alone, *ep, "train.halt_at_step=4", "--nproc", "2")
    one = losses_by_step(train_json(*alone, "train.max_steps=8", "checkpoint.interval=4")["run_dir"])
    assert_close_losses({s: loss for s, loss in whole.items() if s > 4}, {s: loss for s, loss in one.items() if s > 4})


@pytest.mark.parametrize(
    "extra,error",
    [
        (
            ["model.preset=tiny", "parallel.strategy=fsdp", "parallel.ep=2"],
            "error: parallel.ep=2 splits a mixture of experts' experts, and this model has none",
        ),
        (
            ["parallel.strategy=fsdp", "parallel.ep=3"],
            "error: parallel.ep=3 does not divide dp_shard=2: expert parallelism splits the experts over FSDP's "
            "shard ranks (parallel.strategy fsdp, or parallel.dp_shard)",
        ),
        (
            ["parallel.strategy=ddp", "parallel.ep=2"],
            "error: parallel.ep=2 does not divide dp_shard=1: expert parallelism splits the experts over FSDP's "
            "shard ranks (parallel.strategy fsdp, or parallel.dp_shard)",
        ),
    ],
    ids=["dense", "uneven", "ddp"],
)
def test_what_expert_parallelism_cannot_run_is_one_line(moe_args, extra, error):
    proc = phalanx("train", *moe_args, *extra, "--nproc", "2", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == [error], proc.stderr


def mixtral_checkpoint(tmp_path: Path, n_experts: int):
    """(its ModelArgs, the folder): a tiny Mixtral made and saved by transformers."""
    import torch
    import transformers

    from phalanx.models.decoder import ModelArgs
    from phalanx.models.families import hf_config

    args = ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=64,
        family="mixtral", n_experts=n_experts, n_experts_per_token=2,
    )  # fmt: skip
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**json.loads(json.dumps(hf_config(args, 0, 1, torch.float32))))
    checkpoint = tmp_path / "mixtral"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    return args, checkpoint


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel, nproc",
    [({"strategy": "fsdp"}, 2), ({"strategy": "fsdp", "ep": 2}, 2), ({"strategy": "fsdp", "ep": 2}, 4)],
    ids=["fsdp", "ep2", "ep2-dp_shard4"],
)
def test_a_pretrained_mixture_of_experts_loads_each_ranks_experts(tmp_path, parallel, nproc):
    """A Mixtral checkpoint made by transformers, loaded by ranks each holding some of the 4 experts
    (FSDP's shards of whole experts; expert parallelism's halves; on 4 ranks those halves sharded again
    over the 2 ranks holding each, one expert a rank): together they hold every tensor exactly."""
    import torch

    from phalanx.models.families import expert_slice, hf_names
    from tests.hf_checkpoints import hf_tensors
    from tests.train.test_train_pretrained import loaded_under

    args, checkpoint = mixtral_checkpoint(tmp_path, 4)
    (tmp_path / "params").mkdir()
    params = loaded_under(tmp_path / "params", checkpoint, parallel, nproc)
    expected = hf_tensors(checkpoint)
    for ours, theirs in hf_names(args).items():
        assert torch.equal(expert_slice(params, ours), expected[theirs]), ours


@pytest.mark.slow
def test_a_pretrained_mixture_of_experts_split_within_its_experts_is_refused(tmp_path):
    """ep=2 on 4 ranks with 2 experts: each ep rank's one expert is split along its hidden dimension
    between the 2 ranks holding it, which a checkpoint's whole experts are not loaded into."""
    from tests.train.test_train_pretrained import WORKER

    _, checkpoint = mixtral_checkpoint(tmp_path, 2)
    parallel = json.dumps({"strategy": "fsdp", "ep": 2})
    result = launched(WORKER, parallel, str(checkpoint), str(tmp_path / "params.pt"), nproc=4)
    assert result.returncode != 0
    assert "layers.0.feed_forward.w1 is split within its experts on this layout" in result.stderr, result.stderr[-3000:]
