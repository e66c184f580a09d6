#!/usr/bin/env bash
# One-call GPU check: every script in tests/gpu, each under its own timeout, in at most 9 minutes on one GPU.
#
#   tests/gpu/run_all.sh OUTDIR
#
# Prints one PASS/FAIL/SKIP line per check and writes OUTDIR/summary.json (plus each check's log and
# JSON). Runs with the machine's own torch and Lightning; retune itself needs only pydantic and PyYAML,
# installed from wheels when the machine has no package index (see tests/gpu/README.md):
#
#   python -m pip install --no-index --find-links gpu_wheels pydantic pyyaml
#
# The repository root is put on PYTHONPATH. PYTHON picks the interpreter (default: python).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: tests/gpu/run_all.sh OUTDIR" >&2
    exit 2
fi
mkdir -p "$1"
out="$(cd "$1" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python}"
gpus="$("$python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"

# name | timeout (s) | GPUs needed | script and arguments; the timeouts of one GPU's checks add up to 510 s (on an
# H100 the first run took 27 s, 14-23 s, 37 s, and about 290 s for bench_gpu before its loader fetched whole batches)
checks=(
    "prediction_gpu|60|1|tests/gpu/prediction_gpu.py --out $out/prediction_gpu.json"
    "oom_recovery_gpu|90|1|tests/gpu/oom_recovery_gpu.py --out $out/oom_recovery_gpu.json"
    "fsdp_check|60|1|tests/gpu/fsdp_check.py"
    "bench_gpu|300|1|tests/gpu/bench_gpu.py --out $out/bench_gpu.json"
    "fsdp2_check|240|2|tests/gpu/fsdp2_check.py"
)

results=()
failed=0
for check in "${checks[@]}"; do
    IFS='|' read -r name limit needs command <<<"$check"
    if (( gpus < needs )); then
        status="SKIP"
        rc=0
        seconds=0
        echo "SKIP $name (needs $needs GPUs, found $gpus)"
    else
        started=$SECONDS
        rc=0
        # shellcheck disable=SC2086  # the command's words are split on purpose
        timeout --kill-after=10 "$limit" "$python" $command >"$out/$name.log" 2>&1 || rc=$?
        seconds=$((SECONDS - started))
        if (( rc == 0 )); then
            status="PASS"
        elif (( rc == 124 || rc == 137 )); then
            status="FAIL"
            echo "  $name timed out after ${limit}s" >>"$out/$name.log"
        else
            status="FAIL"
        fi
        [[ $status == "FAIL" ]] && failed=1
        echo "$status $name (${seconds}s, exit $rc, log $out/$name.log)"
    fi
    results+=("{\"check\": \"$name\", \"status\": \"$status\", \"exit\": $rc, \"seconds\": $seconds, \"timeout\": $limit}")
done

{
    printf '{"gpus": %s, "checks": [' "$gpus"
    for i in "${!results[@]}"; do
        (( i > 0 )) && printf ', '
        printf '%s' "${results[$i]}"
    done
    printf ']}\n'
} >"$out/summary.json"
echo "summary: $out/summary.json"
exit "$failed"
