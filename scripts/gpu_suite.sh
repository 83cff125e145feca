#!/usr/bin/env bash
# The project's GPU checks, by part: tests | demo | bench | phase | all. Each step's full output goes to
# $WORK/<step>.log (default /tmp/gpu-results); the tail is printed; `results.tgz` of everything is
# written to $OUT when set. Needs the package importable (PYTHONPATH=. or pip install -e .).
set -u
PY=${PY:-python3}
WORK=${WORK:-/tmp/gpu-results}
mkdir -p "$WORK"
export LIFECYCLE_GPU_OUT=$WORK PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
part=${1:-all}

step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start)) s"
    tail -n "${TAIL:-12}" "$WORK/$name.log"
    echo "$name rc=$rc $((SECONDS - start))s" >>"$WORK/summary.txt"
    # Refreshed after every step: a run cut short by its caller still leaves what it did.
    [[ -n ${OUT:-} ]] && tar -czf "$OUT/results-$part.tgz" -C "$WORK" . 2>/dev/null
    return 0
}

if [[ $part == tests || $part == all ]]; then
    # One pytest process per file: torch_memory_saver's hook mode and Megatron's state are process-wide.
    for file in tests/gpu/test_*.py; do
        step "pytest-$(basename "$file" .py)" 300 "$PY" -m pytest -m gpu -q -s -p no:cacheprovider "$file"
    done
    step doctor 120 "$PY" -m actor_integration.tools.cli doctor
fi
if [[ $part == demo || $part == all ]]; then
    step demo 400 "$PY" -m actor_integration.tools.cli demo --steps 6 --save-every 2 --out "$WORK/demo" \
        --no-progress --inject-fault memory.pause@3
    step demo-check 60 "$PY" -m actor_integration.tools.cli check "$WORK/demo/logs"
    # A skipped sync: the next generation is refused (InvalidWeightsError), then sync → generate.
    # A larger model (~400 MiB of weights per engine) makes the release-verification figures meaningful.
    step demo-skip-sync 400 "$PY" -m actor_integration.tools.cli demo --steps 4 --save-every 2 \
        --out "$WORK/demo-skip-sync" --no-progress --skip-sync 2 --hidden 1024 --layers 8
    step demo-skip-sync-check 60 "$PY" -m actor_integration.tools.cli check "$WORK/demo-skip-sync/logs"
fi
if [[ $part == bench || $part == all ]]; then
    step bench_sleep_wake 300 "$PY" benchmarks/bench_sleep_wake.py --out "$WORK/bench_sleep_wake.json"
    step bench_sync 300 "$PY" benchmarks/bench_sync.py --out "$WORK/bench_sync.json"
fi
if [[ $part == phase || $part == all ]]; then
    # Issue 11: the phase-switch benchmark (slime-style vs ours), the Megatron 20-cycle leak check
    # and the process-group GPU tests, most important first (each step has its own time limit).
    TAIL=45 step bench_phase_switch "${PHASE_BENCH_S:-300}" "$PY" benchmarks/bench_phase_switch.py \
        --out "$WORK/bench_phase_switch.json" ${PHASE_BENCH_ARGS:-}
    TAIL=30 step pytest-test_megatron_cycles_gpu 90 "$PY" -m pytest -m gpu -q -s -p no:cacheprovider \
        tests/gpu/test_megatron_cycles_gpu.py
    for file in tests/gpu/test_process_groups_gpu.py tests/gpu/test_megatron_trainer_gpu.py; do
        step "pytest-$(basename "$file" .py)" 100 "$PY" -m pytest -m gpu -q -s -p no:cacheprovider "$file"
    done
    [[ -n ${OUT:-} ]] && cp "$WORK"/bench_phase_switch.json "$WORK"/megatron_cycles.json "$OUT"/ 2>/dev/null
fi
if [[ -n ${OUT:-} ]]; then
    tar -czf "$OUT/results-$part.tgz" -C "$WORK" . 2>/dev/null
    cp "$WORK/summary.txt" "$OUT/summary-$part.txt" 2>/dev/null
    [[ -f $WORK/demo/timeline.png ]] && cp "$WORK/demo/timeline.png" "$OUT/timeline.png"
    [[ -f $WORK/demo-skip-sync/timeline.png ]] && cp "$WORK/demo-skip-sync/timeline.png" "$OUT/timeline-skip-sync.png"
fi
cat "$WORK/summary.txt"
