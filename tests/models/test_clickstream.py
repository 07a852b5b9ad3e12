"""nbtools.models.clickstream: the made-up click stream, item2vec on it, and the topic measure.

References: the stream's law is checked against the power law it claims (slope and head share,
computed here from the formula, not the code), the loss against the same sum written with
``F.embedding`` on the table's weights, the topic measure against tables built to score 1 and
chance, and training against chance.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import nbtools
from nbtools.models.clickstream import ClickStream, Item2Vec, fit_stream, topic_recovery


def test_ranks_and_ids_are_a_bijection():
    stream = ClickStream(10_007, 4, topics=8)
    ids = stream.ids_of(torch.arange(10_007))
    assert torch.equal(ids.sort().values, torch.arange(10_007))
    assert torch.equal(stream.rank_of(ids), torch.arange(10_007))
    # hot rows are spread over the table, not packed at its start
    hot = stream.hottest(100)
    assert hot.max() - hot.min() > 10_007 // 2


def test_a_size_the_first_multiplier_divides_takes_another():
    n = 2 * 1_000_000_007                   # < 2**31, divisible by the first prime
    stream = ClickStream(n, 4)
    ranks = torch.tensor([0, 1, 12_345, n - 1])
    ids = stream.ids_of(ranks)
    assert len(set(ids.tolist())) == 4 and bool((ids < n).all())
    assert torch.equal(stream.rank_of(ids), ranks)


def test_batches_are_in_range_deterministic_and_topical():
    stream = ClickStream(1_003, 512, topics=10, seed=3)   # 1,003 = 100 * 10 + 3: the shift
    b = stream.batch(7)
    assert b.shape == (3, 512) and b.dtype == torch.int64
    assert bool((b >= 0).all() and (b < 1_003).all())
    assert torch.equal(b, stream.batch(7))
    assert not torch.equal(b, stream.batch(8))
    assert not torch.equal(b, ClickStream(1_003, 512, topics=10, seed=4).batch(7))
    topic = stream.topic_of(b)
    assert torch.equal(topic[0], topic[1])                  # positives: the anchor's topic
    many = torch.cat([stream.batch(t) for t in range(20)], 1)
    same = (stream.topic_of(many[0]) == stream.topic_of(many[2])).double().mean().item()
    assert abs(same - 0.1) < 0.04          # negatives ignore topics; popular topics weigh more
    assert next(iter(stream)).shape == (3, 512)


def test_popularity_follows_the_power_law():
    n, a = 100_000, 1.1
    stream = ClickStream(n, 100_000, exponent=a, seed=1)
    ranks = stream.rank_of(torch.cat([stream.batch(t)[0] for t in range(10)]))
    counts = torch.bincount(ranks, minlength=n).double()
    # the tail: log-frequency against log-rank has slope -a (ranks 20..2000, binned)
    edges = torch.logspace(math.log10(20), math.log10(2000), 9).long()
    x = [math.log((lo + hi) / 2) for lo, hi in zip(edges[:-1], edges[1:])]
    y = [math.log(counts[lo:hi].mean().item()) for lo, hi in zip(edges[:-1], edges[1:])]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    slope = sum((u - mx) * (v - my) for u, v in zip(x, y)) / sum((u - mx) ** 2 for u in x)
    assert abs(slope + a) < 0.08, slope
    # the head's share: the integral of x**-a over [1, k + 1) against [1, n + 1)
    k = 100
    want = ((k + 1) ** (1 - a) - 1) / ((n + 1) ** (1 - a) - 1)
    got = counts[:k].sum().item() / counts.sum().item()
    assert abs(got - want) < 0.01 and abs(stream.click_share(k) - want) < 1e-12


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_items=1, batch_size=4), "num_items"),
    (dict(num_items=100, batch_size=0), "batch_size"),
    (dict(num_items=100, batch_size=4, topics=1), "topics"),
    (dict(num_items=10, batch_size=4, topics=11), "topics=11 exceeds"),
    (dict(num_items=100, batch_size=4, exponent=1.0), "exponent"),
    (dict(num_items=3 << 30, batch_size=4), "more than"),
])
def test_bad_arguments_say_what_was_passed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClickStream(**kwargs)


def test_loss_matches_the_sum_written_out():
    torch.manual_seed(0)
    table = nbtools.OffloadedEmbedding(50, 6, device="cpu")
    model = Item2Vec(table)
    batch = ClickStream(50, 9, topics=5).batch(0)
    with torch.no_grad():
        got = model.loss(batch)
        w = table.weight.clone()
    a, p, n = F.embedding(batch, w)
    want = -(F.logsigmoid((a * p).sum(-1) / math.sqrt(6))
             + F.logsigmoid(-(a * n).sum(-1) / math.sqrt(6))).mean()
    assert torch.allclose(got, want, atol=1e-6)


def test_topic_recovery_against_tables_built_to_know():
    stream = ClickStream(400, 4, topics=4)
    ids = torch.arange(400)
    known = nbtools.OffloadedEmbedding(400, 4, device="cpu")
    with torch.no_grad():                  # each row: its topic's axis, a little noise
        known.weight.copy_(F.one_hot(stream.topic_of(ids), 4).float()
                           + 0.01 * torch.randn(400, 4))
    r = topic_recovery(known, stream, items=200)
    assert r.topic_match == 1.0 and r.items == 200 and r.start_rank == 0
    # chance: sum over topics of c (c - 1) / (n (n - 1)) for the 200 hottest items
    c = torch.bincount(stream.topic_of(stream.hottest(200)), minlength=4).double()
    assert r.chance == pytest.approx(float((c * (c - 1)).sum() / (200 * 199)))
    torch.manual_seed(0)
    blind = nbtools.OffloadedEmbedding(400, 64, device="cpu")
    assert topic_recovery(blind, stream, items=400).topic_match < 0.45     # chance ~0.25
    assert "popularity ranks 100-149" in str(topic_recovery(known, stream, 50, start_rank=100))
    with pytest.raises(ValueError, match="at least 2 items"):
        topic_recovery(known, stream, items=5, start_rank=399)


@pytest.mark.parametrize("placement", ["host", "disk"])
def test_fit_stream_learns_the_topics(tmp_path, placement):
    torch.manual_seed(0)
    stream = ClickStream(2_000, 256, topics=4, seed=0)
    extra = dict(disk_dir=str(tmp_path), host_cache_bytes=300 * 64 * 4) if placement == "disk" \
        else {}
    table = nbtools.OffloadedEmbedding(2_000, 32, device="cpu", placement=placement, **extra)
    opt = nbtools.OffloadOptimizer(nbtools.RowWiseAdagrad, table, lr=0.5)
    before = topic_recovery(table, stream, items=200)
    history = fit_stream(Item2Vec(table), stream, opt, 60, log_every=15)
    assert history["step"] == [15, 30, 45, 60]
    assert history["loss"][-1] < history["loss"][0] - 0.2
    # (a negative shares the anchor's topic 1 time in 4: 87.5% is the most to expect)
    assert history["pair_accuracy"][-1] > max(0.78, history["pair_accuracy"][0] + 0.1)
    after = topic_recovery(table, stream, items=200)
    assert before.topic_match < 0.5 and after.topic_match > 0.9, (before, after)
    assert history["pairs_per_s"] > 0 and len(history["time_s"]) == 4
    if placement == "disk":     # the read-ahead was used, and the hit rate is the cache's
        assert table.disk.stats["read_ahead"] > 0
        assert all(0 < h < 1 for h in history["ram_hit_rate"])
    else:
        assert history["ram_hit_rate"] == [None] * 4
    table.close()


def test_fit_stream_without_read_ahead_and_its_errors(tmp_path):
    stream = ClickStream(500, 16, topics=4)
    table = nbtools.OffloadedEmbedding(500, 8, device="cpu", placement="disk",
                                       disk_dir=str(tmp_path), host_cache_bytes=100 * 8 * 4)
    opt = nbtools.OffloadOptimizer(torch.optim.SGD, table, lr=0.1)
    history = fit_stream(Item2Vec(table), stream, opt, 3, read_ahead=False)
    assert history["step"] == [1, 2, 3] and table.disk.stats["read_ahead"] == 0
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        fit_stream(Item2Vec(table), stream, opt, 0)
    table.close()


def test_fit_stream_trains_the_same_at_every_read_ahead_depth(tmp_path):
    """Reading 0, 1, 2 or 3 steps ahead (True) moves rows only: the same weights, bit for bit,
    as the same table in host RAM; a bad depth is refused."""
    def train(placement, read_ahead):
        torch.manual_seed(0)
        stream = ClickStream(400, 48, topics=4, seed=1)
        extra = dict(disk_dir=str(tmp_path), host_cache_bytes=90 * 16 * 4 * 2) \
            if placement == "disk" else {}
        table = nbtools.OffloadedEmbedding(400, 16, device="cpu", placement=placement, **extra)
        opt = nbtools.OffloadOptimizer(torch.optim.Adam, table, lr=0.05)
        fit_stream(Item2Vec(table), stream, opt, 9, log_every=9, read_ahead=read_ahead)
        w, ahead = table.weight.detach().clone(), getattr(table, "disk", None)
        ahead = ahead.stats["read_ahead"] if ahead is not None else None
        table.close()
        return w, ahead
    host, _ = train("host", False)
    assert torch.equal(train("host", True)[0], host)      # (a RAM table prefetches one step)
    for depth in (0, 1, 2, True):
        w, ahead = train("disk", depth)
        assert torch.equal(w, host), depth
        assert (ahead > 0) == bool(depth), (depth, ahead)
    stream = ClickStream(50, 4, topics=2)
    table = nbtools.OffloadedEmbedding(50, 4, device="cpu")
    opt = nbtools.OffloadOptimizer(torch.optim.SGD, table, lr=0.1)
    with pytest.raises(ValueError, match="read_ahead must be a bool or a number of steps"):
        fit_stream(Item2Vec(table), stream, opt, 2, read_ahead=-1)
    table.close()


@pytest.mark.parametrize("read_ahead", [True, False])
def test_the_hit_rate_counts_every_row_read_from_disk(tmp_path, read_ahead):
    """A RAM cache that holds the whole table reads each row once, by the lookup or by the
    read-ahead: the hit rate over the run is 1 - distinct rows / rows looked up."""
    stream = ClickStream(300, 32, topics=4)
    table = nbtools.OffloadedEmbedding(300, 8, device="cpu", placement="disk",
                                       disk_dir=str(tmp_path), host_cache_bytes=600 * 8 * 4)
    opt = nbtools.OffloadOptimizer(torch.optim.SGD, table, lr=0.1)
    history = fit_stream(Item2Vec(table), stream, opt, 12, log_every=12, read_ahead=read_ahead,
                         warm=False)                 # (warmed, it would read them all first)
    batches = [stream.batch(t) for t in range(12)]
    distinct = len(torch.cat([b.flatten() for b in batches]).unique())
    looked = sum(len(b.unique()) for b in batches)
    assert history["ram_hit_rate"] == [pytest.approx(1 - distinct / looked)]
    table.close()


def test_shares_are_the_draws_frequencies_in_id_order():
    stream = ClickStream(1_000, 64, topics=8, seed=3)
    shares = stream.shares()
    assert shares.dtype == torch.float32 and shares.shape == (1_000,)
    assert abs(float(shares.double().sum()) - 1) < 1e-6
    ranks = stream._ranks(torch.Generator().manual_seed(0), 1_000_000)
    seen = torch.bincount(stream.ids_of(ranks), minlength=1_000).double() / 1e6
    assert (seen - shares.double()).abs().max() < 2e-3          # (sd of the top share: 3.4e-4)
    assert shares.topk(5).indices.tolist() == stream.hottest(5).tolist()
    assert abs(float(shares[stream.hottest(100)].sum()) - stream.click_share(100)) < 1e-5
    k = stream.head(0.8)                                # the head: 80% of the draws, no fewer
    assert stream.click_share(k) >= 0.8 > stream.click_share(k - 1)
    head = stream.shares(0.8)
    assert (head > 0).sum() == k and torch.equal(head[stream.hottest(k)], shares[stream.hottest(k)])
    with pytest.raises(ValueError, match="share must be in"):
        stream.head(0)


def test_fit_stream_warms_a_disk_tables_ram_with_the_hottest_items(tmp_path):
    """Warmed, the first steps find the stream's hottest items in RAM: a higher hit rate from
    the first step than starting cold, and the same training, bit for bit."""
    def run(warm):
        torch.manual_seed(0)
        stream = ClickStream(20_000, 128, topics=4, seed=2)
        table = nbtools.OffloadedEmbedding(20_000, 8, device="cpu", placement="disk",
                                           disk_dir=str(tmp_path), host_cache_bytes=2_000 * 64)
        opt = nbtools.OffloadOptimizer(torch.optim.SGD, table, lr=0.1)
        history = fit_stream(Item2Vec(table), stream, opt, 4, log_every=1, read_ahead=False,
                             warm=warm)
        w = table.weight.detach().clone()
        table.close()
        return history, w
    (warmed, w_warm), (cold, w_cold) = run(True), run(False)
    assert torch.equal(w_warm, w_cold)
    assert warmed["ram_hit_rate"][0] > cold["ram_hit_rate"][0] + 0.3, (warmed, cold)
    assert warmed["warm_s"] > 0 and cold["warm_s"] < warmed["warm_s"]
