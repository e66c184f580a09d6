"""``preserved_rng`` puts the random streams back after a block, except where the run itself drew inside it.

The draw of an epoch's samples from the user's sampler (``retune.buckets.drawn``) happens when Lightning first asks
the loader's length, and that can be while retune rebuilds the loader inside a block that puts the streams back:
rolled back, the next epoch drew the same samples again (a ``WeightedRandomSampler`` on torch's RNG trained epoch
0's draws in epoch 1, in the same order). ``keep_run_draw`` keeps that draw's use of the streams, and only it.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from retune.random_state import keep_run_draw, preserved_rng


def test_a_block_puts_every_stream_back() -> None:
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with preserved_rng():
        torch.rand(3), random.random(), np.random.rand()
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()


def test_a_run_draw_inside_nested_blocks_stays_and_what_follows_it_does_not() -> None:
    torch.manual_seed(0)
    expected = torch.rand(4)  # the run's draw, from where the stream was
    after_draw = torch.get_rng_state()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(5)
    with preserved_rng([generator]):
        with preserved_rng():
            drawn = torch.rand(4)
            torch.randint(0, 10, (2,), generator=generator)
            keep_run_draw([generator])
            torch.rand(7)  # a loader iterator's base seed, after the draw: not the run's
        kept_generator = generator.get_state()
        torch.rand(2)  # a probe's draw in the outer block
    assert torch.equal(drawn, expected)
    assert torch.equal(torch.get_rng_state(), after_draw)
    assert torch.equal(generator.get_state(), kept_generator)
    assert not torch.equal(generator.get_state(), torch.Generator().manual_seed(5).get_state())


def test_a_run_draw_outside_any_block_changes_nothing_later() -> None:
    torch.manual_seed(1)
    keep_run_draw()
    with preserved_rng():
        torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(torch.get_rng_state(), torch.random.default_generator.get_state())
    with preserved_rng():
        torch.rand(3)
    after = torch.get_rng_state()
    torch.manual_seed(1)
    assert torch.equal(after, torch.get_rng_state())  # the earlier keep_run_draw left no note behind
