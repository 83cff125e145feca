#!/usr/bin/env bash
# slime's own GRPO job (scripts/slime_e2e.sh) on the lent GPU machine, plain and wrapped, in a few
# back-to-back device calls (the protocol of scripts/gpu_check.sh).
#
#   Here, once:     scripts/gpu_slime.sh prepare   (make gpu-slime-prepare; scripts/gpu_slime_wheels.sh,
#                   whose header names the variables it needs: the parts .gpuw/slime/p1..pN, git-ignored,
#                   and the device calls to make, which it prints)
#   On the device:  call K carrying .gpuw/slime/pK, back to back (the machine is given back 30 s after
#                   a call); the calls after the last part carry nothing:   bash scripts/gpu_slime.sh
#   A GPU host of your own with the set installed: GPU_SLIME_INSTALLED=1 SLW=/where/it/is bash scripts/gpu_slime.sh
#
# Each call stages the part it carries; once every part is there it installs them (once per machine)
# into $SLW (default $HOME/slw, apart from scripts/gpu_sglang.sh's $HOME/sgw): site/ for the wheels (on
# slime's pin, SGLang's package then overlaid with the files slime's SGLang patches change),
# np1/ for numpy 1.26.4 (slime asserts numpy 1.x), src/ for slime and Megatron-LM. Only the processes
# of this script get PYTHONPATH=np1:site:repo:slime:Megatron-LM (the image's numpy 2 stays the
# default elsewhere). Then it
# runs the steps not yet done, in order, while its budget lasts (GPU_SLIME_BUDGET_S, default 560 of the
# 600 s a call may run; a step starts only if its usual time fits and is cut at the budget's end):
#   imports   import every module slime's driver and workers start from, and say what is missing (~30 s)
#   model     scripts/slime_e2e.sh model: the tiny Qwen2 and its prompts
#   plain     scripts/slime_e2e.sh plain: slime's train.py under `ray job submit`, colocated
#   wrapped   scripts/slime_e2e.sh wrapped: the same under the launch switch's hook
#   report    scripts/slime_e2e.sh report: slime's perf metrics side by side, `lifecycle check`, and
#             the fault jobs' results where they ran
# and optional steps, not in the default list (name them in GPU_SLIME_STEPS, after model; before report):
#   budget    scripts/slime_e2e.sh budget: wrapped with RL_LIFECYCLE_MEMORY_BUDGET=rollout (the trainer's
#             sleep frees only what SGLang needs), every push checked as in wrapped; report puts it
#             beside plain too
#   fault-hook scripts/slime_e2e.sh fault-hook: RL_LIFECYCLE_FAULT fails a trainer hook mid-job; the job
#             must stop on LifecycleFailedError naming the rank, the transition and the residency
#   fault-kill scripts/slime_e2e.sh fault-kill: SGLang's scheduler SIGKILLed mid-rollout; the job must
#             stop on EngineDiedError within a deadline, nothing of it left running
# A step runs once (its rc is in the table); GPU_SLIME_REDO="plain wrapped" runs those again, and
# GPU_SLIME_STEPS names the steps of this call. State in $WORK (default /tmp/gpu-slime) on the warm
# machine; the table (gpu-slime.md), the imports' output and the job logs (gpu-slime-logs.tgz) land
# in $OUT each call.
# The table ends with the id of the code that ran (scripts/code_id.py; other code than the steps done
# before on the machine runs them again); tables of several calls or machines join with
# `python3 scripts/gpu_check_table.py --merge --steps "plain wrapped budget" TABLE.md...`.
set -u
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here" || exit 1
if [[ ${1:-} == prepare ]]; then
    exec bash scripts/gpu_slime_wheels.sh
fi
if [[ $# -gt 0 ]]; then
    echo "scripts/gpu_slime.sh: unknown argument '$1'; none on the GPU machine, or 'prepare' here" >&2
    exit 2
fi
started=$(date +%s)
budget=${GPU_SLIME_BUDGET_S:-560}
# The set: slime (slime's pins, SGLang 0.5.15.post1) or slime-sglang-set (SGLang's own set, 0.5.17:
# `SLIME_SGLANG=set make gpu-slime-prepare`), its parts in .gpuw/$SET, each installed and run apart.
SET=${GPU_SLIME_SET:-slime}
case $SET in
slime) SLW=${SLW:-$HOME/slw} ;;
slime-sglang-set) SLW=${SLW:-$HOME/slw-$SET} ;;
*)
    echo "scripts/gpu_slime.sh: GPU_SLIME_SET must be slime or slime-sglang-set, got '$SET'" >&2
    exit 2
    ;;
esac
WORK=${WORK:-/tmp/gpu-$SET}
W=/tmp/$SET-parts
E2E=$WORK/e2e # scripts/slime_e2e.sh's OUT (this call's $OUT is what comes back)
mkdir -p "$WORK" "$E2E"

