#!/usr/bin/env bash
# On the GPU machine: the real-SGLang checks, by part, in the order given:
#   stage     copy the carried wheel parts (.gpuw/p*, made here by scripts/gpu_wheels.sh) to /tmp/gpuw
#   install   join the parts and install them (once per machine): SGLang's set into $HOME/sgw/site,
#             the project's and Ray's into $HOME/sgw/proj-site where the image lacks them
#   tests     tests/gpu/test_sglang_gpu.py (CUDA graphs, 20+ cycles, release audit, faults, timing)
#   bench     benchmarks/bench_sglang_sync.py (our sync vs slime's into the same engine, 0.5B and 7B)
#   demo      lifecycle demo --engine sglang (a fault, a skipped sync, a corrupt round), lifecycle check
#   demoplain lifecycle demo --engine sglang with no faults or flags (4 steps), lifecycle check
#   probeorder benchmarks/probe_sglang_release_order.py (which of the sync bench's old steps ended
#             SGLang's scheduler: a sleep before any generate, or the sender freed before the
#             schedulers let go of its staging)
#   kill      lifecycle demo --engine sglang --kill-engine 2 (SGLang's scheduler killed), lifecycle check
#   budget    lifecycle demo on the GPU (reference engine, real torch_memory_saver) with the memory
#             budget (its default) and with --no-memory-budget, same arguments, lifecycle check on each
#   probe     benchmarks/probe_resume_after_release.py (why a resume right after another process's
#             large release runs slow; no SGLang needed)
#   budgetbench  benchmarks/bench_phase_switch.py's memory-budget columns beside the full sleep, and
#             budget-part-sm (the partial need with `params` restored by the SMs: device_restore)
#   tmsgpu    tests/gpu/test_memory_saver_gpu.py (the adapter on the real library; device_restore)
#   packprobe benchmarks/probe_sender_pack.py (the cuda_ipc sender's host time before the hand-over)
#   wsync     tests/gpu/test_weight_sync_gpu.py (the cuda_ipc transport: handles, integrity, layouts,
#             exports past torch's 1,000 IPC events; no SGLang needed)
#   slime     tests/gpu/test_slime_rollout_gpu.py: slime's SGLangEngine (its source exported here to
#             .gpuw/r33/slime with FrameworkSource.export, never committed) as a wrapped Ray actor on
#             a real server, slime's push and ours; lifecycle check on the actor's log
#   miles     tests/gpu/test_miles_rollout_gpu.py: the same tests on miles' SGLangEngine (source in
#             .gpuw/r33/miles, exported the same way)
#   areal     tests/gpu/test_areal_rollout_gpu.py: AReaL's own RemoteSGLangEngine (the files it imports
#             in .gpuw/r33/areal, exported the same way) on a stock SGLang server, plain and under
#             ArealRolloutMixin: the colocate switch timed, AReaL's field failures; lifecycle check on
#             the wrapped engines' log
# e.g. `bash scripts/gpu_sglang.sh stage install tests bench`. Each step's output goes to
# $WORK/<step>.log (default /tmp/gpu-sglang); the tail is printed; results-*.tgz lands in $OUT.
set -u
W=/tmp/gpuw
SITE=$HOME/sgw/site
PSITE=$HOME/sgw/proj-site
WORK=${WORK:-/tmp/gpu-sglang}
PY=${PY:-python3}
mkdir -p "$WORK"
export PYTHONPATH=$SITE:$PSITE:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TVM_FFI_CACHE_DIR=$HOME/sgw/tvmffi
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 LIFECYCLE_GPU_OUT=$WORK
export RL_LIFECYCLE_SLIME_SOURCE=${RL_LIFECYCLE_SLIME_SOURCE:-$PWD/.gpuw/r33/slime}
export RL_LIFECYCLE_MILES_SOURCE=${RL_LIFECYCLE_MILES_SOURCE:-$PWD/.gpuw/r33/miles}
export RL_LIFECYCLE_AREAL_SOURCE=${RL_LIFECYCLE_AREAL_SOURCE:-$PWD/.gpuw/r33/areal}

