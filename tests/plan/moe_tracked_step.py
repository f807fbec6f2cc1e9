"""One real FSDP training step of a preset on this rank, under torch's FSDPMemTracker (real tensors, gloo):
the peak by the planner's categories, written to OUT/rank<R>.json. Run by tests/plan/test_plan_moe.py
under torch's launcher: `python -m torch.distributed.run --nproc-per-node 2 tests/plan/moe_tracked_step.py
PRESET MICRO_BATCH SEQ_LEN OUT`.

Why not phalanx/plan/measure.py's profiler count: after an FSDP step of a mixture of experts, the
parallelised model stays referenced (by a tuple of FSDP's state) after `del` and gc, so its sharded
parameters' allocations show no free and the measurer drops them as build-time garbage: it reads
about the parameters' bytes low. The tracker counts what is live, by kind."""

import gc
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from phalanx.config.schema import ModelSection, TrainSection
from phalanx.models.decoder import Transformer
from phalanx.models.from_config import model_args
from phalanx.parallel.apply import parallelize
from phalanx.parallel.distributed import init_distributed, teardown
from phalanx.plan.traced import _by_category
from phalanx.train.optim import build_optimizer


def main(preset: str, micro_batch: int, seq_len: int, out: Path) -> None:
    env = init_distributed("fsdp", "gloo", "cpu")
    args = model_args(ModelSection(preset=preset), seq_len=seq_len)
    torch.manual_seed(0)
    model = parallelize(
        Transformer(args), "fsdp", env, activation_checkpointing=False, compile=False, dtype=torch.float32
    )
    train = TrainSection(seq_len=seq_len, micro_batch_size=micro_batch, global_batch_size=micro_batch * env.world_size)
    optimizer = build_optimizer(model, train)
    params = list(model.parameters())
    for p in params:  # the steady state: AdamW's moments exist
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tracker = FSDPMemTracker(model, optimizer)
    with tracker:
        tokens = torch.randint(
            0, args.vocab_size, (micro_batch, seq_len + 1), generator=torch.Generator().manual_seed(env.rank)
        )
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        peak = _by_category(tracker.get_tracker_snapshot("peak"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{env.rank}.json").write_text(json.dumps({"through_backward": sum(peak.values()), "at_peak": peak}))
    del model, optimizer, params, logits, loss
    gc.collect()
    teardown(True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
