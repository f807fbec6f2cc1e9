"""Weighted data.sources: shares by weight, the same global batches on any rank count, exact resumes,
a source that runs out (repeated or stopping the run), bad weights refused, and a mixed run through the CLI."""

import json

import numpy as np
import pytest

from phalanx.config.loader import load_config
from phalanx.data.mixture import MixtureLoader
from phalanx.data.mixture_sources import mixture_sources, source_names
from phalanx.data.prepare import prepare_data
from phalanx.data.shards import ShardWriter, VerifiedShard, read_shard
from phalanx.data.source_windows import SourceWindows
from phalanx.errors import PhalanxError
from tests.conftest import TINY
from tests.helpers import losses_by_step, phalanx, read_metrics, train_json

SEQ = 8
BIG, SMALL = 3000, 1000  # tokens of each source: consecutive ids, so a window's first id tells its source


@pytest.fixture
def sources(tmp_path):
    """Source "big" holds ids 0..2999, "small" 3000..3999, in shards of 1,500 tokens (one boundary inside
    each source's range, one between them)."""
    with ShardWriter(tmp_path, "train", vocab_size=5000, max_tokens_per_shard=1500) as w:
        w.write(np.arange(BIG + SMALL))
    shards = [VerifiedShard(p) for p in w.paths]
    return [SourceWindows(shards, [(0, BIG)], SEQ, "big"), SourceWindows(shards, [(BIG, BIG + SMALL)], SEQ, "small")]


def loader(sources, dp_rank=0, dp_world=1, weights=(0.7, 0.3), **kw):
    kw = {"global_batch_size": 8, "micro_batch_size": 8 // dp_world, "seed": 3, **kw}
    return MixtureLoader(sources, weights, SEQ, dp_rank=dp_rank, dp_world=dp_world, **kw)


def rows(batch):
    """The (inputs, targets) micro batches of one rank as one array of whole windows."""
    return np.concatenate([np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1) for x, y in batch])


