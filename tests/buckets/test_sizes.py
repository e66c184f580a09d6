"""The bucket search's probes as a caching allocator's verdict reads them (``retune.buckets.sizes.search_buckets``).

Pure logic over ``measure(bucket, size)``: no model, no allocator; the numbers are a simulated allocator's.
"""

from __future__ import annotations

from retune.buckets.sizes import search_buckets


def test_a_bucket_search_rereads_its_probes_when_the_headroom_grows() -> None:
    """Found by review: on a caching allocator the probe's checked peak holds the headroom measured so far (the
    session's largest fragmentation), which can grow after the first probes. The search re-reads every probe at
    the current headroom (``recheck``) before drawing its lines: the probes that a line through both bases cost
    (8 against 5, same sizes) are not spent."""
    mib = 2**20
    limit, longest = 4096 * mib, (512, 128, 32)

    def run(recheck: bool) -> tuple[list[int | None], int]:
        headroom = {"now": 0, "trials": 0}
        allocated: dict[tuple[int, int], int] = {}

        def measure(bucket: int, size: int) -> tuple[bool, int | None]:
            allocated[(bucket, size)] = 1024 * mib + size * longest[bucket] * 16 * 1024
            headroom["trials"] += 1
            if headroom["trials"] > 2:
                headroom["now"] = 500 * mib  # fragmentation first measured at the third probe
            checked = allocated[(bucket, size)] + headroom["now"]
            return checked <= limit, checked

        def reread(bucket: int, size: int) -> int | None:
            return allocated[(bucket, size)] + headroom["now"]

        result = search_buckets(
            longest, (8192,) * 3, measure, limit, start=8, max_trials=25, tolerance=0.05,
            recheck=reread if recheck else None,
        )  # fmt: skip
        return result.found, len(result.trials)

    truth = [(limit - 1524 * mib) // (s * 16 * 1024) for s in longest]
    (found, trials), (found_before, trials_before) = run(True), run(False)
    assert found == found_before
    assert all(f is not None and 0.95 * t <= f <= t for f, t in zip(found, truth, strict=True)), (found, truth)
    assert trials < trials_before, (trials, trials_before)


def test_a_bucket_whose_own_probes_cost_more_than_longer_samples_is_not_raised_to_their_fit() -> None:
    """Found by review: images padded to the batch's tallest and widest apart, sized by their area. The bucket of
    areas up to 896 holds tall and wide images (8 x 112, 112 x 8): its worst batch pads to 112 x 112, more memory
    per sample than the squares of 1024 in the next bucket. Its own probes measured that (7 fit), and the carry
    "a size that fits longer samples fits shorter ones" raised it to the squares' fit all the same: 86, at 11.5
    times the budget in training. A bucket keeps its own probes' size where their line says the carried one does
    not fit, and the result names it (the finder warns)."""
    limit = 24 * 2**20
    largest, per_sample = (896, 1024, 9216), {0: 12544 * 200, 1: 1024 * 200, 2: 9216 * 200}

    def measure(bucket: int, size: int) -> tuple[bool, int | None]:
        peak = 2**20 + size * per_sample[bucket]
        return peak <= limit, peak

    result = search_buckets(largest, (185, 113, 2), measure, limit, start=2, max_trials=25, tolerance=0.05)
    truth = [(limit - 2**20) // per_sample[b] for b in range(3)]
    assert result.found[1] is not None and result.found[1] > truth[0]  # the squares fit far more than the mixed
    assert result.found[0] is not None and result.found[0] <= truth[0], (result.found, truth)
    assert any(t.bucket == 0 and t.fits and t.batch_size == result.found[0] for t in result.trials), "its own probe"
    assert result.unordered == [0]


def test_a_middle_bucket_that_costs_more_than_longer_samples_is_sized_by_its_own_probes() -> None:
    """Found by review of the fix above: a bucket searched after a longer, cheaper one starts from that bucket's fit
    (``_bound_by``), and where its own first probe above it failed it kept that fit: 113 for a bucket whose own
    line allows 9, at 11.3 times the limit. A carried fit its own probes' line contradicts is dropped and the
    bucket is probed on its own line."""
    limit = 24 * 2**20
    largest = (500, 896, 1024, 9216)
    per_sample = {0: 500 * 200, 1: 12544 * 200, 2: 1024 * 200, 3: 9216 * 200}

    def measure(bucket: int, size: int) -> tuple[bool, int | None]:
        peak = 2**20 + size * per_sample[bucket]
        return peak <= limit, peak

    result = search_buckets(largest, (300, 185, 113, 2), measure, limit, start=2, max_trials=25, tolerance=0.05)
    truth = [(limit - 2**20) // per_sample[b] for b in range(4)]
    assert all(f is not None and f <= t for f, t in zip(result.found, truth, strict=True)), (result.found, truth)
    assert result.found[1] == truth[1] and 1 in result.unordered
    assert any(t.bucket == 1 and t.fits and t.batch_size == result.found[1] for t in result.trials)


def test_a_bucket_search_cut_short_by_max_trials_names_the_buckets_it_left_open() -> None:
    """``max_trials`` that ends the search before every bucket's size is pinned leaves those buckets at what fit of
    their probes, or at a longer bucket's fit: ``unsettled`` names them (the event's note and a warning say so),
    with peaks or without (the fits-only search, no limit); a search with the trials it needs names none."""
    limit, longest = 100_000, (512, 128, 32)

    def peak(bucket: int, size: int) -> int:
        return 10_000 + size * longest[bucket] * 4

    def measure(bucket: int, size: int) -> tuple[bool, int | None]:
        return peak(bucket, size) <= limit, peak(bucket, size)

    def fits_only(bucket: int, size: int) -> tuple[bool, int | None]:
        return peak(bucket, size) <= limit, None

    for oracle, bound in ((measure, limit), (fits_only, None)):
        full = search_buckets(longest, (8192,) * 3, oracle, bound, start=2, max_trials=60)
        truth = [(limit - 10_000) // (4 * s) for s in longest]
        assert full.found == truth and not full.unsettled, (full.found, truth)
        for max_trials in range(1, len(full.trials)):
            cut = search_buckets(longest, (8192,) * 3, oracle, bound, start=2, max_trials=max_trials)
            short = {b for b in range(3) if cut.found[b] != truth[b]}  # a bucket may land on its size unpinned
            assert cut.unsettled and short <= set(cut.unsettled), (max_trials, cut.found, cut.unsettled)


def test_a_bucket_the_trials_never_reached_is_not_unsettled_where_a_longer_fit_reaches_its_cap() -> None:
    """Found by review: a fits-only search (no limit) whose trials ran out as the longest bucket settled named the
    short bucket "unsettled", though its cap (its share of samples, 3) is below the longer bucket's fit of 100,
    which carries down to it: nothing was left to probe there."""
    result = search_buckets([128, 16], [1000, 3], lambda b, s: (s <= 100, None), None, start=8, max_trials=11)
    assert result.found == [100, 3] and result.unsettled == []
    cut = search_buckets([128, 16], [1000, 3], lambda b, s: (s <= 100, None), None, start=8, max_trials=9)
    assert cut.unsettled == [0]  # the longest bucket's own bracket was still open (100 fit, 104 failed)
