"""TokenDataset windows and BatchLoader: determinism across rank counts, epochs and resumes."""

import numpy as np
import pytest
import torch

from phalanx.data.loader import BatchLoader, TokenDataset, val_batches
from phalanx.data.shards import ShardWriter
from phalanx.errors import PhalanxError

SEQ = 8


@pytest.fixture
def shards(tmp_path):
    """Two shards of consecutive ids (so a window's content tells where it came from): 0..399, 400..636."""
    with ShardWriter(tmp_path, "train", vocab_size=1000, max_tokens_per_shard=400) as w:
        w.write(np.arange(637))
    return w.paths


def test_windows_overlap_by_one_token_and_never_cross_shards(shards):
    ds = TokenDataset(shards, SEQ)
    assert len(ds) == (400 - 1) // SEQ + (237 - 1) // SEQ == 49 + 29
    windows = [ds.window(i) for i in range(len(ds))]
    for w in windows:
        assert len(w) == SEQ + 1 and np.array_equal(w, np.arange(w[0], w[0] + SEQ + 1))
        assert w[-1] < 400 or w[0] >= 400  # inside one shard
    assert windows[1][0] == windows[0][-1] == SEQ  # stride seq_len: each target becomes the next input
    assert windows[49][0] == 400
    np.testing.assert_array_equal(ds.gather(np.array([50, 3, 50])), np.stack([windows[50], windows[3], windows[50]]))
    with pytest.raises(IndexError):
        ds.window(len(ds))


def test_too_few_tokens_says_how_many_are_needed(tmp_path):
    with ShardWriter(tmp_path, "val", vocab_size=100) as w:
        w.write(np.arange(8))
    with pytest.raises(PhalanxError, match="val data is too small: 8 tokens .* needs 9 tokens"):
        TokenDataset(w.paths, 8, name="val data")
    assert len(TokenDataset(w.paths, 7)) == 1


def global_batches(shards, world, steps, seed=0, global_batch=12, micro=3):
    """Concatenate every rank's micro batches, rank by rank, into (inputs, targets) per step."""
    ds = TokenDataset(shards, SEQ)
    loaders = [BatchLoader(ds, SEQ, global_batch, micro, r, world, seed) for r in range(world)]
    out = []
    for _ in range(steps):
        parts = [mb for loader in loaders for mb in loader.next_batch()]
        assert all(x.shape == (micro, SEQ) and y.shape == (micro, SEQ) for x, y in parts)
        out.append((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
    return out


def test_global_batches_do_not_depend_on_the_number_of_ranks(shards):
    steps = 20  # 20 * 12 = 240 samples: three epochs of 78 windows, with batches straddling epoch ends
    one = global_batches(shards, 1, steps)
    for world in (2, 4):
        for (x1, y1), (xw, yw) in zip(one, global_batches(shards, world, steps), strict=True):
            assert torch.equal(x1, xw) and torch.equal(y1, yw)
    starts = torch.cat([x[:, 0] for x, _ in one])
    epoch0, epoch1 = starts[:78], starts[78:156]
    # each epoch visits every window once
    assert len(set(epoch0.tolist())) == 78 and set(epoch1.tolist()) == set(epoch0.tolist())
    assert not torch.equal(epoch0, epoch1)  # reshuffled
    x, y = one[0]
    assert x.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one


def test_seed_changes_the_order(shards):
    a = global_batches(shards, 1, 3, seed=0)
    b = global_batches(shards, 1, 3, seed=1)
    assert not all(torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b))


def test_resume_from_state_dict_continues_exactly_even_on_another_rank_count(shards):
    ds = TokenDataset(shards, SEQ)
    reference = global_batches(shards, 1, 12, seed=5)
    loader = BatchLoader(ds, SEQ, 12, 3, 0, 1, seed=5)
    for _ in range(7):
        loader.next_batch()
    state = loader.state_dict()
    assert state["samples_seen"] == 84 and state["seed"] == 5
    resumed = [BatchLoader(ds, SEQ, 12, 3, r, 2, seed=5) for r in range(2)]
    for r in resumed:
        r.load_state_dict(dict(state))
    for step in range(7, 12):
        parts = [mb for r in resumed for mb in r.next_batch()]
        assert torch.equal(torch.cat([x for x, _ in parts]), reference[step][0])
    with pytest.raises(PhalanxError, match="checkpoint has seed=5, this run has 6"):
        BatchLoader(ds, SEQ, 12, 3, 0, 1, seed=6).load_state_dict(state)
    with pytest.raises(PhalanxError, match="dataset_len"):
        BatchLoader(TokenDataset(shards[:1], SEQ), SEQ, 12, 3, 0, 1, seed=5).load_state_dict(state)


def test_batch_size_must_divide_across_ranks_and_micro_batches(shards):
    ds = TokenDataset(shards, SEQ)
    with pytest.raises(PhalanxError) as e:
        BatchLoader(ds, SEQ, global_batch_size=12, micro_batch_size=2, dp_rank=0, dp_world=4, seed=0)
    message = str(e.value)
    assert "train.global_batch_size (12)" in message and "train.micro_batch_size (2)" in message
    assert "4 data-parallel ranks" in message
    loader = BatchLoader(ds, SEQ, global_batch_size=16, micro_batch_size=2, dp_rank=3, dp_world=4, seed=0)
    assert loader.accum_steps == 2 and len(loader.next_batch()) == 2


def rows(batches):
    return sorted(tuple(row) for x, _ in batches for row in x.tolist())


def test_val_batches_cover_the_same_windows_for_any_rank_count(shards):
    ds = TokenDataset(shards, SEQ)
    single = val_batches(ds, SEQ, micro_batch_size=4, max_batches=5, dp_rank=0, dp_world=1)
    assert len(single) == 5 and rows(single) == rows([(torch.from_numpy(ds.gather(np.arange(20)))[:, :-1], None)])
    for world in (2, 3):
        per_rank = [val_batches(ds, SEQ, 4, 5, r, world) for r in range(world)]
        assert rows([b for batches in per_rank for b in batches]) == rows(single)
    assert [len(val_batches(ds, SEQ, 4, 5, r, 2)) for r in range(2)] == [3, 2]  # unequal counts are fine
    everything = val_batches(ds, SEQ, 4, max_batches=100, dp_rank=0, dp_world=1)
    assert sum(len(x) for x, _ in everything) == len(ds) and len(everything[-1][0]) == len(ds) % 4