def test_windows_stay_inside_their_source_and_shard(sources):
    big, small = sources
    assert (len(big), len(small)) == (2 * ((1500 - 1) // SEQ), (SMALL - 1) // SEQ)
    for source, lo, hi in ((big, 0, BIG), (small, BIG, BIG + SMALL)):
        windows = source.gather(np.arange(len(source)))
        assert np.array_equal(windows, windows[:, :1] + np.arange(SEQ + 1))  # contiguous tokens
        assert windows.min() >= lo and windows.max() < hi
        assert not ((windows[:, 0] < 1500) & (windows[:, -1] >= 1500)).any()  # never across a shard boundary


def test_token_shares_follow_the_weights_over_1000_steps(sources):
    mix = loader(sources)
    seen = {"big": 0, "small": 0}
    for _ in range(1000):
        firsts = rows(mix.next_batch())[:, 0]
        seen["big"] += int((firsts < BIG).sum()) * SEQ
        seen["small"] += int((firsts >= BIG).sum()) * SEQ
    total = 1000 * 8 * SEQ
    assert mix.tokens_by_source == seen and sum(seen.values()) == total
    assert abs(seen["big"] / total - 0.7) < 0.01 and abs(seen["small"] / total - 0.3) < 0.01
    assert abs(seen["small"] / SEQ - 0.3 * 8000) <= 1  # largest remainder: within a window of exact
    # the small source (124 windows) ran out and repeated: 2,400 windows is its 20th epoch
    assert mix.epochs_by_source == {"big": 1 + (5600 - 1) // len(sources[0]), "small": 1 + (2400 - 1) // 124}


def test_the_same_global_batches_on_one_and_two_ranks(sources):
    one = loader(sources)
    two = [loader(sources, dp_rank=r, dp_world=2) for r in range(2)]
    for _ in range(60):  # past the small source's first epoch
        whole = rows(one.next_batch())
        assert np.array_equal(np.concatenate([rows(rank.next_batch()) for rank in two]), whole)
    assert one.tokens_by_source == two[0].tokens_by_source == two[1].tokens_by_source


def test_resumes_exactly_from_its_state_and_refuses_other_weights(sources):
    whole = loader(sources)
    expected = [rows(whole.next_batch()) for _ in range(40)]
    first = loader(sources)
    for _ in range(25):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps survives JSON
    resumed = loader(sources, dp_rank=1, dp_world=2, micro_batch_size=2)  # another rank count and micro batch
    resumed.load_state_dict(state)
    for step in range(25, 40):
        assert np.array_equal(rows(resumed.next_batch()), expected[step][4:])
    with pytest.raises(PhalanxError, match="checkpoint has weights=.0.7, 0.3., this run has .0.5, 0.5."):
        loader(sources, weights=(0.5, 0.5)).load_state_dict(state)
    with pytest.raises(PhalanxError, match="without weighted data.sources"):
        loader(sources).load_state_dict({"samples_seen": 8, "seed": 3, "dataset_len": 10, "seq_len": SEQ})


def test_a_source_that_runs_out_repeats_and_counts_its_epoch(sources):
    said = []
    mix = loader(sources, on_repeat=lambda line, **details: said.append((line, details)))
    steps_in_first_epoch = 124 * 10 // (8 * 3)  # the small source gets 3 of every 10 windows
    for _ in range(steps_in_first_epoch + 2):
        mix.next_batch()
    assert len(said) == 1  # once, when its epoch 2 begins
    line, details = said[0]
    assert details == {"source": "small", "epoch": 2} and "\n" not in line
    assert "data source small ran out: its 124 windows (992 tokens) are all used; repeating it" in line
    assert mix.epochs_by_source == {"big": 1, "small": 2}


def test_a_source_that_runs_out_stops_the_run_under_stop(sources):
    mix = loader(sources, exhausted="stop")
    with pytest.raises(PhalanxError) as stopped:
        for _ in range(100):
            mix.next_batch()
    message = str(stopped.value)
    assert "\n" not in message and message.startswith("data source small ran out: its 124 windows")
    assert "data.mixture_exhausted=stop" in message
    assert mix.drawn[1] == 124  # every window of its first epoch trained on, none twice


def test_zero_weight_is_never_drawn(sources):
    mix = loader(sources, weights=(1, 0))
    for _ in range(10):
        assert (rows(mix.next_batch())[:, 0] < BIG).all()


def test_source_names_are_short_and_distinct():
    assert source_names(["/d/slim", "/d/star/", "builtin:shakespeare"]) == ["slim", "star", "builtin:shakespeare"]
    assert source_names(["/d/a/x.txt", "/d/b/x.txt"]) == ["a/x.txt", "b/x.txt"]
    assert source_names(["/d/crawl/*.jsonl"]) == ["*.jsonl"]


def write_docs(dir, count, words, seed):
    rng = np.random.default_rng(seed)
    dir.mkdir(parents=True)
    vocabulary = "the king and queen of verona speak softly to a ghost while night falls".split()
    for i in range(count):
        (dir / f"doc{i}.txt").write_text(" ".join(rng.choice(vocabulary, words)) + "\n")


def test_preparation_keeps_each_sources_tokens_apart(tmp_path):
    write_docs(tmp_path / "a_big", 5, 300, seed=2)
    write_docs(tmp_path / "b_small", 2, 300, seed=1)
    entries = [str(tmp_path / "b_small"), str(tmp_path / "a_big")]  # listed in the other order than sorted
    args = dict(base_dir=tmp_path, cache_root=tmp_path / "cache", vocab_size=300, tokenizer=None, val_fraction=0.1)
    data = prepare_data(entries, **args)
    small, big = mixture_sources(data, entries, SEQ)
    assert (small.name, big.name) == ("b_small", "a_big")
    train = np.concatenate([read_shard(p) for p in data.train_shards])
    assert big.tokens + small.tokens == len(train) == data.train_tokens
    assert big.tokens > 2 * small.tokens
    # files lie in sorted order: a_big's five first, so the big source is the stream's head, small its tail
    assert len(data.file_tokens) == 7 and sum(t for t, _ in data.file_tokens[:5]) == big.tokens
    assert np.array_equal(big.gather([0])[0], train[: SEQ + 1])
    assert np.array_equal(small.gather([0])[0], train[big.tokens : big.tokens + SEQ + 1])
    assert train[big.tokens] == 0  # a document's BOS: the small source starts at its first document
    # the same files grouped otherwise reuse the tokens, with their own grouping
    again = prepare_data([str(tmp_path / "a_big/doc0.txt"), *entries], **args)
    assert again.dir == data.dir
    one, small_again, big_rest = mixture_sources(again, [str(tmp_path / "a_big/doc0.txt"), *entries], SEQ)
    assert one.tokens + big_rest.tokens == big.tokens and small_again.tokens == small.tokens
    with pytest.raises(PhalanxError, match="does not say which source each token came from"):
        mixture_sources(data, [str(tmp_path)], SEQ)  # a list of entries never prepared


@pytest.fixture
def two_corpora(corpus, tmp_path):
    """The test corpus cut into two sources of different sizes: the first 70% of its text and the rest."""
    text = corpus.read_text()
    cut = int(len(text) * 0.7)
    (tmp_path / "plays_a.txt").write_text(text[:cut])
    (tmp_path / "plays_b.txt").write_text(text[cut:])
    return tmp_path / "plays_a.txt", tmp_path / "plays_b.txt"


def mixed_args(two_corpora, runs_root, name):
    a, b = two_corpora
    sources = f"data.sources=[{{path: {a}, weight: 0.25}}, {{path: {b}, weight: 0.75}}]"
    return [*TINY, sources, "train.max_steps=8", f"run.dir={runs_root}", f"run.name={name}"]


def test_a_mixed_run_halted_and_resumed_matches_an_uninterrupted_one(two_corpora, runs_root):
    whole = train_json(*mixed_args(two_corpora, runs_root, "mix-whole"))
    halted = mixed_args(two_corpora, runs_root, "mix-halted")
    assert train_json(*halted, "train.halt_at_step=4")["steps"] == 4
    resumed = train_json(*halted)
    assert losses_by_step(whole["run_dir"]) == losses_by_step(resumed["run_dir"])
    per_step = 8 * 32  # TINY: global batch 8 of seq_len 32
    assert whole["tokens_by_source"] == resumed["tokens_by_source"] == {"plays_a.txt": 512, "plays_b.txt": 1536}
    assert sum(whole["tokens_by_source"].values()) == whole["tokens_seen"] == 8 * per_step
    steps = [m for m in read_metrics(resumed["run_dir"]) if "loss" in m]
    assert [sum(m["tokens_by_source"].values()) for m in steps] == [m["step"] * per_step for m in steps]


@pytest.mark.slow
def test_a_mixed_run_on_two_ranks_matches_one_process(two_corpora, runs_root):
    one = train_json(*mixed_args(two_corpora, runs_root, "mix-one"))
    two = train_json(*mixed_args(two_corpora, runs_root, "mix-two"), "--nproc", "2")
    a, b = losses_by_step(one["run_dir"]), losses_by_step(two["run_dir"])
    assert a.keys() == b.keys() == set(range(1, 9))
    for step in a:  # the same global batches; only the float reduction order differs
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-5)
    assert one["tokens_by_source"] == two["tokens_by_source"]


@pytest.mark.parametrize(
    "sources, says",
    [
        (
            "[{path: A, weight: -0.5}, {path: B, weight: 1}]",
            "data source .*A has weight -0.5: weights must be 0 or more",
        ),
        ("[{path: A, weight: 0}, {path: B, weight: 0}]", "data.sources weights add up to 0"),
        ("[{path: A, weight: 0.5}, {path: B, wieght: 0.5}]", "unknown key 'wieght' .* did you mean 'weight'"),
        ("[{path: A, weight: 0.5}, B]", "data.sources: give every source a weight"),
    ],
)
def test_bad_weights_are_refused_in_one_line(sources, says):
    with pytest.raises(PhalanxError, match=f"^invalid config: {says}") as refused:
        load_config(overrides=[f"data.sources={sources}"])
    assert "\n" not in str(refused.value)


def test_a_weight_for_a_source_that_is_not_there_is_refused(two_corpora, tmp_path):
    with pytest.raises(PhalanxError, match="data.weights has 3 weights for 2 data.sources: one per source"):
        load_config(overrides=["data.sources=[a, b]", "data.weights=[0.5, 0.3, 0.2]"])
    a, _ = two_corpora
    config = load_config(overrides=[f"data.sources=[{{path: {a}, weight: 0.7}}, {{path: missing.txt, weight: 0.3}}]"])
    with pytest.raises(PhalanxError, match="data source .*missing.txt.* not found"):
        prepare_data(config.data.sources, tmp_path, tmp_path / "cache", 300, None, 0.1)


def test_the_cli_refuses_bad_weights_with_one_line_and_exit_2(two_corpora, runs_root):
    a, b = two_corpora
    sources = f"data.sources=[{{path: {a}, weight: -1}}, {{path: {b}, weight: 1}}]"
    proc = phalanx("train", *TINY, sources, f"run.dir={runs_root}", "run.name=bad-weights", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: invalid config: data source {a} has weight -1.0: weights must be 0 or more"
    ]
