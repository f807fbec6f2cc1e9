"""The run configuration: one pydantic model per YAML section, every key strictly validated.

`extra="forbid"` everywhere, so a misspelt key is an error rather than a setting silently ignored;
config/loader.py turns pydantic's errors into one line that suggests the closest valid key.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

_NO_MEANING = object()


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # What `off` means for a key whose type alone cannot tell (a string key: off is not a name).
    OFF_MEANS: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _accept_off(cls, data: Any) -> Any:
        """People write `preflight: off`, and YAML 1.1 (PyYAML, so also `KEY=off` on the command line) reads
        a bare off or no as false. For every key where false is no valid value, false and "off" mean what off
        means there: the "off" or "none" choice of a key with choices, null for an optional number (no limit,
        not served), or the key's own word (OFF_MEANS). A quoted "off" is taken the same way."""
        if not isinstance(data, dict):
            return data
        fixed = dict(data)
        by_key = {f.alias or name: f for name, f in cls.model_fields.items()}  # as written: `checkpoint.async`
        for key, value in data.items():
            field = by_key.get(key)
            is_off = value is False or (isinstance(value, str) and value.strip().lower() == "off")
            if field is None or not is_off:
                continue
            meaning = cls.OFF_MEANS[key] if key in cls.OFF_MEANS else _off_meaning(field.annotation)
            if meaning is not _NO_MEANING:
                fixed[key] = meaning
        return fixed


def _off_meaning(annotation: Any) -> Any:
    """What off means for a key of this type; _NO_MEANING where false stays false (or stays an error)."""
    args = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    if bool in args:
        return _NO_MEANING  # a switch: false is its own value (pydantic reads "off" as false too)
    for arg in args:
        if typing.get_origin(arg) is Literal:
            choices = typing.get_args(arg)
            return "off" if "off" in choices else "none" if "none" in choices else _NO_MEANING
    if type(None) in args and str not in args:
        return None  # an optional number: pydantic would otherwise take false as 0 (metrics_port: any port!)
    return _NO_MEANING


class RunSection(Section):
    # The loader fills in the config file's name (`demo` for the built-in demo) when none is given.
    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="run directory name")
    dir: Path = Field(Path("runs"), description="root folder of all runs")


class ModelSection(Section):
    """A named preset, with any of its shape fields overridden; or a pretrained Hugging Face checkpoint."""

    OFF_MEANS = {"pretrained": None}

    preset: str = "tiny"
    # A Hugging Face checkpoint directory (config.json, safetensors weights, tokenizer.json): the run
    # starts from its weights, with its architecture and its tokenizer (models/families/).
    pretrained: str | None = None
    dim: PositiveInt | None = None
    n_layers: PositiveInt | None = None
    n_heads: PositiveInt | None = None
    n_kv_heads: PositiveInt | None = None
    ffn_dim: PositiveInt | None = None
    # None: the tokenizer's vocabulary size when training, the preset's elsewhere (bench).
    vocab_size: PositiveInt | None = None
    max_seq_len: PositiveInt | None = None
    rope_theta: float | None = Field(None, gt=0)
    norm_eps: float | None = Field(None, gt=0)
    tie_embeddings: bool | None = None
    # Llama 3.1 RoPE scaling (models/decoder.py); a factor of 1 turns it off.
    rope_scaling_factor: float | None = Field(None, ge=1)
    rope_low_freq_factor: float | None = Field(None, gt=0)
    rope_high_freq_factor: float | None = Field(None, gt=0)
    rope_original_max_seq_len: PositiveInt | None = None
    # What the families add to Llama's decoder (models/decoder.py ModelArgs).
    family: Literal["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3"] | None = None
    head_dim: PositiveInt | None = None  # per attention head; unset: dim / n_heads
    qkv_bias: bool | None = None
    qk_norm: bool | None = None
    sliding_window: PositiveInt | None = None
    # A mixture of experts (models/moe.py): 0 experts is a dense model.
    n_experts: NonNegativeInt | None = None
    n_experts_per_token: NonNegativeInt | None = None
    expert_ffn_dim: PositiveInt | None = None
    norm_topk_prob: bool | None = None
    n_dense_layers: NonNegativeInt | None = None
    router_aux_loss_coef: float | None = Field(None, ge=0)
    # DeepSeek-V3 (family deepseek_v3): its routing (models/moe.py), multi-head latent attention
    # (models/mla.py; q_lora_rank 0: one q projection) and YaRN (rope_scaling_type yarn).
    router_scoring: Literal["softmax", "sigmoid"] | None = None
    n_expert_groups: PositiveInt | None = None
    n_expert_groups_per_token: PositiveInt | None = None
    routed_scaling_factor: float | None = Field(None, gt=0)
    n_shared_experts: NonNegativeInt | None = None
    attention: Literal["gqa", "mla"] | None = None
    q_lora_rank: NonNegativeInt | None = None
    kv_lora_rank: NonNegativeInt | None = None
    qk_nope_head_dim: NonNegativeInt | None = None
    qk_rope_head_dim: NonNegativeInt | None = None
    v_head_dim: NonNegativeInt | None = None
    rope_interleave: bool | None = None
    rope_scaling_type: Literal["llama3", "yarn"] | None = None
    yarn_beta_fast: float | None = Field(None, gt=0)
    yarn_beta_slow: float | None = Field(None, gt=0)
    yarn_mscale: float | None = Field(None, ge=0)
    yarn_mscale_all_dim: float | None = Field(None, ge=0)


