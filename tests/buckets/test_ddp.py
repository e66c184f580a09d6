"""``search.batching: buckets`` with 2 DDP ranks (gloo on CPU), in a subprocess with a timeout (no hang).

Every rank runs the same number of batches each epoch, the ranks' batches at a step come from the
same bucket, every sample trains once per epoch across ranks (up to the padding of each bucket's
last round), the ranks agree on every bucket size at fit start and after the unfreeze, and every
real step of each rank stays within the budget. A ``WeightedRandomSampler`` in the user's loader keeps
its draws under DDP: rank zero's pass, shared out so that across the ranks each epoch trains exactly
what a fresh copy of the sampler draws, every rank's step at the same bucket.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from retune.schedule.models import parse_byte_size
from tests.helpers import bucket_data
from tests.helpers.dist_utils import run_rank_scripts

SCRIPT = Path(__file__).resolve().parents[1] / "ddp" / "run_ddp_buckets.py"
N = 401


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # a session of its own, killed whole on a timeout below the suite's per-test one (tests/helpers/dist_utils.py)
    code, output, out = run_rank_scripts({"buckets": ["{out}"]}, SCRIPT, tmp_path_factory.mktemp("ddp"), 240)["buckets"]
    assert code == 0, output[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_ranks_agree_on_every_bucket_size_and_re_tune_after_the_unfreeze(ranks: list[dict[str, Any]]) -> None:
    histories = [[(e["trigger"], e["bucket_sizes"], e["trials"]) for e in r["history"]] for r in ranks]
    assert histories[0] == histories[1]
    (_, frozen, _), (trigger, unfrozen, _) = histories[0]
    assert trigger == "trainable_params_changed"
    # buckets capped by their share of samples (a whole bucket in one batch) may keep their size
    assert all(a <= b for a, b in zip(unfrozen, frozen, strict=True)) and sum(unfrozen) < sum(frozen)
    assert ranks[0]["global_step"] == ranks[1]["global_step"] > 0
    # (no weight comparison: DDP all-reduces only the parameters that required grad when it wrapped the
    # model, so a backbone unfrozen later trains per rank whatever the batching)


@pytest.mark.parametrize("epoch", [0, 1])
def test_same_number_of_batches_same_bucket_per_step_every_sample_once(ranks: list[dict[str, Any]], epoch: int) -> None:
    bucket_data.check_rank_steps(ranks, epoch, N)


def test_every_real_step_of_each_rank_stays_within_the_budget(ranks: list[dict[str, Any]]) -> None:
    budget = parse_byte_size(bucket_data.BUDGET)
    assert all(max(r["peaks"]) <= budget for r in ranks), [max(r["peaks"]) / budget for r in ranks]


def test_bounds_cut_by_steps_agree_across_ranks_and_every_sample_trains_once(tmp_path: Path) -> None:
    """``search.predict: auto`` on a tail the search re-cuts for fewer steps: both ranks trace (the hungrier
    rank's prediction), cut the same bounds, verify every bucket with the same probes, and deal every sample
    once per epoch at one bucket per step; no real step over the budget."""
    code, output, out = run_rank_scripts({"by_steps": ["{out}", "by_steps"]}, SCRIPT, tmp_path, 240)["by_steps"]
    assert code == 0, output[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    histories = [
        [(e["trigger"], e["bucket_bounds"], e["bucket_sizes"], e["trials"]) for e in r["history"]] for r in ranks
    ]
    assert histories[0] == histories[1]
    assert all(e["prediction"] == "predicted" for e in ranks[0]["history"])
    assert ranks[0]["by_steps"] and ranks[1]["by_steps"], "the bounds were cut by steps"
    for epoch in (0, 1):
        bucket_data.check_rank_steps(ranks, epoch, N)
    budget = parse_byte_size(bucket_data.BUDGET)
    assert all(max(r["peaks"]) <= budget for r in ranks), [max(r["peaks"]) / budget for r in ranks]


def test_throughput_ranks_agree_and_the_slowest_rank_decides_the_padded_work(tmp_path: Path) -> None:
    from tests.ddp.run_ddp_buckets_throughput import TIMES

    script = Path(__file__).resolve().parents[1] / "ddp" / "run_ddp_buckets_throughput.py"
    code, output, out = run_rank_scripts({"throughput": ["{out}"]}, script, tmp_path, 240)["throughput"]
    assert code == 0, output[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    (event0,), (event1,) = ranks[0]["history"], ranks[1]["history"]
    assert event0 == {**event1, "duration_s": event0["duration_s"]}  # the same trials, rates, choice and cap
    assert ranks[0]["bucket_sizes"] == ranks[1]["bucket_sizes"] == event0["bucket_sizes"]
    ref = event0["reference_bucket"]
    longest = event0["bucket_bounds"][ref]

    def slowest(size: int) -> float:  # every step waits for the slowest rank
        return size / max(t.seconds(size * longest) for t in TIMES.values())

    for (size, fits), rate, bucket in zip(
        event0["trials"], event0["samples_per_s"], event0["trial_buckets"], strict=True
    ):
        assert rate is None or (bucket == ref and fits and rate == pytest.approx(slowest(size)))
    assert any(rate is not None for rate in event0["samples_per_s"])
    chosen = event0["bucket_sizes"][ref]
    best = max(slowest(b) for b in range(1, event0["largest"] + 1))
    assert slowest(chosen) >= (1 - 0.03) * best  # as in tests/search/test_throughput_fit.py
    # rank 0 alone would work at ~1024 padded tokens per step: the slower rank 1 holds it near 512
    assert event0["padded_per_step"] == chosen * longest <= 512 + longest
    assert max(ranks[0]["sizes"]) == max(ranks[1]["sizes"]) == max(event0["bucket_sizes"])


# -- a sampler that chooses what trains (issue 28, point 1, under DDP) ----------------------------------------------


Ranks = tuple[list[dict[str, Any]], list[Any], list[Any]]


@pytest.fixture(scope="module")
def sampler_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ranks]:
    """Both samplers' runs at once (each 2 ranks): a weighted sampler's, and the user's own DistributedSampler's."""
    script = Path(__file__).resolve().parents[1] / "ddp" / "run_ddp_buckets_sampler.py"
    runs = {"weighted": ["{out}"], "distributed": ["{out}", "distributed"]}
    results: dict[str, Ranks] = {}
    for name, (code, output, out) in run_rank_scripts(runs, script, tmp_path_factory.mktemp("ddp"), 240).items():
        assert code == 0, f"{name}: {output[-4000:]}"  # a hang is killed at 240 s and reported as TIMED OUT
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
        draws = [json.loads((out / f"draws{r}.json").read_text()) for r in (0, 1)]
        said = [json.loads((out / f"warnings{r}.json").read_text()) for r in (0, 1)]
        results[name] = (ranks, draws, said)
    return results


@pytest.fixture(scope="module")
def weighted_ranks(sampler_runs: dict[str, Ranks]) -> Ranks:
    return sampler_runs["weighted"]


def test_a_weighted_sampler_under_ddp_trains_exactly_its_draws_across_ranks_at_one_bucket_per_step(
    weighted_ranks: tuple[list[dict[str, Any]], list[Any], list[Any]],
) -> None:
    from tests.ddp.run_ddp_buckets_sampler import NUM_SAMPLES, N, make_sampler

    ranks, draws, said = weighted_ranks
    assert not any("batching: fixed" in m for m in said[0]), said[0]  # bucketed, no fallback
    fresh = make_sampler()  # a fresh copy, the same generator seed: what a plain loader over it draws
    expected = [[int(i) for i in fresh] for _ in range(2)]
    assert expected[0] != expected[1]
    data = bucket_data.IndexedTokens(bucket_data.long_tail_lengths(N))
    bounds = ranks[0]["history"][0]["bucket_bounds"]
    assert ranks[0]["bucket_sizes"] == ranks[1]["bucket_sizes"] and len(set(ranks[0]["bucket_sizes"])) > 1
    for epoch in range(2):
        assert draws[0][str(epoch)] == draws[1][str(epoch)] == expected[epoch]  # rank zero's draws, on every rank
        steps = [[s for s in r["steps"] if s["epoch"] == epoch] for r in ranks]
        assert len(steps[0]) == len(steps[1]) > 0
        buckets = [s["bucket"] for s in steps[0]]
        assert buckets == [s["bucket"] for s in steps[1]] and None not in buckets
        trained = Counter(i for rank in steps for s in rank for i in s["indices"])
        assert sum(trained.values()) == NUM_SAMPLES  # odd: not padded to a multiple of the 2 ranks
        assert trained == Counter(expected[epoch])  # the sampler's draws, as often as drawn, across the ranks
        share = sum(c for i, c in trained.items() if i % 4 == 0) / NUM_SAMPLES
        assert share > 0.6, share  # the weights' share (the dataset's is 0.25)
        for a, b in zip(*steps, strict=True):  # every sample of a step at most as long as its bucket holds
            assert a["indices"] and b["indices"]
            assert all(bucket_data.tokens(data[i]) <= bounds[a["bucket"]] for i in a["indices"] + b["indices"])
    assert len({len(s["indices"]) for s in ranks[0]["steps"]}) > 2  # several bucket sizes trained
    budget = parse_byte_size(bucket_data.BUDGET)
    assert all(max(r["peaks"]) <= budget for r in ranks), [max(r["peaks"]) / budget for r in ranks]
    # every rank reports the same samples per step (the whole epoch's draws over every rank's steps)
    assert [e["samples_per_step"] for e in ranks[0]["history"]] == [e["samples_per_step"] for e in ranks[1]["history"]]


def test_the_users_own_distributed_sampler_with_drop_last_trains_exactly_the_samples_it_keeps(
    sampler_runs: dict[str, Ranks],
) -> None:
    """Its epochs leave ``len(dataset) % ranks`` samples out (another one each epoch): buckets trained them too,
    as if it drew every sample once. Now its draws across the ranks are grouped, and trained exactly once."""
    from tests.ddp.run_ddp_buckets_sampler import N_ODD, make_distributed

    ranks, draws, said = sampler_runs["distributed"]
    assert not any("batching: fixed" in m for m in said[0]), said[0]  # bucketed, no fallback
    data = bucket_data.IndexedTokens(bucket_data.long_tail_lengths(N_ODD))
    assert ranks[0]["bucket_sizes"] == ranks[1]["bucket_sizes"] and len(set(ranks[0]["bucket_sizes"])) > 1
    left_out = []
    for epoch in range(2):
        kept = []
        for rank in (0, 1):  # what the user's own loaders draw on the two ranks, fresh copies
            fresh = make_distributed(rank, data)
            fresh.set_epoch(epoch)
            kept += [int(i) for i in fresh]
        assert len(kept) == len(set(kept)) == N_ODD - 1
        left_out.append(set(range(N_ODD)) - set(kept))
        steps = [[s for s in r["steps"] if s["epoch"] == epoch] for r in ranks]
        assert len(steps[0]) == len(steps[1]) > 0
        assert [s["bucket"] for s in steps[0]] == [s["bucket"] for s in steps[1]]
        trained = Counter(i for rank in steps for s in rank for i in s["indices"])
        assert trained == Counter(kept)  # each kept sample once; the one it leaves out never
        assert draws[0][str(epoch)] == draws[1][str(epoch)]  # the same epoch on every rank
        assert sorted(draws[0][str(epoch)]) == sorted(kept)
    assert left_out[0] != left_out[1]  # shuffled with the epoch: another sample is left out
    budget = parse_byte_size(bucket_data.BUDGET)
    assert all(max(r["peaks"]) <= budget for r in ranks), [max(r["peaks"]) / budget for r in ranks]
