"""Every benchmark number the pages quote is what its results file holds.

``docs/benchmarks.md`` (and the guides, the README) quote the tables and figures that
``tests/benchmarks/results/*.json`` records; the benchmarks themselves are too slow for the suite
(``make bench``), so what is held here is the other half: each table cell, and each figure a
sentence states, is recomputed from its results file with the page's own rounding and compared as
text. A rerun that moves a number fails here until the page says the new one; a page edited by hand
fails until it says what was measured. Derived figures (ratios, ranges, shares) are computed from
the file, not copied. Numbers no results file holds (earlier runs, the machine's load) are not
checked and say so on the page. ``prediction.json`` ("Predict, then verify") is held too.
"""

# The pages print the times sign, en dashes and real minus signs; the expected cells must too.
# ruff: noqa: RUF001, RUF002

from __future__ import annotations

import json
import math
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BENCHMARKS = DOCS / "benchmarks.md"
MINUS = "\u2212"  # the pages write negative figures with a real minus sign


# ---------------------------------------------------------------- the shared reader and formats


def _results(name: str) -> Any:
    return json.loads((ROOT / "tests" / "benchmarks" / "results" / name).read_text(encoding="utf-8"))


def _table(page: Path, header: str, *, after: str | None = None, bold: bool = False) -> list[list[str]]:
    """The rows of the Markdown table whose header line starts with ``header``.

    ``after`` picks the first such table below the first line that contains it (two tables of a
    section can share a header). Cells are stripped, and of ``**`` unless ``bold``. The header row
    itself is ``_header``'s.
    """
    lines = page.read_text(encoding="utf-8").splitlines()
    start = 0
    if after is not None:
        start = next((i for i, line in enumerate(lines) if after in line), len(lines))
        assert start < len(lines), f"{page.name}: no line contains {after!r}"
    begin = next((i for i in range(start, len(lines)) if lines[i].startswith(header)), None)
    assert begin is not None, f"{page.name}: no table with the header {header!r}"
    rows = []
    for line in lines[begin + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append(cells if bold else [c.replace("**", "") for c in cells])
    return rows


def _header(page: Path, header: str) -> list[str]:
    line = next(line for line in page.read_text(encoding="utf-8").splitlines() if line.startswith(header))
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _prose(page: Path) -> str:
    """The page's text with every run of whitespace one space, so a sentence reads across line breaks."""
    return " ".join(page.read_text(encoding="utf-8").split())


def _says(page: Path, *phrases: str) -> None:
    text = _prose(page)
    for phrase in phrases:
        assert phrase in text, f"{page.relative_to(ROOT)} does not say {phrase!r} (what the results file holds)"


def _fmt(x: float, digits: int) -> str:
    """``x`` rounded half up to ``digits`` decimals, as a reader rounds the printed value (2.25 -> 2.3)."""
    return str(Decimal(repr(x)).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def _sig(x: float, figures: int = 2) -> str:
    """``x`` to ``figures`` significant figures (3.13 -> 3.1, 0.1007 -> 0.10)."""
    return _fmt(x, max(figures - 1 - math.floor(math.log10(abs(x))), 0))


def _exp(x: float) -> str:
    """Two significant figures in the pages' exponent notation (4.04e-4 -> 4.0e-4)."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _thousands(x: float) -> str:
    return f"{int(_fmt(x, 0)):,}"


def _pct(x: float, digits: int = 1) -> str:
    """A signed share in percent: +1.5%, −0.1%."""
    return f"{'+' if x >= 0 else MINUS}{_fmt(abs(x) * 100, digits)}%"


def _ms(seconds: float) -> str:
    """Milliseconds as the pages print them: one decimal below 10 ms, whole above."""
    ms = seconds * 1000
    return _fmt(ms, 1) if ms < 10 else _fmt(ms, 0)


def _times(ratio: float) -> str:
    """A speed-up: whole from 100×, one decimal below."""
    return f"{_fmt(ratio, 0) if ratio >= 100 else _fmt(ratio, 1)}×"


def _span(values: list[float], fmt: Any) -> str:
    """``low–high`` of ``values`` in ``fmt``, one value when both ends print the same."""
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}–{high}"


def test_the_formats_round_as_a_reader_does() -> None:
    assert (_fmt(2.25, 1), _fmt(37.5, 0), _fmt(3.85, 1)) == ("2.3", "38", "3.9")
    assert (_sig(3.13), _sig(0.1007), _sig(0.398)) == ("3.1", "0.10", "0.40")
    assert (_exp(4.037e-4), _exp(6.89e-6), _pct(-0.0084), _pct(0.0147)) == ("4.0e-4", "6.9e-6", "−0.8%", "+1.5%")
    assert (_ms(0.000936), _ms(0.25099), _times(804.68), _times(13.1997)) == ("0.9", "251", "805×", "13.2×")


# ---------------------------------------------------------------- search


def test_search_benchmark_table_is_the_results_file() -> None:
    """Every number of the search table is the median ``tests/benchmarks/results/search.json`` holds."""
    results = _results("search.json")
    medians = {(m["phase"], m["method"]): m for m in results["medians"]}
    rows = _table(BENCHMARKS, "| phase | method | trials |")
    assert len(rows) == 10
    for phase, method, trials, steps, found, seconds in rows:
        library, mode = re.match(r"(retune|Lightning) `(\w+)`", method).groups()  # type: ignore[union-attr]
        key = f"{library.lower()}-{mode}" + (" (new fit)" if "new fit" in method else "")
        m = medians[("cold" if phase == "cold" else "retune", key)]
        assert (int(trials), int(steps)) == (m["trials"], m["probe_steps"]), method
        assert (found, seconds) == (f"{m['found_over_true']:.3f}", f"{m['seconds']:.2f}"), method
    assert results["environment"]["cpus"] == 2  # the machine the page names


def test_search_benchmark_prose_is_the_results_file() -> None:
    """The true maxima, ``model`` mode's trials per scenario and the MLP re-tune's probes, from the rows."""
    rows = {(r["scenario"], r["phase"], r["method"]): r for r in _results("search.json")["rows"]}
    scenarios = ("mlp", "cnn", "transformer")

    def true_max(scenario: str, phase: str) -> int:
        return int(rows[(scenario, phase, "retune-model")]["true_max"])

    maxima = [f"{true_max(s, 'cold')} / {true_max(s, 'retune')}" for s in scenarios]
    _says(
        BENCHMARKS,
        f"True maxima: MLP {maxima[0].replace(' / ', ' frozen / ')} unfrozen, CNN {maxima[1]}, "
        f"transformer {maxima[2]}.",
    )
    cold = "/".join(str(rows[(s, "cold", "retune-model")]["trials"]) for s in scenarios)
    warm = "/".join(str(rows[(s, "retune", "retune-model")]["trials"]) for s in scenarios)
    _says(BENCHMARKS, f"per scenario `model` took {cold} trials cold and {warm} after the unfreeze")
    exact = all(
        rows[(s, p, "retune-model")]["found"] == rows[(s, p, "retune-model")]["true_max"]
        for s in scenarios
        for p in ("cold", "retune")
    )
    assert exact, "the page says `model` always lands exactly on the true maximum"
    sizes = [size for size, _ in rows[("mlp", "retune", "retune-model")]["trial_sizes"]]
    fits = [ok for _, ok in rows[("mlp", "retune", "retune-model")]["trial_sizes"]]
    assert fits == [True, True, False, True, True]
    _says(
        BENCHMARKS,
        f"through its first two probes ({sizes[0]}, {sizes[1]}) predicts {sizes[2]}",
        f"so {sizes[2]} runs out of memory and a bisection and one more line follow ({sizes[3]}, then {sizes[4]})",
    )
    medians = {(m["phase"], m["method"]): m["trials"] for m in _results("search.json")["medians"]}
    assert medians[("cold", "retune-model")] == medians[("retune", "retune-model")]
    _says(
        ROOT / "README.md",
        f"`model` mode predicts from measured memory ({medians[('retune', 'retune-model')]} trials median)",
    )


# ---------------------------------------------------------------- snapshot and restore


def _threads(results: Any) -> str:
    n = results["environment"]["torch_threads"]
    return f"{n} thread" + ("s" if n > 1 else "")


def _count(n: int) -> str:
    return f"{_fmt(n / 1e6, 1)}M" if n >= 1e6 else f"{_fmt(n / 1e3, 0)}k"


def test_snapshot_benchmark_table_is_the_results_files() -> None:
    """Both runs' medians, side by side, and the thread count each file records in its column's header."""
    one, second = _results("snapshot.json"), _results("snapshot-default-threads.json")
    header = _header(BENCHMARKS, "| model state |")
    assert header[2] == f"retune, {_threads(one)}"
    assert header[5] == f"retune, {_threads(second)} (2nd run)"
    rows = _table(BENCHMARKS, "| model state |")
    labels = {"frozen": "backbone frozen", "partial": "partly frozen", "unfrozen": "unfrozen"}
    assert [row[0] for row in rows] == [
        f"{labels[case]} ({_count(c['trainable_params'])} trainable)" for case, c in one["cases"].items()
    ]
    for row, case in zip(rows, one["cases"], strict=True):
        a, b = one["cases"][case], second["cases"][case]
        assert a["snapshot_bytes"] == b["snapshot_bytes"]
        expected = [f"{_fmt(a['snapshot_bytes'] / 2**20, 1)} MiB"]
        for c in (a, b):
            expected += [f"{_ms(c['retune_s'])} ms", f"{_ms(c['lightning_s'])} ms", _times(c["speedup"])]
        assert row[1:] == expected, case


def test_snapshot_benchmark_prose_is_the_results_files() -> None:
    runs = (_results("snapshot.json"), _results("snapshot-default-threads.json"))
    unfrozen = [r["cases"]["unfrozen"] for r in runs]
    partial = [r["cases"]["partial"] for r in runs]

    def one(x: float) -> str:
        return _fmt(x, 1)

    _says(
        BENCHMARKS,
        f"for a {_count(unfrozen[0]['params'])}-parameter model with AdamW state",
        f"{_times(unfrozen[0]['speedup'])} and {_times(unfrozen[1]['speedup'])} in the two runs above",
        f"hands the run's own tensors back ({_ms(unfrozen[0]['retune_restore_s'])} ms)",
        f"mostly the kernel providing {_fmt(unfrozen[0]['snapshot_bytes'] / 2**20, 0)} MiB of fresh pages",
        f"({_span([u['retune_reset_s'] for u in unfrozen], _ms)} ms unfrozen in these two runs)",
        f"whole state cost is {_span([u['search3_speedup'] for u in unfrozen], one)}× below "
        f"Lightning's single round trip unfrozen, {_span([p['search3_speedup'] for p in partial], one)}× partly frozen",
    )
    assert runs[1]["environment"]["torch_threads"] == 1, "the page says the second run recorded one thread"


# ---------------------------------------------------------------- variable-size samples


def test_probe_samples_table_is_the_results_file() -> None:
    """The guide's table of ``probe_samples: first`` against ``largest`` (its only copy: benchmarks.md links it)."""
    results = _results("probe_samples.json")
    guide = DOCS / "guides" / "variable-length.md"
    rows = _table(guide, "| `probe_samples` | size found |")
    assert [row[0] for row in rows] == ["`first` (default)", "`largest`"]
    for row, mode in zip(rows, ("first", "largest"), strict=True):
        r = results["rows"][mode]
        worst = _fmt(r["max_peak_over_budget"], 2)
        if worst == "1.00" and r["max_peak_over_budget"] < 1:  # rounding would hide that it fits
            worst += f" ({_fmt(r['max_peak_over_budget'], 4)})"
        expected = [
            str(r["size"]),
            worst,
            f"{r['steps_over_budget']} of {r['steps']}",
            f"{_fmt(r['search_s'], 2)} s",
            f"{_fmt(r['scan_s'], 3)} s" if r["scans"] else "—",
            f"{_fmt(r['retune_search_s'], 2)} s" + (" (no second scan)" if r["scans"] == 1 else ""),
        ]
        assert row[1:] == expected, mode
    first = results["rows"]["first"]
    _says(
        guide,
        f"({results['samples']} token sequences, {_fmt(100 * results['long_samples'] / results['samples'], 2)}% "
        "of them",
        f"a {results['budget'].replace('MiB', ' MiB')} CPU budget",
        f"probing the first batches picks batch size {first['size']}, and the epoch's steps that meet a long sample "
        f"then need {_fmt(first['max_peak_over_budget'], 2)}× the budget",
        f"medians of {results['repeats']}, one CPU thread",
    )
    _says(BENCHMARKS, f"one CPU thread, medians of {results['repeats']}")


# ---------------------------------------------------------------- buckets


_BUCKET_MODES = ("first", "largest", "buckets")
_BUCKET_LABELS = ("`probe_samples: first`", "`probe_samples: largest`", "`batching: buckets`")


def _sizes(search: dict[str, Any]) -> str:
    return "/".join(map(str, search["bucket_sizes"])) if search["bucket_sizes"] else str(search["batch_size"])


def test_buckets_tables_are_the_results_file() -> None:
    """Both workloads' tables: every cell, and bold exactly where a real step went over the budget."""
    results = _results("buckets.json")["results"]
    for workload, title in (("tokens", "**token sequences"), ("bert", "**small BERT")):
        plain = _table(BENCHMARKS, "| | epoch | samples / step |", after=title)
        raw = _table(BENCHMARKS, "| | epoch | samples / step |", after=title, bold=True)
        assert len(plain) == 2 * len(_BUCKET_MODES), workload
        for i, (row, raw_row) in enumerate(zip(plain, raw, strict=True)):
            mode, epoch = _BUCKET_MODES[i // 2], i % 2
            e, s = results[workload][mode]["epochs"][epoch], results[workload][mode]["searches"][epoch]
            search = "fit start" if epoch == 0 else "re-tune after the unfreeze"
            expected = [
                _BUCKET_LABELS[i // 2] if epoch == 0 else "",
                "0 (frozen)" if epoch == 0 else "1 (unfrozen)",
                _fmt(e["samples_per_step"], 1),
                f"{_fmt(e['seconds'], 2)} s",
                _fmt(e["samples_per_s"], 0),
                _fmt(e["worst_peak_over_budget"], 2),
                f"{_fmt(e['padding'] * 100, 0)}%",
                f"{search}: {s['trials']}, {_fmt(s['seconds'], 2)} s → {_sizes(s)}",
            ]
            assert row == expected, (workload, mode, epoch)
            over = e["worst_peak_over_budget"] > 1
            assert raw_row[5].startswith("**") == over, (workload, mode, epoch, "bold marks a step over the budget")


def test_buckets_prose_is_the_results_file() -> None:
    buckets = _results("buckets.json")
    results = buckets["results"]
    targets = {(t["workload"], t["epoch"], t["target"]): t["value"] for t in buckets["targets"]}

    def over(workload: str) -> str:
        return _fmt(results[workload]["first"]["epochs"][0]["worst_peak_over_budget"], 2)

    def ratios(workload: str, target: str) -> str:
        return _span([targets[(workload, epoch, target)] for epoch in (0, 1)], lambda x: _fmt(x, 1))

    worst = max(results[w]["buckets"]["epochs"][e]["worst_peak_over_budget"] for w in results for e in (0, 1))
    largest_bert = [int(results["bert"]["largest"]["epochs"][e]["samples_per_step"]) for e in (0, 1)]
    retunes = [results[w]["buckets"]["searches"][1] for w in ("tokens", "bert")]
    _says(
        BENCHMARKS,
        f"`first` runs real steps at {over('tokens')}× (tokens) and {over('bert')}× (BERT) the budget",
        f"trains the BERT at {largest_bert[0]} samples per step, then {largest_bert[1]} after the unfreeze",
        f"stays within the budget on every real step (worst {_fmt(worst, 2)})",
        f"trains {ratios('tokens', 'samples/step >= 3x largest')}× (tokens) and "
        f"{ratios('bert', 'samples/step >= 3x largest')}× (BERT) the samples per step of `largest`",
        f"its epochs take {ratios('tokens', 'epoch faster than largest')}× (tokens) and "
        f"{ratios('bert', 'epoch faster than largest')}× (BERT) less time",
        f"probes all buckets in {retunes[0]['trials']} ({len(retunes[0]['bucket_sizes'])} buckets) and "
        f"{retunes[1]['trials']} ({len(retunes[1]['bucket_sizes'])} buckets) trials",
    )


def test_buckets_throughput_table_is_the_results_file() -> None:
    """The timed run's sizes and samples/s of ``buckets`` and ``buckets_throughput``, and their ratio."""
    results = _results("buckets_throughput.json")["results"]
    rows = _table(BENCHMARKS, "| workload | epoch | `buckets` sizes")
    cell = re.compile(r"^([\d/]+)(?: \((.*)\))? → ([\d,]+)$")
    assert [(row[0], row[1]) for row in rows] == [(w, e) for w in ("tokens", "BERT") for e in ("0", "1")]
    for workload, epoch, largest_cell, capped_cell, ratio in rows:
        r, n = results[workload.lower()], int(epoch)
        b, c = r["buckets"], r["buckets_throughput"]
        shown_b, shown_c = cell.match(largest_cell), cell.match(capped_cell)
        assert shown_b and shown_c, (workload, epoch)
        assert shown_b.group(1, 3) == (_sizes(b["timed_searches"][n]), _thousands(b["epochs"][n]["samples_per_s"]))
        assert shown_c.group(1, 3) == (_sizes(c["timed_searches"][n]), _thousands(c["epochs"][n]["samples_per_s"]))
        cap = c["timed_searches"][n]["padded_per_step"]
        note = shown_c.group(2) or ""
        assert note.startswith("no cap") if cap is None else note == f"{cap:,} tokens", (workload, epoch)
        assert ratio == _fmt(c["epochs"][n]["samples_per_s"] / b["epochs"][n]["samples_per_s"], 2), (workload, epoch)


def test_buckets_throughput_prose_is_the_results_file() -> None:
    results = _results("buckets_throughput.json")["results"]

    def worst(workload: str) -> str:
        epochs = results[workload]["buckets_throughput"]["epochs"]
        return " and ".join(_fmt(e["worst_peak_over_budget"], 2) for e in epochs)

    def searches(workload: str, mode: str) -> list[dict[str, Any]]:
        return [*results[workload][mode]["searches"], *results[workload][mode]["timed_searches"]]

    def trials(workload: str, mode: str) -> str:
        return _span([s["trials"] for s in searches(workload, mode)], str)

    def seconds(workload: str) -> str:
        values = [s["seconds"] for s in searches(workload, "buckets_throughput")]
        digits = 2 if max(values) < 1 else 1
        return _span(values, lambda x: _fmt(x, digits))

    bert = [results["bert"][mode]["epochs"][0]["samples_per_step"] for mode in ("buckets_throughput", "buckets")]
    capped = [results["bert"]["buckets_throughput"]["timed_searches"][n]["padded_per_step"] for n in (0, 1)]
    _says(
        BENCHMARKS,
        f"(worst {worst('tokens')} tokens, {worst('bert')} BERT)",
        f"The searches cost {trials('tokens', 'buckets_throughput')} trials ({seconds('tokens')} s) on tokens "
        f"against {trials('tokens', 'buckets')}, and {trials('bert', 'buckets_throughput')} trials "
        f"({seconds('bert')} s) on BERT against {trials('bert', 'buckets')}.",
        # what the run did to the BERT: capped (and how much smaller its steps were) or not
        f"the same speed with {_fmt(100 * (1 - bert[0] / bert[1]), 0)}% fewer samples per step (BERT epoch 0: "
        f"{_fmt(bert[0], 0)} instead of {_fmt(bert[1], 0)})"
        if capped[0] is not None
        else "left the BERT uncapped in both epochs"
        if capped[1] is None
        else "left the BERT uncapped in epoch 0",
    )


# ---------------------------------------------------------------- throughput


def test_throughput_table_is_the_results_file() -> None:
    results = _results("throughput.json")
    by_name = {r["scenario"]: r for r in results["rows"]}
    rows = _table(BENCHMARKS, "| scenario | sweep's best |")
    names = {"tiny BERT": "bert", "MLP": "mlp", "CNN": "cnn"}
    assert [row[0] for row in rows] == list(names)
    for label, best, largest, throughput, trials, seconds in rows:
        r = by_name[names[label]]
        assert best == f"{r['sweep_best']}: {_thousands(r['sweep_best_rate'])}/s", label
        assert largest == (
            f"{r['largest_size']}: {_thousands(r['largest_rate'])}/s ({_fmt(r['largest_over_best'], 2)})"
        ), label
        shares = ", ".join(_fmt(x, 2) for x in r["throughput_over_best"])
        assert throughput == f"{', '.join(map(str, r['throughput_sizes']))} ({shares})", label
        assert trials == f"{r['trials_throughput']} / {r['trials_largest']} ({_fmt(r['trials_ratio'], 2)}×)", label
        assert seconds == f"{_fmt(r['seconds_throughput'], 1)} / {_fmt(r['seconds_largest'], 1)}", label


def test_throughput_prose_is_the_results_file() -> None:
    results = _results("throughput.json")
    rows = results["rows"]
    shares = [x for r in rows for x in r["throughput_over_best"]]
    within = f"{sum(x >= 0.95 for x in shares)} of {len(shares)}"
    bert = next(r for r in rows if r["scenario"] == "bert")
    sweep = {int(size): rate for size, rate in results["scenarios"]["bert"]["sweep"].items()}
    low, high = min(bert["throughput_sizes"]), bert["largest_size"]
    flat = [rate for size, rate in sweep.items() if low <= size <= high]
    worst = bert["throughput_over_best"].index(min(bert["throughput_over_best"]))
    miss = results["scenarios"]["bert"]["searches"]["throughput"][worst]
    faster = miss["timed"][str(miss["size"])] / sweep[miss["size"]] - 1
    settings = results["settings"]
    _says(
        BENCHMARKS,
        f"(1 warm-up + {settings['sweep_steps']} timed steps per size, "
        f"{settings['sweep_rounds']} rounds in alternating order",
        f"a size limit ({', '.join(str(r['limit']) for r in rows)})",
        f"searches (alternating, {['one', 'two', 'three', 'four'][settings['rounds'] - 1]} of each",
        f"fit searches of {_span([r['trials_largest'] for r in rows], str)} trials",
        f"{within} searches are within 5% of the sweep's best",
        f"({_span([rate for rate in flat], lambda x: _fmt(x, 0))} samples/s from {low} to {high})",
        f"one trial timed {miss['size']} {_fmt(100 * faster, 0)}% faster than the sweep did",
        f"too on these CPU curves ({_span([r['largest_over_best'] for r in rows], lambda x: _fmt(x, 2))})",
        f"a search takes {_fmt(bert['seconds_throughput'], 0)} s instead of {_fmt(bert['seconds_largest'], 0)} s",
    )
    _says(
        DOCS / "guides" / "throughput.md",
        f"{_span([r['trials_ratio'] for r in rows], lambda x: _fmt(x, 2))}× the trials of a `largest` search, and "
        f"{within} searches within 5% of an exhaustive sweep's best",
    )


# ---------------------------------------------------------------- OOM recovery


def test_recovery_benchmark_table_is_the_results_file() -> None:
    """Both columns: the medians in ms, and each against the normal step."""
    results = _results("recovery.json")
    rows = _table(BENCHMARKS, "| step | ms | vs. normal |")
    keys = ("normal_ms", "guarded_ms", "recovered_forward_ms", "recovered_backward_ms", "kept_split_ms")
    shown = [row[1] for row in rows]
    assert shown[:5] == [f"{results[k]:.1f}" for k in keys]
    assert shown[5] == f"{results['ddp_ms']:.1f} / {results['ddp_oom_trigger_ms']:.1f}"
    normal = results["normal_ms"]
    rounds = results["guard_overhead_rounds"]
    versus = [row[2] for row in rows]
    assert versus[0] == "1.00×"
    assert versus[1] == (
        f"{_pct(results['guard_overhead'])} ({['one', 'two', 'three', 'four', 'five'][len(rounds) - 1]} alternating "
        f"rounds: {', '.join(_pct(x) for x in rounds)}: below this machine's noise)"
    )
    assert versus[2:5] == [f"{_fmt(results[k] / normal, 2)}×" for k in keys[2:]]
    assert versus[5] == _pct(results["ddp_overhead"])
    assert results["target_guard_overhead_under_1pct"]
    ratios = [f"{_fmt(results[k] / normal, 2)}×" for k in keys[2:]]
    _says(
        DOCS / "guides" / "oom.md",
        f"({ratios[0]} a normal step for an OOM at the end of forward, {ratios[1]} at the end of backward)",
        f"split up front, cost {ratios[2]}",
    )


def test_oom_overhead_figures_are_the_results_file() -> None:
    """The per-step cost without an OOM: a paragraph of figures, each from ``oom_overhead.json``."""
    results = _results("oom_overhead.json")
    step = _fmt(results["none"]["step_ms"], 1)
    own = results["own_work"]["retune_own_us"]
    share = own / (results["none"]["step_ms"] * 1e3) * 100
    _says(
        BENCHMARKS,
        f"a small MLP, {results['steps']} steps",
        f"(best of five loops): **{_fmt(own, 2)} µs**, {_sig(share, 1)}% of a {step} ms step",
        f"({step} ms steps, {results['rounds']} rotating rounds): `+oom` **{_pct(results['+oom']['overhead'], 2)}** "
        f"CPU time against no retune, `epoch` alone {_pct(results['epoch']['overhead'], 2)}, "
        f"`+trainable_params_changed` {_pct(results['+params']['overhead'], 2)}",
    )
    _says(DOCS / "guides" / "oom.md", f"about 1% of a {step} ms CPU step")
    assert abs(results["+oom"]["overhead"] - 0.01) < 0.005, "the guide says about 1%"


# ---------------------------------------------------------------- learning-rate re-tuning


def _accuracy(summary: dict[str, Any]) -> str:
    return f"{summary['median_val_acc']:.3f} ({summary['min_val_acc']:.3f}–{summary['max_val_acc']:.3f})"


def _rate(value: float) -> str:
    """A grid rate as the page names it: 1e-4."""
    return f"1e{round(math.log10(value))}"


def test_lr_table_is_the_results_file() -> None:
    results = _results("lr.json")
    digits, bert = results["digits"]["summary"], results["bert"]["summary"]
    rows = {row[0].split(" (")[0]: row[1:] for row in _table(BENCHMARKS, "| arm | digits:")}

    def grid(summary: dict[str, Any]) -> dict[float, dict[str, Any]]:
        return {float(k.split()[1]): v for k, v in summary.items() if k.startswith("grid ")}

    def seconds(arm: str) -> str:
        return " / ".join(_sig(s[arm]["median_test_seconds"]) for s in (digits, bert))

    def steps(arm: str) -> int:
        assert digits[arm]["median_test_steps"] == bert[arm]["median_test_steps"], arm
        return int(digits[arm]["median_test_steps"])

    assert digits["fixed"]["median_test_seconds"] == bert["fixed"]["median_test_seconds"] == 0
    assert rows["fixed rate"] == [_accuracy(digits["fixed"]), _accuracy(bert["fixed"]), str(steps("fixed")), "0"]
    assert rows["retune, re-tuned at the unfreeze"] == [
        _accuracy(digits["retune"]),
        _accuracy(bert["retune"]),
        str(steps("retune")),
        seconds("retune"),
    ]
    best = [f"{s['best of grid']['median_val_acc']:.3f} ({_rate(s['best of grid']['which'])})" for s in (digits, bert)]
    assert rows["best of a 4-rate grid"] == [*best, f"{len(grid(digits))} full runs", "—"]
    assert len(grid(digits)) == len(grid(bert)) == 4
    worst = []
    for s in (digits, bert):
        rate, arm = min(grid(s).items(), key=lambda item: item[1]["median_val_acc"])
        worst.append(f"{arm['median_val_acc']:.3f} ({_rate(rate)})")
    assert rows["worst of that grid"] == [*worst, "", ""]
    assert rows["Lightning's recipe"] == [
        _accuracy(digits["lightning"]),
        _accuracy(bert["lightning"]),
        f"{steps('lightning')} at fit start, ≤ {steps('lightning@unfreeze')} at the unfreeze",
        seconds("lightning"),
    ]
    assert rows["Lightning's recipe, at the unfreeze only"] == [
        _accuracy(digits["lightning@unfreeze"]),
        _accuracy(bert["lightning@unfreeze"]),
        str(steps("lightning@unfreeze")),
        seconds("lightning@unfreeze"),
    ]
    ranges = [f"{_rate(min(grid(s)))}…{_rate(max(grid(s)))}" for s in (digits, bert)]
    _says(BENCHMARKS, f"best of a 4-rate grid (digits {ranges[0]}, BERT {ranges[1]})")


def test_lr_prose_is_the_results_file() -> None:
    results = _results("lr.json")

    def suggestions(scenario: str, arm: str) -> list[float]:
        runs = results[scenario]["runs"][arm]
        if arm == "retune":
            return [float(run["lrs"][0][-1]) for run in runs]  # (epoch, groups, old rates, the suggestion)
        return [float(run["lrs"][0]) for run in runs]  # the fit-start test's suggestion

    retune_bert = suggestions("bert", "retune")
    lightning_bert = suggestions("bert", "lightning")
    grid_bert = {float(k.split()[1]): v for k, v in results["bert"]["summary"].items() if k.startswith("grid ")}
    bad = max(grid_bert)
    _says(
        BENCHMARKS,
        f"backbone group were {_span(suggestions('digits', 'retune'), _exp)} (digits) and {_span(retune_bert, _exp)} "
        "(BERT)",
        f"one seed's `valley` landed at {_exp(min(retune_bert))},",
        f"fit-start test suggests {_span(suggestions('digits', 'lightning'), _exp)} for digits and "
        f"{_span(lightning_bert, _sig)} for BERT",
        f"grid's bad end ({_rate(bad)} on BERT: {grid_bert[bad]['median_val_acc']:.3f})",
        f"The cost is {results['digits']['summary']['retune']['median_test_steps']} training steps per test",
    )
    # The run lengths (540 and 256 steps) are the benchmarks' settings, not results; the shares are.
    steps = results["digits"]["summary"]["retune"]["median_test_steps"]
    _says(
        BENCHMARKS,
        f"about {_fmt(100 * steps / 540, 0)}% of the digits run's 540 steps, but "
        f"{_fmt(100 * steps / 256, 0)}% of the tiny BERT run's 256",
    )


# ---------------------------------------------------------------- FSDP2


def test_fsdp2_table_is_the_results_file() -> None:
    results = _results("fsdp2.json")
    ddp, fsdp2, unguarded = (results["summary"][k] for k in ("ddp", "fsdp2", "fsdp2-unguarded"))
    rows = {row[0].split(" (")[0]: row[1:] for row in _table(BENCHMARKS, "| per rank | DDP | FSDP2 |")}

    def mb(summary: dict[str, Any]) -> str:
        return f"{_fmt(summary['snapshot_bytes'] / 1e6, 1)} MB"

    def timing(summary: dict[str, Any]) -> str:
        return (
            f"{_ms(summary['snapshot_s'])} ms (capture {_ms(summary['capture_s'])}, "
            f"restore {_ms(summary['restore_s'])})"
        )

    def search(summary: dict[str, Any]) -> str:
        return f"{_fmt(summary['search_s'], 1)} s / {_fmt(summary['search_best_s'], 1)} s"

    assert rows["snapshot of the trainable state"] == [
        mb(ddp),
        f"{mb(fsdp2)} ({_fmt(results['bytes_ratio'], 3)}×: the shard)",
    ]
    assert rows["snapshot + restore"] == [timing(ddp), timing(fsdp2)]
    assert rows["a 15-trial `binsearch` search at fit start, median / best of 3"] == [search(ddp), search(fsdp2)]
    assert ddp["trials"] == fsdp2["trials"] == 15
    assert rows["the same FSDP2 search without the collective guard, best of 3"] == [
        "—",
        f"{_fmt(unguarded['search_best_s'], 1)} s (guard: {_fmt(results['guard_ratio'], 2)}×)",
    ]
    assert rows["size found"] == [str(ddp["batch_size"]), str(fsdp2["batch_size"])]
    # DDP's snapshot holds the run's own tensors (all its bytes), FSDP2's copies each shard (holds none)
    assert rows["how it is kept on CPU"][0].startswith("held") == (ddp["held_bytes"] == ddp["snapshot_bytes"])
    assert rows["how it is kept on CPU"][1].startswith("copied") == (fsdp2["held_bytes"] < 1024)
    every = [s for ranks in results["ranks"].values() for rank in ranks for s in rank["search_all_s"]]
    _says(
        BENCHMARKS,
        f"{_fmt(ddp['whole_param_bytes'] / 4 / 1e6, 1)}M parameters, AdamW",
        f"single searches ranged from {_fmt(min(every), 1)} to {_fmt(max(every), 1)} s",
    )


# ---------------------------------------------------------------- predict, then verify (prediction.json)


def test_prediction_table_is_the_results_file() -> None:
    """The issue-29 scenario's table: trials, seconds and traces of both searches, their cost in mean real
    steps (the median and every repeat), steps over the budget and utilisation, with and without predict."""
    results = _results("prediction.json")["results"]["bert_buckets"]
    rows = {row[0]: row[1:3] for row in _table(BENCHMARKS, "| | `predict: off` | `predict: auto` | target |")}

    def search(setting: str, index: int) -> str:
        s = results[setting]["searches"][index]
        traces = f" ({_fmt(s['trace_seconds'], 2)} s)" if s["trace_seconds"] else ""
        return f"{s['trials']}, {_fmt(s['seconds'], 2)} s{traces}"

    def cost(setting: str, index: int) -> str:
        repeats = sorted(r[index] for r in results[setting]["repeats"])
        median = results[setting]["median_mean_real_steps"][index]
        return f"{_fmt(median, 1)} ({', '.join(_fmt(r, 1) for r in repeats)})"

    def epochs(setting: str) -> tuple[str, str]:
        e = results[setting]["epochs"]
        return str(sum(x["over_budget_steps"] for x in e)), " / ".join(_fmt(x["mean_utilisation"], 2) for x in e)

    settings = ("off", "auto")
    assert rows["cold search: trials, seconds (traces)"] == [search(s, 0) for s in settings]
    assert rows["cold search in mean real steps (3 repeats)"] == [cost(s, 0) for s in settings]
    assert rows["re-tune after the unfreeze: trials, seconds (traces)"] == [search(s, 1) for s in settings]
    assert rows["re-tune in mean real steps (3 repeats)"] == [cost(s, 1) for s in settings]
    assert rows["real steps over the budget (2 epochs)"] == [epochs(s)[0] for s in settings]
    assert rows["mean utilisation, epoch 0 / epoch 1"] == [epochs(s)[1] for s in settings]


def test_prediction_targets_and_errors_are_the_results_file() -> None:
    """The verdicts the table gives (met / missed) are the file's, the fixed-batching probes and the trace
    errors per scenario are its numbers."""
    data = _results("prediction.json")
    rows = _table(BENCHMARKS, "| | `predict: off` | `predict: auto` | target |")
    verdicts = [row[3] for row in rows if row[3]]
    cold, retune = data["results"]["bert_buckets"]["auto"]["median_mean_real_steps"]
    assert verdicts[0].endswith("met") == (cold <= 15) and verdicts[1].endswith("missed") == (retune > 10)
    fixed = data["results"]["fixed_model_mode"]
    off_sizes = ", ".join(str(size) for size, _ in fixed["off"]["trials"])
    _says(
        BENCHMARKS,
        f"without predict {fixed['off']['real_probes']} real probes ({off_sizes}), with predict "
        f"**{fixed['auto']['real_probes']}** ({fixed['auto']['batch_size']},",
        f"after 2 traces ({_fmt(fixed['auto']['trace_seconds'], 2)} s)",
    )
    errors = data["results"]["errors"]
    table = {
        row[0].split(" (")[0]: row[1:] for row in _table(BENCHMARKS, "| scenario | small size | larger size | trace |")
    }
    digits = {"MLP": (1, 2), "CNN": (1, 2), "BERT": (2, 1), "GPT-2 + LoRA": (2, 2)}
    for name, key in (("MLP", "mlp"), ("CNN", "cnn"), ("BERT", "bert"), ("GPT-2 + LoRA", "gpt2_lora")):
        pct, secs = digits[name]
        cells = [f"{e['error'] * 100:+.{pct}f}%".replace("+-", "-") + f" ({e['size']})" for e in errors[key]]
        low, high = (
            _fmt(min(e["trace_s"] for e in errors[key]), secs),
            _fmt(max(e["trace_s"] for e in errors[key]), secs),
        )
        trace = f"{low} s" if low == high else f"{low}-{high} s"
        assert table[name] == [*cells, trace], name


# ---------------------------------------------------------------- On a GPU (H100): tests/gpu/results


GPU_RESULTS = ROOT / "tests" / "gpu" / "results" / "h100-2026-12-05"


def _gpu(name: str) -> Any:
    return json.loads((GPU_RESULTS / name).read_text(encoding="utf-8"))


def test_gpu_search_table_is_the_results_file() -> None:
    """Every cell of the H100 search table from ``bench_gpu.json``; and every run there trained (none died)."""
    data = _gpu("bench_gpu.json")
    assert data["device"] == "NVIDIA H100 80GB HBM3" and data["capacity"] == 2 * 2**30
    names = {"mlp": "MLP", "cnn": "CNN", "transformer": "transformer"}
    expected: dict[tuple[str, str], list[str]] = {}
    for row in data["rows"]:
        assert not row["died"], row
        method = row["method"].replace("lightning-", "Lightning ").replace("retune-", "retune ").replace("+", " + ")
        cells = expected.setdefault((names[row["scenario"]], method), ["", "-"])
        if row["phase"] == "cold":
            cells[0] = f"{row['trials']}, {row['found']} / {row['true_max']}"
        else:
            cells[1] = f"{row['trials']}, {row['found']}"
    table = _table(BENCHMARKS, "| scenario | method | cold: trials")
    assert len(table) == len(expected)
    for scenario, method, cold, retune in table:
        want = expected[(scenario, method)]
        assert cold.split(" (")[0] == want[0], (scenario, method)
        assert retune == want[1], (scenario, method)


def test_gpu_prediction_table_is_the_results_file() -> None:
    data = _gpu("prediction_gpu.json")
    assert data["gpu"] == "NVIDIA H100 80GB HBM3"
    rows = [r for name in ("mlp", "bert") for r in data[name]["rows"]]
    table = _table(BENCHMARKS, "| model | size | predicted | allocated")
    assert len(table) == len(rows)
    for (_, size, predicted, allocated, error, reserved), row in zip(table, rows, strict=True):
        assert int(size) == row["size"]
        assert predicted == f"{_fmt(row['predicted'] / 1e6, 1)} MB"
        assert allocated == f"{_fmt(row['allocated'] / 1e6, 1)} MB"
        assert reserved == f"{_fmt(row['reserved'] / 1e6, 1)} MB"
        assert error.replace(MINUS, "-") == _pct(row["error_allocated"]).replace(MINUS, "-")
    explain = data["mlp"]["rows"][-1]["explain"]
    phases = " / ".join(_fmt(b / 1e6, 1) for b in explain["phase_peaks_allocated"])
    traced = " / ".join(_fmt(b / 1e6, 1) for b in data["mlp"]["rows"][-1]["predicted_phases"])
    _says(
        BENCHMARKS,
        f"the allocator peaked at {phases} MB",
        f"where the trace said {traced} MB",
        f"+{_fmt(data['bert']['calibrated_error_allocated'] * 100, 2)}% for BERT",
        f"{_fmt(data['mlp']['calibrated_error_allocated'] * 100, 1)}% for the MLP",
    )


def test_gpu_oom_recovery_figures_are_the_results_file() -> None:
    data = _gpu("oom_recovery_gpu.json")
    assert all(data["checks"].values()), data["checks"]
    _says(
        BENCHMARKS,
        f"capped at {_fmt(data['capacity_gib'], 2)} GiB",
        f"weights within **{_exp(data['max_weight_diff'])}** of an uncapped run",
        f"median step {_fmt(data['median_step_s'] * 1000, 1)} ms",
        f"the recovered step {_fmt(data['slowest_step_s'] * 1000, 0)} ms",
        f"peak allocated {_fmt(data['peak_gib'], 2)} GiB",
        f"as planned ({data['global_step']})",
    )