class SftSection(Section):
    """How fine-tuning records become examples (data.kind: sft; data/sft.py)."""

    shape: Literal["auto", "messages", "alpaca", "prompt_completion"] = "auto"  # auto: from each file's first record
    train_on_prompts: bool = False  # train every token, not only the assistant's replies
    too_long: Literal["refuse", "truncate"] = "refuse"  # an example longer than train.seq_len + 1
    pack: bool = True  # several examples to a row (attention stays inside each)


class DataSection(Section):
    # Each entry a path, glob, builtin: or hf: name, or {path: ..., weight: ...} to mix the entries by weight
    # (data/mixture.py) rather than by the tokens each holds; the weights are then kept in `weights`.
    sources: list[str] = Field(default_factory=lambda: ["builtin:shakespeare"], min_length=1)
    weights: list[float] | None = None  # one per entry of `sources`, any scale (0.7/0.3 or 7/3)
    # A weighted source whose windows are all used: start it again (its epoch +1) or end the run.
    mixture_exhausted: Literal["repeat", "stop"] = "repeat"
    OFF_MEANS = {"tokenizer": None}
    WEIGHTED_KEYS: ClassVar[tuple[str, ...]] = ("path", "weight")

    kind: Literal["text", "sft"] = "text"  # sft: fine-tuning records (chat messages, alpaca, prompt/completion)
    sft: SftSection = Field(default_factory=SftSection)

    # Path to an existing tokenizer.json; None trains a byte-level BPE on the corpus.
    tokenizer: str | None = None
    vocab_size: PositiveInt = 4096
    val_fraction: float = Field(0.05, gt=0, lt=0.5)
    # The text of each record: a .jsonl(.gz/.zst) line's key, a Parquet or Hugging Face dataset's column.
    text_field: str = "text"
    # Processes tokenising text on this node; None: one per core available. The shards are the same bytes
    # for any number (data/dispatch.py).
    workers: PositiveInt | None = None
    # The most text a trained tokenizer reads (1 GiB): a larger corpus is sampled (data/tokenizer_sample.py).
    tokenizer_sample_bytes: PositiveInt = 1 << 30

    @model_validator(mode="before")
    @classmethod
    def _split_weighted_sources(cls, data: Any) -> Any:
        """`sources: [{path: A, weight: 0.7}, ...]` becomes `sources: [A, ...]` and `weights: [0.7, ...]`, so
        everything that reads data.sources still sees paths, and the saved config loads back the same."""
        if not isinstance(data, dict) or not isinstance(data.get("sources"), list):
            return data
        entries = data["sources"]
        if not any(isinstance(e, dict) for e in entries):
            return data
        if not all(isinstance(e, dict) for e in entries):
            raise ValueError("data.sources: give every source a weight ({path: ..., weight: ...}) or none")
        if data.get("weights") is not None:
            raise ValueError("data.sources: give the weights with the sources or in data.weights, not both")
        for entry in entries:
            for key in entry:
                if key not in cls.WEIGHTED_KEYS:
                    import difflib  # only here: the one place a key inside a list item is checked by hand

                    close = difflib.get_close_matches(str(key), cls.WEIGHTED_KEYS, n=1)
                    hint = f"; did you mean '{close[0]}'?" if close else f" (it takes {', '.join(cls.WEIGHTED_KEYS)})"
                    raise ValueError(f"unknown key '{key}' in a data.sources entry{hint}")
            missing = [k for k in cls.WEIGHTED_KEYS if k not in entry]
            if missing:
                raise ValueError(
                    f"data.sources entry {entry} has no {missing[0]}: give each {{path: ..., weight: ...}}"
                )
        return {**data, "sources": [e["path"] for e in entries], "weights": [e["weight"] for e in entries]}

    @model_validator(mode="after")
    def _check_weights(self) -> DataSection:
        if self.weights is None:
            if self.mixture_exhausted != "repeat":
                raise ValueError("data.mixture_exhausted applies to weighted data.sources ({path: ..., weight: ...})")
            return self
        if len(self.weights) != len(self.sources):
            raise ValueError(
                f"data.weights has {len(self.weights)} weights for {len(self.sources)} data.sources: one per source"
            )
        for source, weight in zip(self.sources, self.weights):
            if not 0 <= weight < float("inf"):  # also refuses nan
                raise ValueError(f"data source {source} has weight {weight}: weights must be 0 or more")
        if sum(self.weights) <= 0:
            raise ValueError("data.sources weights add up to 0: give at least one source a positive weight")
        if self.kind != "text":
            raise ValueError("data.sources weights mix text; fine-tuning (data.kind: sft) takes none")
        return self


