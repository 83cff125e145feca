#!/usr/bin/env bash
# The GPU regression command: every GPU path of the rollout side a change can break, in as few
# device calls as fit, and one summary table (each step, pass or fail, its headline figure).
# Every change to code these paths run goes through it on its final commit (`make gpu-check`).
#
#   Here, once:     scripts/gpu_check.sh prepare
#                   (SGLANG_GPU names the directory of the SGLang wheel set's fetch_wheels.sh; RL_LIFECYCLE_SLIME_SOURCE,
#                   RL_LIFECYCLE_MILES_SOURCE and RL_LIFECYCLE_AREAL_SOURCE the frameworks' sources: the wheel
#                   parts .gpuw/p1..pN and the engine sources .gpuw/r33, all git-ignored)
#   On the device:  call after call, back to back (the machine is given back 30 s after a call),
#                   call K carrying .gpuw/pK (and .gpuw/r33), the calls after the last part
#                   carrying .gpuw/r33 only:   bash scripts/gpu_check.sh
#   A GPU host of your own, with SGLang and the project installed:
#                   GPU_CHECK_INSTALLED=1 bash scripts/gpu_check.sh
#   Here, after:    scripts/gpu_check.sh merge /work/.device/N/gpu-check.md ...
#                   joins the tables of several calls (one machine or several, one session or several:
#                   GPU_CHECK_STEPS="slime miles areal" on a fresh machine runs what an earlier one
#                   did not reach) and says whether every step passed on this tree's code; a table
#                   that ran other code counts for nothing (exit 0 only when every step passed)
#
# Each call stages the part it carries, installs once every part is there, then runs the steps not
# yet done, most important first, while its budget lasts (GPU_CHECK_BUDGET_S, default 540 of the
# 600 s a device call may run; a step starts only if its usual time fits, and is cut at the
# budget's end). The state is kept in $WORK (default /tmp/gpu-check) on the warm machine. The
# table of every step so far is printed last and written to $OUT/gpu-check.md with the logs; its
# last line is the id of the code that ran (scripts/code_id.py). A call that finds other code than
# the steps done before it on the machine (the tree changed between calls) runs them again.
# GPU_CHECK_STEPS overrides the steps (names of scripts/gpu_sglang.sh's parts).
set -u
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
export WORK=${WORK:-/tmp/gpu-check}
mkdir -p "$WORK"
started=$(date +%s)
budget=${GPU_CHECK_BUDGET_S:-540}
every_step="bench demo demoplain tests wsync kill probeorder slime miles areal"

if [[ ${1:-} == prepare ]]; then
    bash scripts/gpu_wheels.sh
    echo "then, back to back: run(carry=['.gpuw/pK', '.gpuw/r33'], command='bash scripts/gpu_check.sh') for each part K, and again with .gpuw/r33 until the table says every step ran"
    exit 0
fi
if [[ ${1:-} == merge ]]; then
    shift
    exec python3 scripts/gpu_check_table.py --merge --steps "${GPU_CHECK_STEPS:-$every_step}" "$@"
fi
if [[ $# -gt 0 ]]; then
    echo "scripts/gpu_check.sh: unknown argument '$1'; use no argument on the GPU machine, 'prepare' or 'merge' here" >&2
    exit 2
fi
python3 scripts/code_id.py --pin "$WORK" # other code than the steps done on this machine: they run again

# The usual seconds of each step (measured on an H100, sglang 0.5.17, 2026-12-06, whole runs at
# da506b8 and c4d6fe5; areal 127 s at c4d6fe5): a step starts only if these fit.
declare -A usual=([bench]=115 [demo]=200 [demoplain]=120 [tests]=95 [wsync]=70 [kill]=120 [probeorder]=70
    [slime]=200 [miles]=210 [areal]=150)
read -r -a steps <<<"${GPU_CHECK_STEPS:-$every_step}"
for s in "${steps[@]}"; do
    [[ -n ${usual[$s]:-} ]] || {
        echo "scripts/gpu_check.sh: unknown step '$s' in GPU_CHECK_STEPS; steps: ${!usual[*]}" >&2
        exit 2
    }
done

table() {
    python3 scripts/gpu_check_table.py "$WORK" "${steps[@]}" | tee "$WORK/gpu-check.md"
    if [[ -n ${OUT:-} ]]; then
        cp "$WORK/gpu-check.md" "$OUT/"
        tar -czf "$OUT/gpu-check-logs.tgz" --exclude=checkpoints --exclude='*.png' -C "$WORK" . 2>/dev/null
    fi
}

if [[ -z ${GPU_CHECK_INSTALLED:-} && ! -f $HOME/sgw/.installed ]]; then
    bash scripts/gpu_sglang.sh stage >/dev/null
    parts=$(cat /tmp/gpuw/parts 2>/dev/null || echo "?")
    have=$(find /tmp/gpuw -maxdepth 1 -name 'all.tar.part*' | wc -l)
    if [[ $parts != "$have" ]]; then
        echo "staged $have of $parts wheel parts: call again at once, carrying the next part"
        exit 0
    fi
    bash scripts/gpu_sglang.sh install | tail -n 3
fi

for s in "${steps[@]}"; do
    grep -qx "$s" "$WORK/done" 2>/dev/null && continue
    left=$((budget - ($(date +%s) - started)))
    if ((left < usual[$s])); then
        echo "=== next call: $s and after (${left} s left of this call's ${budget}; $s usually takes ${usual[$s]} s)"
        break
    fi
    DEADLINE=$((started + budget)) TAIL=${TAIL:-8} bash scripts/gpu_sglang.sh "$s" >"$WORK/step-$s.out" 2>&1
    tail -n 4 "$WORK/step-$s.out"
    echo "$s" >>"$WORK/done"
done
table
