"""The training loop. Every rank runs `train(config)`; rank 0 also writes the run's files.

Read top to bottom: `Trainer.__init__` sets up (data, model, parallelism, optimizer, safety), `run`
resumes (where from is train/resume.py's decision) and loops over steps, `_step` feeds one step
(train/step.py: micro-batches with gradient accumulation, clipping, the update) with the supervision that
reaches it through SupervisedStep's hooks (heartbeats, fault drills, the numerics guard), then evaluation,
checkpoints and the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

from phalanx.config.schema import Config
from phalanx.data.datasets import split_datasets
from phalanx.data.loader import check_batch_sizes
from phalanx.data.mixture_sources import train_loader
from phalanx.data.tokenizer import load_tokenizer, special_tokens
from phalanx.errors import PreemptedError
from phalanx.models import cpu_attention
from phalanx.models.flops import achieved_tflops, flops_per_token, mfu, peak_tflops
from phalanx.models.from_config import model_args
from phalanx.models.lora import quantize_base
from phalanx.parallel.build import build_parallel_model, uses_fsdp
from phalanx.parallel.context_parallel import apply_sequence_balance, context_split
from phalanx.parallel.device import compute_dtype, device_name, peak_memory_gib
from phalanx.parallel.distributed import (
    DistEnv,
    all_reduce_sum,
    init_distributed,
    teardown,
)
from phalanx.parallel.mesh import build_mesh, dp_coordinate, resolve_layout
from phalanx.parallel.pipeline import Pipeline, check_pipeline, microbatches
from phalanx.run.jsonl import JsonlSink, MetricsSink, NullSink, json_safe
from phalanx.run.layout import RunDir
from phalanx.run.prepare import prepared_data
from phalanx.run.records import JsonlEventSink, read_events, read_metrics
from phalanx.run.throughput import run_throughput
from phalanx.safe.heartbeat import Heartbeat
from phalanx.safe.inject import FaultInjector
from phalanx.safe.numerics import NumericsGuard
from phalanx.safe.preemption import PREEMPTION
from phalanx.safe.stacks import register_stack_dump
from phalanx.safe.stragglers import ComputeClock, StragglerDetector
from phalanx.train.background_eval import BackgroundEval
from phalanx.train.checkpoint import Checkpointer
from phalanx.train.evaluate import Evaluator
from phalanx.train.expert_balance import expert_balance
from phalanx.train.memory_checkpoint import MemorySnapshots, remove_rank
from phalanx.train.optim import build_optimizer, lr_at
from phalanx.train.pretrained import load_pretrained
from phalanx.train.progress import ProgressLine, notice
from phalanx.train.resume import ResumePoint, check_fine_tuning_layout, resume_point
from phalanx.train.sample_replies import SampleReplies
from phalanx.train.saving import CheckpointSaves
from phalanx.train.step import StepHooks, sft_loss_scale, train_step


def train(config: Config, attempt: int = 0) -> dict[str, Any]:
    """Run (or resume) the configured training on this rank; returns the run summary."""
    env = init_distributed(config.parallel.strategy, config.parallel.backend, config.parallel.device)
    stacks = register_stack_dump(RunDir(config.run_dir).stack_file(attempt, env.rank))
    clean = False
    try:
        # Model and optimizer live only inside the Trainer, released before the group is destroyed.
        summary = Trainer(config, env).run()
        clean = True
        return summary
    except PreemptedError:
        clean = True  # every rank stopped after the same step: the closing barrier meets them all
        raise
    finally:
        # The run ends here on this rank (finished, stopped, or failed with no restart left): its in-memory
        # snapshots go. Those of a rank killed outright go when a later launch finds their agent gone.
        if clean or attempt >= config.safe.max_restarts:
            remove_rank(config.run_dir, env.rank)
        teardown(clean)
        stacks.close()
        if Path(stacks.name).stat().st_size == 0:  # nothing was dumped: no file to keep
            Path(stacks.name).unlink()


class Trainer:
    def __init__(self, config: Config, env: DistEnv):
        self.started = time.perf_counter()
        self.config, self.env, self.tc, self.safe = config, env, config.train, config.safe
        self.run_dir = config.run_dir
        run = RunDir(self.run_dir)
        self.heartbeat = Heartbeat(env.local_rank, enabled=self.safe.heartbeats)
        self.heartbeat.beat("start", 0)
        self.events = JsonlEventSink(self.run_dir)
        tc = self.tc

        data = prepared_data(self.run_dir)
        self.args = model_args(config.model, data.vocab_size, tc.seq_len)
        torch.manual_seed(tc.seed)
        self.layout = resolve_layout(config.parallel, env.world_size)
        mesh = build_mesh(self.layout, env.device.type)
        self.split = context_split(self.layout, mesh)  # cp: this rank's share of every sequence
        dp_rank, dp_world = dp_coordinate(mesh, self.layout)  # tensor-parallel ranks share one: same batches
        self.env = env = dataclasses.replace(env, dp_rank=dp_rank, dp_world=dp_world)
        if self.layout.pp > 1:  # before the build: a refusal is one line, not a traceback from inside it
            check_pipeline(self.args, config.parallel, tc.micro_batch(env.dp_world))
        dtype = compute_dtype(tc.dtype, env.device)
        if tc.dtype == "auto" and env.device.type == "cpu":  # say what `auto` chose where it depends on the CPU
            why = "this CPU has bf16 matrix units" if dtype == torch.bfloat16 else "this CPU has no bf16 matrix units"
            name = "bfloat16 autocast" if dtype == torch.bfloat16 else "float32"
            notice(f"train.dtype auto: {name} ({why}; train.dtype=float32 or bfloat16 sets it)", env.is_main)
        if env.device.type == "cpu":  # a first build of the CPU attention kernel (~10 s) counts as start-up
            cpu_attention.ready()
        # Built on the meta device and materialised shard by shard: the same weights under any layout.
        self.model = build_parallel_model(
            self.args,
            self.layout,
            mesh,
            env.device,
            seed=tc.seed,
            activation_checkpointing=tc.activation_checkpointing,
            compile=tc.compile,
            dtype=dtype,
            float8=tc.dtype == "float8",
            pp_schedule=config.parallel.pp_schedule,
            # A pretrained run loads every parameter (its checkpoint, or the run's own when resuming).
            initialise=config.model.pretrained is None,
            lora=config.lora,
        )
        # Pipeline parallelism: the schedule runs this rank's stages; losses live on the last stage.
        self.pipeline, self.pp_group = None, None
        if self.layout.pp > 1:
            self.pp_group = mesh["pp"].get_group()
            self.pipeline = Pipeline(
                self.model,
                config.parallel.pp_schedule,
                microbatches(self.layout.pp, config.parallel.pp_microbatches),
                self.pp_group,
                env.device,
            )
        # Under FSDP the mixed-precision policy casts parameters; elsewhere autocast does.
        use_autocast = dtype != torch.float32 and not uses_fsdp(self.layout)
        self.autocast = (
            (lambda: torch.autocast(env.device.type, dtype=dtype)) if use_autocast else contextlib.nullcontext
        )
        # A mixture of experts' routing. LoRA keeps the base as loaded, routing biases too: the adapters
        # alone are its result (and its export).
        bias_rate = 0.0 if config.lora.rank else tc.moe_bias_rate
        self.expert_balance = expert_balance(self.model, self.args, env.device, bias_rate)
        apply_sequence_balance(self.model, self.split)  # cp: the whole sequences' balancing loss
        self.optimizer = build_optimizer(self.model, tc)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

        check_batch_sizes(tc.global_batch_size, tc.micro_batch_size, env.dp_world)  # an elastic regroup, too
        if data.kind == "sft":
            check_fine_tuning_layout(config.parallel)
        train_data, val_data = split_datasets(data, tc.seq_len, config.data.sft.pack)
        self.loader = train_loader(  # weighted data.sources: drawn from each source by weight
            data,
            train_data,
            config.data.sources,
            config.data.weights,
            config.data.mixture_exhausted,
            tc.seq_len,
            tc.global_batch_size,
            tc.micro_batch(env.dp_world),
            env.dp_rank,
            env.dp_world,
            tc.seed,
            pin_memory=env.device.type == "cuda",
            on_repeat=self._source_repeated,
        )
        self.evaluator = Evaluator(
            val_data,
            tc,
            env,
            self.autocast,
            pipeline=self.pipeline,
            split=self.split,
        )
        # A LoRA run's checkpoints name what they adapt: the lora settings and the base checkpoint (path and
        # SHA-256, RUN_DIR/pretrained.json), which the model loader reads back under the adapters.
        self.adapters_record: dict[str, Any] = {}
        if config.lora.rank:
            base = json.loads(run.pretrained.read_text())
            self.adapters_record = {"lora": config.lora.model_dump(), "base": {k: base[k] for k in ("path", "sha256")}}
        self.samples = None
        if data.kind == "sft":
            tokenizer = load_tokenizer(run.tokenizer)
            stops = special_tokens(tokenizer).stop_ids
            self.samples = SampleReplies(
                val_data, tokenizer, stops, self.args.max_seq_len, env.device, pad_to=self.layout.tp
            )
        self.checkpointer = Checkpointer(
            run.checkpoints, config.checkpoint.keep, env, asynchronous=config.checkpoint.async_save
        )
        self.guard = NumericsGuard(self.safe.spike_zscore, self.safe.spike_window)
        self.snapshots = MemorySnapshots(
            run.path,
            env,
            dataclasses.asdict(self.layout),
            config.checkpoint.memory_interval,
            say=self._say,
            emit=self._emit,
        )
        self.clock = ComputeClock(env.device)
        self.stragglers = StragglerDetector(
            self.safe.straggler_window, self.safe.straggler_threshold, self.safe.straggler_min_ms / 1000, env
        )
        self.faults = FaultInjector(
            self.safe.inject, env.rank, self.events, self.run_dir, self.heartbeat, device=env.device
        )

        self.tokens_per_step = tc.global_batch_size * tc.seq_len
        self.fpt = flops_per_token(self.args, tc.seq_len)
        self.peak = tc.peak_tflops or peak_tflops(device_name(env.device))
        self.sink: MetricsSink = JsonlSink(run.metrics) if env.is_main else NullSink()
        # Every rank's own timings, for the store's rank-by-step heatmap (one small line per step).
        self.rank_sink = JsonlSink(run.rank_timings(env.rank))
        self.node = socket.gethostname()
        self.state: dict[str, Any] = {}
        # eval.tasks: rank 0 scores chosen checkpoints in a background process once they are saved.
        self.background_eval = BackgroundEval(
            config.eval,
            env.device.type,
            env.device.index,
            tc.halt_at_step or tc.max_steps,
            env.is_main,
            self._emit,
            self._say,
        )
        self.saves = CheckpointSaves(
            self.checkpointer,
            self.model,
            self.optimizer,
            self.heartbeat,
            self.faults,
            self._emit,
            lambda line: self.progress.log(line),
            saved=self.background_eval.checkpoint_saved,
        )
        self.rolled_back_at: set[int] = set()

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        tc = self.tc
        point = self._resume()
        if point.source != "start":
            notice(point.describe(), self.env.is_main)
        # A fresh run of a pretrained model starts from its weights; a LoRA run's checkpoints hold only its
        # adapters, so its frozen base is read again on every attempt.
        if self.config.model.pretrained is not None and (point.source == "start" or self.config.lora.rank):
            path = Path(self.config.model.pretrained)
            seconds = load_pretrained(self.model, self.args, path)
            notice(f"started from the pretrained checkpoint {path} ({seconds:.1f} s)", self.env.is_main)
            self._emit("pretrained_loaded", seconds=round(seconds, 3), path=str(path))
            if self.config.lora.quantize_base:  # QLoRA: the frozen weights of the adapted layers to NF4
                count = quantize_base(self.model)
                notice(f"QLoRA: {count:,} frozen weights quantized to 4-bit NF4", self.env.is_main)
        step = point.step
        self.progress = ProgressLine(tc.max_steps, step, enabled=self.env.is_main)
        if step == 0:
            notice("evaluating at step 0", self.env.is_main)
            self._evaluate(0)
        end_step = tc.halt_at_step or tc.max_steps
        self._emit("training_started", step=step)
        PREEMPTION.training = True  # from here a SIGTERM stops the ranks at a step boundary, with a save
        with self.progress:
            while step < end_step:
                step += 1
                t0 = time.perf_counter()
                record = self._step(step)
                if record is None:  # rolled back to a checkpoint
                    step = self.state["step"]
                    continue
                step_seconds = record["step_seconds"] = time.perf_counter() - t0
                self.heartbeat.step_done(step, step_seconds)
                self.rank_sink.write(
                    {
                        "step": step,
                        "rank": self.env.rank,
                        "node": self.node,
                        "step_seconds": step_seconds,
                        "compute_seconds": record["compute_seconds"],
                        "data_seconds": record.pop("data_seconds"),
                    }
                )
                tps = self.tokens_per_step / step_seconds
                record.update(
                    tokens_per_sec=tps,
                    **self._device_rates(tps),
                    peak_mem_gib=peak_memory_gib(self.env.device),
                    tokens_seen=step * self.tokens_per_step,
                    **self._tokens_by_source(),
                )
                if step % tc.eval_interval == 0 or step == tc.max_steps:
                    record.update(self._evaluate(step))
                if self.stragglers.due(step):
                    self._check_stragglers(step)
                self.sink.write(record)
                self.progress.update(step, record["loss"], tps, self.state.get("val_loss"), last=step == end_step)
                self.background_eval.step_done(step_seconds)  # before the save, which may start an evaluation
                if step % self.config.checkpoint.interval == 0 or step == end_step:
                    self.saves.save(step, self._trainer_state(), final=step == end_step)
                else:
                    self.saves.publish()  # an async save, once written
                if self.snapshots.due(step):
                    self._snapshot(step, step_seconds)
                if self.state.get("stop_requested"):  # agreed in the step's all-reduce: all ranks stop here
                    self._stop_preempted(step)
            self._finish_background_eval(step)
        self.snapshots.close()
        self.heartbeat.beat("done", step)
        self.sink.close()
        self.rank_sink.close()
        return self._summary(max(step, self.state.get("resumed_step", 0)))

    def _step(self, step: int) -> dict[str, Any] | None:
        """One optimizer step (train/step.py); None if the numerics guard rolled the run back instead."""
        lr = lr_at(step, self.tc)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.heartbeat.beat("data", step)
        self.clock.reset()
        t_data = time.perf_counter()
        with self.clock.measure(host=True):
            micro_batches = self.loader.next_batch()
        data_seconds = time.perf_counter() - t_data
        trained_share = sft_loss_scale(micro_batches, self.env.device)
        hooks = SupervisedStep(self, step)
        if self.expert_balance is not None:  # the schedule divides a pipeline's gradients by its micro-batches
            self.expert_balance.start_step(1 if self.pipeline is not None else len(micro_batches))
        train_step(
            self.model,
            self.optimizer,
            self.params,
            micro_batches,
            device=self.env.device,
            grad_clip=self.tc.grad_clip,
            autocast=self.autocast,
            split=self.split,
            measure=self.clock.measure,
            pipeline=self.pipeline,
            pp_group=self.pp_group,
            hooks=hooks,
            trained_share=trained_share,
        )
        if hooks.rolled_back:
            return None
        self.state["train_loss"] = hooks.train_loss
        return {
            "step": step,
            "loss": hooks.train_loss,
            "lr": lr,
            "grad_norm": hooks.grad_norm,
            "compute_seconds": hooks.compute_seconds,
            "data_seconds": data_seconds,
            **({"skipped": hooks.anomaly} if hooks.anomaly else {}),
            **(self.expert_balance.finish_step() if self.expert_balance is not None else {}),
        }

    # -- evaluation, checkpoints, recovery -----------------------------------------------------------
    def _evaluate(self, step: int) -> dict[str, Any]:
        self.heartbeat.beat("eval", step)
        t0 = time.perf_counter()
        val_loss = self.evaluator.loss(self.model)
        seconds = time.perf_counter() - t0
        self.state["val_loss"] = val_loss
        if step == 0:
            self.state["val_loss_start"] = val_loss
            self.sink.write({"step": 0, "val_loss": val_loss, "eval_seconds": seconds})
            notice(f"step 0: val loss {val_loss:.4f}", self.env.is_main)
        else:
            self.progress.log(f"step {step}: train loss {self.state['train_loss']:.4f}, val loss {val_loss:.4f}")
        if self.samples is not None:  # a fine-tune: what it now answers (train/sample_replies.py)
            for prompt, reply in self.samples.replies(self.model, self.autocast):
                self._emit("sample_reply", step=step, prompt=prompt, reply=reply)
        return {"val_loss": val_loss, "eval_seconds": seconds}

    def _finish_background_eval(self, step: int) -> None:
        """eval.tasks: rank 0 waits for the last checkpoint's evaluation. The other ranks wait with it in
        a small all-reduce every few seconds, each beating its heartbeat (eval) between, rather than
        sitting silent in the closing barrier, where the watchdog would take them for hung."""
        if not self.config.eval.tasks:
            return
        while True:
            self.heartbeat.beat("eval", step)
            busy = self.background_eval.wait() if self.env.is_main else False
            if not all_reduce_sum(torch.tensor([float(busy)], device=self.env.device)).item():
                return

    def _trainer_state(self) -> dict[str, Any]:
        """What a resume needs besides model, optimizer and RNG: a disk checkpoint's trainer.json and an
        in-memory snapshot hold this same dict (plus the step), so the two cannot drift apart."""
        return {
            "loader": self.loader.state_dict(),
            "model_args": dataclasses.asdict(self.args),
            "world_size": self.env.world_size,
            "numerics_recent": list(self.guard.recent),
            **{k: self.state.get(k) for k in ("val_loss_start", "val_loss", "train_loss")},
            **self.adapters_record,
        }

    def _snapshot(self, step: int, step_seconds: float) -> None:
        """An in-memory snapshot of `step` (memory_checkpoint.py); under `auto`, the first few measure
        what one costs against the step time, and the interval is chosen and said once."""
        blocked = self.snapshots.take(step, self.model, self.optimizer, self._trainer_state())
        chosen = self.snapshots.measured(blocked, step_seconds, warm=step > self.state.get("resumed_step", 0) + 1)
        if chosen is not None and not self.snapshots.failed:  # (one that failed has said so, and stopped)
            self._emit("memory_snapshot_interval", step=step, **chosen)
            self.progress.log(
                f"in-memory snapshots every {chosen['interval']} step(s): one blocks "
                f"{chosen['snapshot_ms']:.1f} ms, {chosen['percent']:.2f}% of a "
                f"{chosen['step_ms']:.0f} ms step"
            )

    def _say(self, line: str) -> None:
        progress = getattr(self, "progress", None)
        if progress is not None and self.env.is_main:
            progress.log(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def _stop_preempted(self, step: int) -> None:
        """SIGTERM: every rank has finished `step`; save it (unless its interval save already did), say
        how long that took, and stop with exit 143. The node agent kills the ranks after
        safe.preemption_grace_s, so a save slower than that is lost and the run resumes from an older one."""
        self.background_eval.stop()  # the grace period is for the save; nor is the save below scored
        t0 = time.perf_counter()
        self.saves.publish(wait=True)  # an async save still being written
        if not self.saves.saved(step):
            self.saves.save(step, self._trainer_state(), final=True)  # synchronous, with its one retry
        seconds = time.perf_counter() - t0
        saved = self.saves.saved(step)
        self._emit(
            "preempted",
            step=step,
            saved=saved,
            save_seconds=seconds,
            path=self.saves.last_checkpoint,
            grace_s=self.safe.preemption_grace_s,
        )
        if saved:
            self.progress.log(
                f"SIGTERM: stopped after step {step}; checkpoint saved in {seconds:.1f} s "
                f"(grace {self.safe.preemption_grace_s:g} s): {self.saves.last_checkpoint}"
            )
        else:
            self.progress.log(
                f"SIGTERM: stopped after step {step}, but its checkpoint could not be saved; "
                f"the run resumes from {self.saves.last_checkpoint or 'step 0'}"
            )
        self.snapshots.close()
        self.heartbeat.beat("done", step)
        self.sink.close()
        self.rank_sink.close()
        raise PreemptedError(f"preempted after step {step}")

    def _resume(self) -> ResumePoint:
        """Continue from where train/resume.py decides (a snapshot, a checkpoint, or step 0)."""
        point = resume_point(
            self.config,
            self.env,
            self.events,
            self.model,
            self.optimizer,
            self.checkpointer,
            self.snapshots,
            dataclasses.asdict(self.args),
            self.heartbeat,
        )
        self.saves.last_checkpoint = str(point.newest_on_disk) if point.newest_on_disk else None
        if point.source == "start":
            return point
        self.state = point.state
        self.loader.load_state_dict(self.state["loader"])
        self.guard.reset(self.state.get("numerics_recent", []))
        self.state["resumed_step"] = self.state["step"]
        self.snapshots.discard_after(self.state["step"])
        self._emit(
            "checkpoint_loaded",
            step=point.step,
            seconds=point.seconds,
            path=str(point.loaded_from),
            source=point.source,
            **({"disk_step": point.disk_step} if point.source == "memory" else {}),
        )
        return point

    def _rollback(self, step: int) -> bool:
        """Go back to the newest sound state, an in-memory snapshot when one is newer than the newest
        checkpoint on disk, and replay from it, once per step; False means skip the step instead."""
        if self.safe.numerics != "rollback" or step in self.rolled_back_at:
            return False
        self.saves.publish(wait=True)  # the newest save counts too
        self.snapshots.flush()  # the newest snapshot's sidecar, so that it counts
        self.optimizer.zero_grad(set_to_none=True)
        if self._resume().source == "start":  # nothing saved yet to go back to (the rollback says its own line)
            return False
        self.rolled_back_at.add(step)
        self._emit("rollback", step=step, to_step=self.state["step"])
        self.progress.log(f"step {step}: numerics guard rolled back to step {self.state['step']}")
        return True

    def _check_stragglers(self, step: int) -> None:
        self.heartbeat.beat("collective")
        scores = self.stragglers.scores()
        for s in self.stragglers.stragglers(scores):
            self._emit(
                "straggler",
                step=step,
                straggler_rank=s["rank"],
                straggler_node=s["node"],
                score=round(s["score"], 4),
                median_compute_s=s["median_compute_s"],
                fastest_compute_s=min(x["median_compute_s"] for x in scores),
            )
            self.progress.log(f"step {step}: rank {s['rank']} on {s['node']} is a straggler (score {s['score']:.2f})")

    # -- reporting ------------------------------------------------------------------------------
    def _emit(self, kind: str, **details: Any) -> None:
        """Run-level events come from rank 0 only: every rank takes the same decisions."""
        if self.env.is_main:
            self.events.emit(kind, rank=0, **details)

    def _tokens_by_source(self) -> dict[str, Any]:
        """Weighted data.sources: the tokens trained on from each so far; nothing for plain sources."""
        counts = getattr(self.loader, "tokens_by_source", None)
        return {"tokens_by_source": counts} if counts is not None else {}

    def _source_repeated(self, line: str, **details: Any) -> None:
        """A weighted source ran out and starts again (data.mixture_exhausted: repeat): said once."""
        notice(line, self.env.is_main)
        self._emit("data_source_repeated", **details)

    def _device_rates(self, tokens_per_sec: float | None) -> dict[str, float | None]:
        """Achieved TFLOP/s and MFU of one device, from the global token rate."""
        if not tokens_per_sec:
            return {"achieved_tflops": None, "mfu": None}
        per_device = tokens_per_sec / self.env.world_size
        return {"achieved_tflops": achieved_tflops(per_device, self.fpt), "mfu": mfu(per_device, self.fpt, self.peak)}

    def _summary(self, steps_done: int) -> dict[str, Any]:
        summary = {
            "run_dir": str(self.run_dir),
            "steps": steps_done,
            "tokens_seen": steps_done * self.tokens_per_step,
            **self._tokens_by_source(),
            "val_loss_start": self.state.get("val_loss_start"),
            "val_loss_final": self.state.get("val_loss"),
            "train_loss_final": self.state.get("train_loss"),
            # The run's rates over every launch, as every other view shows them (run/throughput.py).
            **run_throughput(read_metrics(self.run_dir), read_events(self.run_dir)),
            "last_checkpoint": self.saves.last_checkpoint,
            "wall_seconds": time.perf_counter() - self.started,
            **({"final_save_failed": self.saves.final_save_failed} if self.saves.final_save_failed else {}),
            "halted": self.tc.halt_at_step is not None and steps_done < self.tc.max_steps,
        }
        summary = json_safe(summary)
        if self.env.is_main:
            RunDir(self.run_dir).summary.write_text(json.dumps(summary, indent=1))
        return summary


class SupervisedStep(StepHooks):
    """How the trainer's supervision reaches one step: heartbeats at each phase, the fault drills, and
    the decision to apply the update, taken on the loss and gradient norm all ranks agree on (one small
    all-reduce, which also carries the preemption flags) by the numerics guard."""

    def __init__(self, trainer: Trainer, step: int):
        self.trainer, self.step = trainer, step
        self.train_loss = self.grad_norm = self.compute_seconds = 0.0
        self.anomaly: str | None = None
        self.rolled_back = False

    def phase(self, name: str) -> None:
        self.trainer.heartbeat.beat(name)

    def first_forward(self) -> None:
        self.trainer.faults.in_forward(self.step)

    def poison_loss(self) -> bool:
        return self.trainer.faults.nan_loss(self.step)

    def apply_update(self, loss_sum: torch.Tensor, parts: int, grad_norm: torch.Tensor) -> bool:
        t = self.trainer
        # Under pp only the last stage's ranks (world / pp of them) hold a loss; the others add zero. The
        # preemption flags ride along (their sum is above 0 if any rank got a SIGTERM): no collective of
        # their own, and one host sync per step.
        reduced = all_reduce_sum(torch.stack([loss_sum, torch.tensor(PREEMPTION.requested, device=loss_sum.device)]))
        loss_sum = reduced[0] / (parts * t.env.world_size // t.layout.pp)
        self.train_loss, self.grad_norm, stops = torch.stack([loss_sum, grad_norm.to(loss_sum), reduced[1]]).tolist()
        t.state["stop_requested"] = stops > 0
        self.compute_seconds = t.clock.seconds()  # after the sync above: the GPU timing events are complete
        t.stragglers.record(self.compute_seconds)
        self.anomaly = t.guard.check(self.train_loss, self.grad_norm) if t.safe.numerics != "none" else None
        if self.anomaly is None:
            t.guard.accept(self.train_loss)
            return True
        t._emit("anomaly", step=self.step, anomaly=self.anomaly, loss=self.train_loss, grad_norm=self.grad_norm)
        if t._rollback(self.step):
            self.rolled_back = True
        else:
            t._emit("step_skipped", step=self.step, anomaly=self.anomaly)
        return False


def attempt_number() -> int:
    """Which attempt of the run this process is (0 first, +1 per restart by the node agent)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