class TrainSection(Section):
    max_steps: PositiveInt = 250
    # End the process cleanly after this step (saving a checkpoint) without touching the schedule.
    halt_at_step: PositiveInt | None = None
    seed: int = 1337
    seq_len: PositiveInt = 256
    global_batch_size: PositiveInt = 16
    # null: each rank takes its whole share of the global batch in one pass (global / ranks, no gradient
    # accumulation), so one config runs on 1, 2, 4 or 8 ranks; set it to accumulate over smaller passes.
    micro_batch_size: PositiveInt | None = None
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    eval_interval: PositiveInt = 50
    eval_batches: PositiveInt = 8
    compile: bool = False
    activation_checkpointing: bool = False
    # auto: bf16 autocast on GPUs, fp32 on CPU.
    # float8: torchao's float8 training for the linear layers (GPUs with fp8 matrix cores), bf16 elsewhere.
    dtype: Literal["auto", "float32", "bfloat16", "float8"] = "auto"
    # Peak TFLOP/s of one device, for MFU where the device is not in the built-in table (CPUs).
    peak_tflops: float | None = Field(None, gt=0)
    # A mixture of experts with a routing bias (DeepSeek-V3): how far each step moves each expert's bias
    # towards even load (auxiliary-loss-free balancing); 0 leaves the biases as they are.
    moe_bias_rate: float = Field(0.001, ge=0)

    @model_validator(mode="after")
    def _check_batches(self) -> TrainSection:
        if self.micro_batch_size and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}"
            )
        if self.halt_at_step is not None and self.halt_at_step > self.max_steps:
            raise ValueError(f"train.halt_at_step={self.halt_at_step} is beyond train.max_steps={self.max_steps}")
        return self

    def micro_batch(self, ranks: int) -> int:
        """Sequences per forward pass on one of `ranks` data-parallel ranks (0 if the global batch does not
        even give each rank one: data/loader.check_batch_sizes says so)."""
        return self.micro_batch_size or self.global_batch_size // ranks

    @property
    def eval_windows(self) -> int:
        """Held-out windows per evaluation, the same set on any number of ranks: eval_batches micro-batches,
        of the global batch's size when micro_batch_size is null (it then depends on the rank count)."""
        return self.eval_batches * (self.micro_batch_size or self.global_batch_size)


class LoraSection(Section):
    """Low-rank adapters on a pretrained model (models/lora.py): the base weights stay frozen."""

    rank: NonNegativeInt = 0  # 0: off (every weight trains)
    alpha: float = Field(16.0, gt=0)  # the update is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapters' input
    targets: Literal["attention", "mlp", "all"] = "all"  # which linear layers of every block
    quantize_base: bool = False  # QLoRA: the adapted layers' frozen weights in 4-bit NF4 (torchao)