# Usual seconds of each step, as seen on an H100 (2026-12-06: imports 28-37, model 11-17; 2026-12-07,
# 6 steps, SGLang's CUDA graphs off, every push checked in wrapped and budget: model 20, plain 291,
# budget 212, wrapped 259, fault-kill 241 with 3 steps; later that day fault-hook 225, install 8,
# model 13), with room to spare.
declare -A usual=([imports]=60 [model]=40 [plain]=320 [wrapped]=290 [report]=30 [budget]=250 [fault-hook]=250 [fault-kill]=260)
read -r -a steps <<<"${GPU_SLIME_STEPS:-imports model plain wrapped report}"
for s in "${steps[@]}"; do
    [[ -n ${usual[$s]:-} ]] || {
        echo "scripts/gpu_slime.sh: unknown step '$s'; steps: imports model plain wrapped report (optional: budget fault-hook fault-kill)" >&2
        exit 2
    }
done
for s in ${GPU_SLIME_REDO:-}; do sed -i "/^$s\$/d" "$WORK/done" 2>/dev/null; done
python3 scripts/code_id.py --pin "$WORK" # other code than the steps done on this machine: they run again

finish() { # the table, and what comes back (its loop must not touch the caller's step and rc)
    local s line rc secs
    {
        echo "| step | rc | seconds |"
        echo "| --- | --- | --- |"
        for s in "${steps[@]}"; do
            line=$(grep "^$s " "$WORK/summary.txt" 2>/dev/null | tail -1)
            if [[ -n $line ]]; then
                read -r _ rc secs <<<"$line"
                echo "| $s | $rc | $secs |"
            else
                echo "| $s | not run | |"
            fi
        done
        cat "$WORK/code-id" 2>/dev/null
    } | tee "$WORK/gpu-slime.md"
    if [[ -n ${OUT:-} ]]; then
        cp "$WORK/gpu-slime.md" "$OUT/"
        cp "$WORK/imports.log" "$OUT/" 2>/dev/null
        cp "$E2E/report.txt" "$OUT/" 2>/dev/null
        tar -czf "$OUT/gpu-slime-logs.tgz" --exclude='ckpt-*' --exclude=tiny --exclude='cache-*' --exclude='session_*/sockets' \
            -C "$WORK" . 2>/dev/null
        [[ -d $SLW/tvmffi ]] && tar -czf "$OUT/tvmffi.tgz" -C "$SLW/tvmffi" . 2>/dev/null
    fi
}