step() {
    local name=$1 limit=$2
    shift 2
    if [[ -n ${DEADLINE:-} ]]; then # the calling command's own limit (scripts/gpu_check.sh)
        local left=$((DEADLINE - $(date +%s) - 5))
        ((left < limit)) && limit=$((left > 10 ? left : 10))
    fi
    echo "=== $name: $*"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start)) s"
    tail -n "${TAIL:-15}" "$WORK/$name.log"
    echo "$name rc=$rc $((SECONDS - start))s" >>"$WORK/summary.txt"
    [[ -n ${OUT:-} ]] && tar -czf "$OUT/results.tgz" --exclude=checkpoints --exclude=timeline.png -C "$WORK" . 2>/dev/null
    return 0
}

stage() {
    mkdir -p "$W"
    for d in .gpuw/p*; do [[ -d $d ]] && cp "$d"/* "$W"/; done
    ls "$W"
}

install() {
    [[ -f $HOME/sgw/.installed ]] && return 0
    cat "$W"/all.tar.part* | tar -x -C "$W" || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$W"/wheels/*.whl || return 1
    local missing=()
    for whl in "$W"/wheels/project/*.whl; do
        local name
        name=$(basename "$whl" | cut -d- -f1)
        PYTHONPATH=$SITE "$PY" -c 'import importlib.metadata as m, sys; m.version(sys.argv[1])' "$name" \
            2>/dev/null || missing+=("$whl")
    done
    echo "installing ${#missing[@]} project wheels the image lacks: ${missing[*]##*/}"
    [[ ${#missing[@]} -eq 0 ]] || "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$PSITE" \
        "${missing[@]}" || return 1
    [[ -f .gpuw/tvmffi.tgz ]] && mkdir -p "$TVM_FFI_CACHE_DIR" && tar -xzf .gpuw/tvmffi.tgz -C "$TVM_FFI_CACHE_DIR"
    rm -rf "$W"/wheels "$W"/all.tar.part* # installed: the disk they held is free again
    touch "$HOME/sgw/.installed"
    "$PY" -c 'import sglang, ray, torch, torch_memory_saver; print("sglang", sglang.__version__, "ray", ray.__version__, "torch", torch.__version__)'
}

for part in "$@"; do
    case $part in
    stage) stage ;;
    install)
        start=$SECONDS
        install >"$WORK/install.log" 2>&1
        rc=$?
        echo "=== install: rc=$rc in $((SECONDS - start)) s"
        tail -n 5 "$WORK/install.log"
        echo "install rc=$rc $((SECONDS - start))s" >>"$WORK/summary.txt"
        [[ $rc -eq 0 ]] || break
        ;;
    tests)
        TAIL=40 step test_sglang_gpu 380 "$PY" -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_sglang_gpu.py
        ;;
    bench)
        TAIL=30 step bench_sglang_sync 320 "$PY" benchmarks/bench_sglang_sync.py --out "$WORK/bench_sglang_sync.json"
        ;;
    demo)
        TAIL=45 step demo_sglang 280 "$PY" -m actor_integration.tools.cli demo --engine sglang \
            --model-config configs/qwen2-tiny --steps 5 --save-every 2 --skip-sync 2 \
            --inject-fault rollout:memory.pause@3 --corrupt-sync 4 --out "$WORK/demo-sglang" --no-progress
        step demo_sglang_check 40 "$PY" -m actor_integration.tools.cli check "$WORK/demo-sglang/logs"
        [[ -n ${OUT:-} ]] && cp "$WORK"/demo-sglang/timeline.png "$OUT"/timeline-sglang.png 2>/dev/null
        ;;
    demoplain)
        TAIL=45 step demo_sglang_plain 240 "$PY" -m actor_integration.tools.cli demo --engine sglang \
            --model-config configs/qwen2-tiny --steps 4 --out "$WORK/demo-plain" --no-progress
        step demo_sglang_plain_check 40 "$PY" -m actor_integration.tools.cli check "$WORK/demo-plain/logs"
        ;;
    probeorder)
        TAIL=30 step probe_release_order 240 "$PY" benchmarks/probe_sglang_release_order.py \
            --out "$WORK/probe_release_order.json"
        ;;
    kill)
        TAIL=30 step demo_sglang_kill 200 "$PY" -m actor_integration.tools.cli demo --engine sglang \
            --model-config configs/qwen2-tiny --steps 3 --kill-engine 2 --out "$WORK/demo-kill" --no-progress
        step demo_sglang_kill_check 40 "$PY" -m actor_integration.tools.cli check "$WORK/demo-kill/logs"
        ;;
    budget)
        for way in budget no-budget; do
            flag=""
            [[ $way == no-budget ]] && flag=--no-memory-budget
            TAIL=30 step "demo_$way" 150 "$PY" -m actor_integration.tools.cli demo --steps 5 --save-every 2 \
                --inject-fault memory.pause@3 --skip-sync 2 --hidden 1024 --layers 8 $flag \
                --out "$WORK/demo-$way" --no-progress
            step "demo_${way}_check" 40 "$PY" -m actor_integration.tools.cli check "$WORK/demo-$way/logs"
        done
        ;;
    probe)
        TAIL=40 step probe_resume 300 "$PY" benchmarks/probe_resume_after_release.py \
            --out "$WORK/probe_resume.json"
        ;;
    packprobe)
        TAIL=60 step probe_sender_pack 200 "$PY" benchmarks/probe_sender_pack.py --out "$WORK/probe_sender_pack.json"
        ;;
    tmsgpu)
        TAIL=20 step test_memory_saver_gpu 300 "$PY" -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_memory_saver_gpu.py
        ;;
    wsync)
        TAIL=20 step test_weight_sync_gpu 300 "$PY" -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_weight_sync_gpu.py
        ;;
    budgetbench)
        TAIL=40 step bench_budget 360 "$PY" benchmarks/bench_phase_switch.py --no-teardown --ways '' --sm-restore \
            --columns budget-fits,budget-part,budget-part-sm,budget-all,full-kv-all --timeout 90 \
            --out "$WORK/bench_budget.json"
        ;;
    slime)
        TAIL=40 step test_slime_rollout_gpu 420 \
            "$PY" -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_slime_rollout_gpu.py
        step slime_rollout_check 40 "$PY" -m actor_integration.tools.cli check "$WORK/rollout-logs"
        ;;
    miles)
        TAIL=40 step test_miles_rollout_gpu 420 \
            "$PY" -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_miles_rollout_gpu.py
        step miles_rollout_check 40 "$PY" -m actor_integration.tools.cli check "$WORK/miles-rollout-logs"
        ;;
    areal)
        TAIL=40 step test_areal_rollout_gpu 420 \
            "$PY" -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_areal_rollout_gpu.py
        step areal_rollout_check 40 "$PY" -m actor_integration.tools.cli check "$WORK/areal-rollout-logs"
        ;;
    *) echo "unknown part $part" ;;
    esac
done
if [[ -n ${OUT:-} ]]; then
    cp "$WORK/summary.txt" "$OUT/summary.txt" 2>/dev/null
    cat "$WORK"/sglang_*.json "$WORK"/slime_*.json "$WORK"/miles_*.json "$WORK"/areal_*.json \
        "$WORK"/bench_sglang_sync.json >"$OUT/figures.txt" 2>/dev/null
    [[ -d $TVM_FFI_CACHE_DIR ]] && tar -czf "$OUT/tvmffi.tgz" -C "$TVM_FFI_CACHE_DIR" . 2>/dev/null
fi
cat "$WORK/summary.txt" 2>/dev/null