class ParallelSection(Section):
    """How the ranks share the model: a device mesh pp x dp_replicate x dp_shard x cp x tp
    (parallel/mesh.py), whose size is the world size."""

    # Where the data-parallel ranks go when dp_replicate and dp_shard are not given: ddp replicates the
    # model on each, fsdp shards it across them. With one process there is nothing to share.
    strategy: Literal["none", "ddp", "fsdp"] = "ddp"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dp_replicate: PositiveInt | None = Field(None, description="model replicas (DDP, or HSDP's outer dim)")
    dp_shard: int | None = Field(None, ge=-1, description="ranks one FSDP2 shard group spans; -1: the rest")
    tp: PositiveInt = Field(1, description="tensor-parallel ranks (DTensor: heads and FFN split)")
    pp: PositiveInt = Field(1, description="pipeline stages (torch.distributed.pipelining), split by layer")
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    pp_microbatches: PositiveInt | None = Field(None, description="micro-batches per pipeline step; null: pp")
    cp: PositiveInt = Field(1, description="context-parallel ranks: each holds a slice of every sequence")
    ep: PositiveInt = Field(
        1, description="expert-parallel ranks, borrowed from dp_shard: each holds 1/ep of the experts"
    )

    @model_validator(mode="after")
    def _check_degrees(self) -> ParallelSection:
        if self.dp_shard == 0:
            raise ValueError("parallel.dp_shard must be a positive number of ranks, or -1 for the rest")
        return self


class CheckpointSection(Section):
    # `async` is a Python keyword: the field is async_save, the key people write `checkpoint.async`.
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True, validate_by_alias=True)
    OFF_MEANS = {"resume": "never", "memory_interval": 0}

    interval: PositiveInt = 125
    keep: PositiveInt = 3
    # auto: continue from the newest checkpoint in the run directory if there is one.
    resume: str = Field("auto", description="auto | never | path to a checkpoint directory")
    # Write each save in the background (DCP async_save) while training goes on; it is published (manifest,
    # atomic rename) at the first step boundary after every rank's part is written.
    async_save: bool = Field(False, alias="async")
    # In-memory snapshots (host shared memory, phalanx/train/memory_checkpoint.py) every N steps, which a
    # restart after a crash resumes from when newer than the newest checkpoint; 0 is off; auto: every step
    # while one costs under 2% of a step, else the smallest interval that keeps it there.
    memory_interval: NonNegativeInt | Literal["auto"] = Field("auto", description="steps | auto | 0 (off)")


class FaultSpec(Section):
    """One injected fault, for drills and tests. Fires once per run unless `repeat` is set."""

    fault: Literal["kill", "hang", "stop", "slow", "nan", "oom", "corrupt_checkpoint", "fail_save"]
    rank: NonNegativeInt = 0
    step: PositiveInt = 1
    ms: NonNegativeInt = 0  # for `slow`: added to every step of that rank from `step` on
    # for `hang`: where the rank blocks; `collective` blocks it inside an all-reduce its peers never join
    phase: Literal["forward", "collective"] = "forward"
    repeat: bool = False  # fire on every attempt (crash-loop drills)


class SafeSection(Section):
    """Keeping a run alive: supervision, hang and straggler detection, recovery, numerics guard."""

    max_restarts: NonNegativeInt = 3
    # This many restarts in a row without a newer checkpoint is a crash loop: stop, exit code 3.
    crash_loop_restarts: PositiveInt = 3
    heartbeats: bool = True
    # Ranks forked from a server that has imported torch and the trainer once per launch (a restart then
    # costs no interpreter start and no `import torch`); false starts each rank as a fresh interpreter.
    warm_restarts: bool = True
    hang_timeout_s: float | None = Field(None, gt=0, description="fixed; null calibrates from step times")
    hang_multiplier: float = Field(10.0, gt=1)
    hang_floor_s: float = Field(60.0, gt=0)
    startup_timeout_s: float = Field(600.0, gt=0)
    checkpoint_timeout_s: float = Field(900.0, gt=0)
    eval_timeout_s: float = Field(600.0, gt=0)
    # On SIGTERM the ranks finish their step and save there; the node agent kills them after this long.
    preemption_grace_s: float = Field(60.0, gt=0)
    numerics: Literal["rollback", "skip", "none"] = "rollback"  # off is accepted for none
    spike_zscore: float = Field(6.0, gt=0)
    spike_window: int = Field(100, ge=10)
    straggler_threshold: float = Field(0.75, gt=0, lt=1)
    straggler_window: NonNegativeInt = Field(20, description="steps per straggler check; 0 disables it")
    # A rank is only a straggler when it also loses at least this much per step: on tiny steps the
    # scheduling noise of a busy host alone moves the score below the threshold.
    straggler_min_ms: float = Field(10.0, ge=0)
    inject: list[FaultSpec] = Field(default_factory=list)
    # Cluster preflight before training and before each restart (a failing node is named and
    # quarantined instead of joining); `phalanx preflight` runs the same checks by hand.
    preflight: Literal["quick", "full", "off"] = "off"
    # Limits that replace the built-in table's, keyed CHECK (failure) or CHECK.warn (warning).
    # Plain data here (config imports no other stage): the preflight checks the names, and `phalanx train`
    # refuses unknown ones before it starts (preflight/thresholds.py: config_overrides).
    preflight_thresholds: dict[str, float] = Field(default_factory=dict)


