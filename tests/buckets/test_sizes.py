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