# --- stage and install --------------------------------------------------------------------------
install() {
    rm -rf "$W/wheels" "$W/src"
    cat "$W"/all.tar.part* | tar -x -C "$W" || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SLW/site" "$W"/wheels/site/*.whl || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SLW/np1" "$W"/wheels/np1/*.whl || return 1
    if [[ -d $W/src/sglang-patch/sglang ]]; then # slime's SGLang patches, as slime's image has them
        cp -r "$W/src/sglang-patch/sglang/." "$SLW/site/sglang/" || return 1
        if [[ -f $W/src/sglang-patch/REMOVED ]]; then
            while read -r gone; do rm -f "$SLW/site/$gone"; done <"$W/src/sglang-patch/REMOVED"
        fi
        grep -v '^wrote ' "$W/src/sglang-patch/PATCHED"
    fi
    rm -rf "$SLW/src" && mv "$W/src" "$SLW/src" || return 1
    rm -rf "$W" # installed: the disk the parts held is free again
    touch "$SLW/.installed"
}
if [[ -z ${GPU_SLIME_INSTALLED:-} && ! -f $SLW/.installed ]]; then
    mkdir -p "$W"
    for d in .gpuw/$SET/p*; do [[ -d $d ]] && cp "$d"/* "$W"/; done
    parts=$(cat "$W/parts" 2>/dev/null || echo "?")
    have=$(find "$W" -maxdepth 1 -name 'all.tar.part*' | wc -l)
    if [[ $parts != "$have" ]]; then
        echo "staged $have of $parts parts: call again at once, carrying the next part (.gpuw/$SET/p$((have + 1)))"
        exit 0
    fi
    t0=$SECONDS
    install >"$WORK/install.log" 2>&1
    rc=$?
    echo "install rc=$rc $((SECONDS - t0))s" | tee -a "$WORK/summary.txt"
    tail -n 5 "$WORK/install.log"
    [[ $rc -eq 0 ]] || {
        finish
        exit 1
    }
fi

# --- the environment of slime's processes -------------------------------------------------------
# slime is no installed package here: its directory is on the path too (train.py's own directory is
# the driver's first entry, but nothing else puts it on the Ray workers' path).
export SLIME_DIR=$SLW/src/slime MEGATRON_DIR=$SLW/src/Megatron-LM PY=python3 RAY=$SLW/site/bin/ray
export PYTHONPATH=$SLW/np1:$SLW/site:$here:$SLIME_DIR:$MEGATRON_DIR PATH=$SLW/site/bin:$PATH
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TVM_FFI_CACHE_DIR=$SLW/tvmffi PYTHONUNBUFFERED=1
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled WANDB_MODE=offline
# SGLang's kernel wheel is slimmed to what sm90 loads with the triton attention backend (no FA3), and
# flashinfer's sampling would JIT-compile for minutes: pick the backends that need neither. SGLang's
# decode CUDA graphs are off: with the triton backend their capture took 75 s of each job's start
# (they do capture under torch_memory_saver's preload hook: seen on the first run).
export SLIME_E2E_EXTRA_ARGS=${SLIME_E2E_EXTRA_ARGS:---sglang-attention-backend triton --sglang-sampling-backend pytorch --sglang-disable-cuda-graph}
[[ -f .gpuw/$SET/tvmffi.tgz && ! -d $SLW/tvmffi ]] && mkdir -p "$SLW/tvmffi" && tar -xzf ".gpuw/$SET/tvmffi.tgz" -C "$SLW/tvmffi"

imports() { # each module slime's driver and workers start from, on its own: every failure is listed
    python3 - <<'EOF'
import importlib, importlib.metadata as md, subprocess, sys, time, traceback
import numpy
print("python", sys.version.split()[0], "numpy", numpy.__version__, numpy.__file__)
for dist in ["torch", "sglang", "sglang-kernel", "flashinfer-python", "transformers", "tokenizers", "ray",
             "sglang-router", "torch-memory-saver", "wandb", "xgrammar"]:
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} NOT INSTALLED")
failed = []
for module in ["slime.ray.placement_group", "slime.ray.rollout", "slime.backends.megatron_utils.actor",
               "slime.backends.sglang_utils.sglang_engine", "slime.utils.arguments",
               "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler", "sglang_router",
               "sglang_router.launch_router", "megatron.training", "megatron.core", "torch_memory_saver",
               "wandb", "tensorboard", "pylatexenc", "ray.dashboard.optional_deps",
               "actor_integration.frameworks.launch", "actor_integration.models.megatron_spec"]:
    t0 = time.perf_counter()
    try:
        m = importlib.import_module(module)
        print(f"OK   {module} ({time.perf_counter() - t0:.1f} s) {getattr(m, '__file__', '')}")
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, none stops the list
        failed.append(module)
        print(f"FAIL {module}: {type(exc).__name__}: {exc}")
        traceback.print_exc(limit=-3)
        # an earlier failure can leave half-imported modules behind: its own error, in a fresh process
        alone = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        print(f"     alone: rc={alone.returncode}", *alone.stderr.strip().splitlines()[-2:], sep="\n     ")
        if alone.returncode == 0:  # it fails only after another module's failure
            failed.remove(module)
assert numpy.__version__.startswith("1."), f"slime asserts numpy 1.x; got {numpy.__version__}"
import sglang_router
print("sglang_router", getattr(sglang_router, "__version__", "?"))
try:
    from actor_integration.backends.tms_capabilities import saver_capabilities

    print("torch_memory_saver:", saver_capabilities().describe())
except Exception as exc:  # noqa: BLE001
    print(f"torch_memory_saver: capabilities not read: {exc}")
for module in ["scipy", "pandas"]:  # the image's, under numpy 1.26: nothing on slime's path imports them at load
    try:
        importlib.import_module(module)
        print(f"info: the image's {module} imports under numpy {numpy.__version__}")
    except BaseException as exc:  # noqa: BLE001
        print(f"info: the image's {module} does not import under numpy {numpy.__version__}: {exc}")
print(subprocess.run([sys.executable, "-c", "import ray; print('ray', ray.__version__)"], capture_output=True, text=True).stdout.strip())
print("FAILED:", failed or "none")
sys.exit(1 if failed else 0)
EOF
    local rc=$?
    "$RAY" --version || rc=1
    return "$rc"
}

for s in "${steps[@]}"; do
    grep -qx "$s" "$WORK/done" 2>/dev/null && continue
    left=$((budget - ($(date +%s) - started)))
    if ((left < usual[$s])); then
        echo "=== next call: $s and after (${left} s left of this call's ${budget}; $s usually takes ${usual[$s]} s)"
        break
    fi
    echo "=== $s (up to $left s)"
    t0=$SECONDS
    case $s in
    imports) timeout -k 10 "$left" bash -c "$(declare -f imports); imports" >"$WORK/imports.log" 2>&1 ;;
    *) OUT=$E2E timeout -k 20 "$left" bash scripts/slime_e2e.sh "$s" >"$WORK/$s.out" 2>&1 ;;
    esac
    rc=$?
    echo "$s $rc $((SECONDS - t0))" >>"$WORK/summary.txt"
    echo "$s" >>"$WORK/done"
    log=$WORK/$s.out
    [[ $s == imports ]] && log=$WORK/imports.log
    tail -n "${TAIL:-15}" "$log"
    [[ $s == report ]] && cp "$log" "$E2E/report.txt"
    echo "=== $s: rc=$rc in $((SECONDS - t0)) s"
    if [[ $s == imports && $rc -ne 0 && -z ${GPU_SLIME_FORCE:-} ]]; then
        echo "=== stopped: an import failed (imports.log); fix the set, or GPU_SLIME_FORCE=1 to go on"
        sed -i '/^imports$/d' "$WORK/done"
        break
    fi
done
finish