class ObserveSection(Section):
    """Where a run's metrics and events go besides the plain files in its run directory."""

    OFF_MEANS = {"store": "none"}

    # null: an SQLite file RUNS_ROOT/phalanx.db; a SQLAlchemy URL (postgresql://user@host/db) for a store
    # several machines share; or `none` (or off) for no store.
    store: str | None = None
    # Prometheus /metrics from the node agent while the run trains; null: not served, 0: any free port.
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    tensorboard: bool = Field(False, description="also write TensorBoard event files to RUN_DIR/tensorboard")
    sync_interval_s: float = Field(1.0, gt=0, description="how often the agent copies new records to the store")
    # At the end of a launch, how long the store's writer keeps retrying a store that is down so the final
    # status and every step land (beyond it, `phalanx runs import RUN_DIR` completes the copy).
    store_retry_s: float = Field(60.0, ge=0)
    # Hardware telemetry from the node agent (RUN_DIR/telemetry.jsonl and /metrics); 0 turns it off.
    telemetry_interval_s: float = Field(5.0, ge=0)
    # Crossing one of these is a telemetry_alert event.
    alert_host_memory_ratio: float = Field(0.95, gt=0, le=1)
    alert_disk_free_gib: float = Field(5.0, ge=0)
    alert_device_temp_c: float = Field(90.0, gt=0)
    alert_device_memory_ratio: float = Field(0.98, gt=0, le=1)


class EvalSection(Section):
    """lm-evaluation-harness tasks scored on the run's checkpoints while it trains: rank 0 runs
    `phalanx eval` on each chosen checkpoint in a low-priority process of its own (train/background_eval.py),
    and the scores land in RUN_DIR/eval/, the run store, the dashboard and /metrics. Distinct from
    train.eval_interval, the validation loss the ranks compute themselves."""

    OFF_MEANS = {"tasks": []}

    tasks: list[str] = Field(default_factory=list, description="task names; empty: off")
    # Which checkpoints: those whose step is a multiple of this (so a multiple of checkpoint.interval),
    # and the last one; null: every checkpoint saved.
    interval: PositiveInt | None = None
    limit: PositiveInt | None = None  # at most this many samples per task; null: all of them
    batch_size: PositiveInt = 8  # prompts scored together
    include_path: str | None = None  # a directory of local task files (*.yaml) besides lm-eval's own
    # An evaluation running longer is stopped (an eval_tasks_failed event): a hung harness must not hold
    # the end of the run, which waits for the last checkpoint's.
    timeout_s: float = Field(3600.0, gt=0)

    @model_validator(mode="after")
    def _check_tasks(self) -> EvalSection:
        if any(not name.strip() or "," in name for name in self.tasks):
            raise ValueError("eval.tasks: give each task name as its own list entry, e.g. [hellaswag, arc_easy]")
        return self


class Config(Section):
    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainSection = Field(default_factory=TrainSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    safe: SafeSection = Field(default_factory=SafeSection)
    observe: ObserveSection = Field(default_factory=ObserveSection)
    eval: EvalSection = Field(default_factory=EvalSection)

    @model_validator(mode="after")
    def _check_eval_interval(self) -> Config:
        """Tasks are scored on saved checkpoints: an interval no save falls on would score none of them."""
        every = self.eval.interval
        if self.eval.tasks and every is not None and every % self.checkpoint.interval:
            raise ValueError(
                f"eval.interval={every} is not a multiple of checkpoint.interval={self.checkpoint.interval}: "
                "tasks are scored on saved checkpoints"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return self.run.dir / self.run.name
