#!/usr/bin/env bash
# vLLM 0.26.0 on the lent GPU machine: install the carried set, then the vLLM GPU checks, in a few
# back-to-back device calls (the protocol of scripts/gpu_slime.sh). Every step passed on an H100 on
# 2026-12-06 (docs/measurements.md, "vLLM 0.26.0 and vime's engine on one H100").
#
#   Here, once:     scripts/gpu_vllm.sh prepare   (make gpu-vllm-prepare; scripts/gpu_vllm_wheels.sh:
#                   the parts .gpuw/vllm/p1..pN, git-ignored, and the device calls to make)
#   On the device:  call K carrying .gpuw/vllm/pK, back to back (the machine is given back 30 s after
#                   a call); the calls after the last part carry nothing:   bash scripts/gpu_vllm.sh
#   A GPU host with vllm 0.26.0 installed: GPU_VLLM_INSTALLED=1 VLW=/where/it/is bash scripts/gpu_vllm.sh
#
# A call that carries a part copies it to $GPU_VLLM_STAGE (default /tmp/vlw-parts: /tmp stays while the
# machine is warm) and, while a part is missing, exits at once naming the part to carry next. Once all
# are there (each checked against the MANIFEST's sha256) it unpacks the wheels and installs them, once
# per machine, with pip --no-index --no-deps into $VLW/site (default $HOME/vlw/site, first on
# PYTHONPATH, then the repository). Then it runs the steps not yet done, in order, while its budget
# lasts (GPU_VLLM_BUDGET_S, default 560 of the 600 s a call may run; a step starts only if its usual
# time fits, and is cut at the budget's end):
#   imports   import vLLM's engine, worker, model, server, sleep-mode and weight-transfer modules and
#             the project's adapter; versions; its CUDA libraries load (_C, cumem allocator, FA3);
#             FA2 is stripped from the set, so: FA3 must be available and chosen
#             (get_flash_attn_version for the tiny model's head size 64 must be 3 on sm90); the set's
#             requirements against what is installed (gpu_vllm_set.py reqcheck; printed, not fatal)
#   tests     tests/gpu/test_vllm_gpu.py (sleep level 2 cycles, our sync and vLLM's IPC path, the
#             field's killers refused), its figures (vllm_*.json) kept; prints the attention backend
#             and FlashAttention version the first engine logged
#   http      tests/gpu/test_vllm_http_gpu.py: VLLMHTTPEngine on a real `vllm serve` (sleep mode, the
#             worker extension, IPC weight transfer) under VLLMRolloutActor: 20 level-2 cycles with our
#             sync, vLLM's IPC path over its HTTP routes, the killers refused, the server killed (typed
#             error); its figures (vllm_http_*.json), the server's log and the actor's lifecycle log kept
#   demo      lifecycle demo --engine vllm (a fault, a skipped sync, a corrupt round), lifecycle check
#   vime      tests/gpu/test_vime_rollout_gpu.py: vime's own VLLMEngine (its source: carry .vime-source,
#             git-ignored, in that call) plain and wrapped on a real `vllm serve` with sleep mode
#   bench     benchmarks/bench_vllm_sync.py: our sender next to vLLM's own IPC weight transfer, with
#             the device-to-device ceiling, at the 0.5B and 7B shapes (vllm_sync.json)
#   report    the table of every step so far (also written at the end of every call)
# GPU_VLLM_STEPS names the steps (default "imports tests http demo vime bench report"); a step runs once (its rc is
# in the table); GPU_VLLM_REDO="tests" runs it again.
# The table ends with the id of the code that ran (scripts/code_id.py; other code than the steps done
# before on the machine runs them again). Tables of several calls or machines, joined here:
#   python3 scripts/gpu_check_table.py --merge --steps "tests http vime bench" /work/.device/N/gpu-vllm.md ...
# What comes back in $OUT each call: gpu-vllm.md (the table), this call's step logs, and
# gpu-vllm-logs.tgz (every log so far, the tests' figures, the demo's logs). State in $WORK (default
# /tmp/gpu-vllm) on the warm machine.
# GPU_VLLM_DRY_RUN=1 prints each step's command instead of running it (the CPU tests use it).
set -u
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here" || exit 1
if [[ ${1:-} == prepare ]]; then
    exec bash scripts/gpu_vllm_wheels.sh
fi
if [[ $# -gt 0 ]]; then
    echo "scripts/gpu_vllm.sh: unknown argument '$1'; none on the GPU machine, or 'prepare' here" >&2
    exit 2
fi
started=$(date +%s)
budget=${GPU_VLLM_BUDGET_S:-560}
WORK=${WORK:-/tmp/gpu-vllm}
VLW=${VLW:-$HOME/vlw}
W=${GPU_VLLM_STAGE:-/tmp/vlw-parts}
PARTS=${GPU_VLLM_PARTS:-.gpuw/vllm}
PY=${PY:-python3}
mkdir -p "$WORK" "$WORK/gpu-out"

# Usual seconds of each step, measured on an H100 on 2026-12-06, a margin added: imports 41 s,
# tests 81 s, http 64-73 s, vime 68-82 s, demo 67 s, bench 127 s (two engine starts, 7B dummy weights).
declare -A usual=([imports]=60 [tests]=150 [http]=110 [demo]=150 [vime]=120 [bench]=200 [report]=10)
read -r -a steps <<<"${GPU_VLLM_STEPS:-imports tests http demo vime bench report}"
for s in "${steps[@]}"; do
    [[ -n ${usual[$s]:-} ]] || {
        echo "scripts/gpu_vllm.sh: unknown step '$s'; steps: imports tests http demo vime bench report" >&2
        exit 2
    }
done
for s in ${GPU_VLLM_REDO:-}; do sed -i "/^$s\$/d" "$WORK/done" 2>/dev/null; done
"$PY" scripts/code_id.py --pin "$WORK" # other code than the steps done on this machine: they run again

finish() { # the table, and what comes back (its loop must not touch the caller's step and rc)
    local s line rc secs
    {
        echo "| step | rc | seconds |"
        echo "| --- | --- | --- |"
        line=$(grep "^install " "$WORK/summary.txt" 2>/dev/null | tail -1)
        [[ -n $line ]] && read -r _ rc secs <<<"$line" && echo "| install | $rc | $secs |"
        for s in "${steps[@]}"; do
            line=$(grep "^$s " "$WORK/summary.txt" 2>/dev/null | tail -1)
            if [[ -n $line ]]; then
                read -r _ rc secs <<<"$line"
                echo "| $s | $rc | $secs |"
            else
                echo "| $s | not run | |"
            fi
        done
        grep -h "^attention:" "$WORK"/*.log 2>/dev/null | sort -u | sed 's/^/    /'
        cat "$WORK/code-id" 2>/dev/null
    } >"$WORK/gpu-vllm.md"
    cat "$WORK/gpu-vllm.md"
    if [[ -n ${OUT:-} ]]; then
        cp "$WORK/gpu-vllm.md" "$OUT/"
        for s in ${ran:-}; do cp "$WORK/$s.log" "$OUT/" 2>/dev/null; done
        tar -czf "$OUT/gpu-vllm-logs.tgz" --exclude='checkpoints' --exclude='*.safetensors' -C "$WORK" . 2>/dev/null
        cp "$WORK/demo-vllm/timeline.png" "$OUT/timeline-vllm.png" 2>/dev/null
    fi
    return 0
}

# --- stage and install --------------------------------------------------------------------------
install() {
    rm -rf "$W/wheels"
    "$PY" scripts/gpu_vllm_set.py unpack "$W" "$W/wheels" || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$VLW/site" "$W"/wheels/*.whl || return 1
    rm -rf "$W" # installed: the disk the parts held is free again
    touch "$VLW/.installed"
}
if [[ -z ${GPU_VLLM_INSTALLED:-} && ! -f $VLW/.installed ]]; then
    mkdir -p "$W"
    for d in "$PARTS"/p[0-9]*; do [[ -d $d ]] && cp "$d"/* "$W"/; done
    missing=$("$PY" scripts/gpu_vllm_set.py missing "$W") || {
        echo "the staged parts are not usable (above); carry them again, from p1"
        exit 1
    }
    if [[ -n $missing ]]; then
        read -r -a todo <<<"$missing"
        echo "staged: parts still missing: ${missing}; call again at once, carrying $PARTS/p${todo[0]}"
        exit 0
    fi
    t0=$SECONDS
    install >"$WORK/install.log" 2>&1
    rc=$?
    echo "install $rc $((SECONDS - t0))" >>"$WORK/summary.txt"
    echo "=== install: rc=$rc in $((SECONDS - t0)) s"
    tail -n 5 "$WORK/install.log"
    [[ $rc -eq 0 ]] || {
        finish
        exit 1
    }
fi

# --- the environment of every step --------------------------------------------------------------
export PYTHONPATH=$VLW/site:$here PATH=$VLW/site/bin:$PATH PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled LIFECYCLE_GPU_OUT=$WORK/gpu-out
# FlashInfer is not in the set (scripts/gpu_vllm_wheels.txt): vLLM's top-k/top-p sampler would import it.
export VLLM_USE_FLASHINFER_SAMPLER=0

imports() {
    "$PY" - <<'EOF'
import importlib, importlib.metadata as md, subprocess, sys, time, traceback
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
for dist in ["vllm", "transformers", "tokenizers", "numpy", "numba", "ray", "pydantic", "fastapi", "openai",
             "uvicorn", "compressed-tensors", "triton"]:
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} NOT INSTALLED")
failed = []
for module in ["vllm", "vllm._C_stable_libtorch", "vllm.cumem_allocator", "vllm.vllm_flash_attn._vllm_fa3_C",
               "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
               "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.models.qwen2",
               "vllm.v1.attention.backends.flash_attn", "vllm.v1.sample.sampler",
               "vllm.device_allocator.cumem", "vllm.distributed.weight_transfer.ipc_engine",
               "vllm.entrypoints.openai.api_server", "vllm.entrypoints.serve.dev.sleep.api_router",
               "ray", "torch_memory_saver", "actor_integration.engines.vllm.offline", "actor_integration.engines.vllm.http_engine",
               "actor_integration.engines.vllm.worker", "actor_integration.tools.cli"]:
    t0 = time.perf_counter()
    try:
        m = importlib.import_module(module)
        print(f"OK   {module} ({time.perf_counter() - t0:.1f} s) {getattr(m, '__file__', '')}")
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, none stops the list
        failed.append(module)
        print(f"FAIL {module}: {type(exc).__name__}: {exc}")
        traceback.print_exc(limit=-3)
        alone = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        print(f"     alone: rc={alone.returncode}", *alone.stderr.strip().splitlines()[-2:], sep="\n     ")
        if alone.returncode == 0:
            failed.remove(module)
# FA2 is stripped from the set: on sm90 vLLM must find FA3 and choose it (fa_utils.get_flash_attn_version).
try:
    from vllm.vllm_flash_attn import flash_attn_interface as fai
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    print(f"FA2_AVAILABLE={fai.FA2_AVAILABLE} ({fai.FA2_UNAVAILABLE_REASON}) FA3_AVAILABLE={fai.FA3_AVAILABLE}"
          f" ({fai.FA3_UNAVAILABLE_REASON})")
    version = get_flash_attn_version(head_size=64)
    print(f"attention: get_flash_attn_version(head_size=64) = {version} on sm{''.join(map(str, torch.cuda.get_device_capability()))}")
    if torch.cuda.get_device_capability()[0] == 9 and version != 3:
        failed.append("FA3 not chosen on sm90 (FA2 is stripped from the set)")
except BaseException as exc:  # noqa: BLE001
    failed.append(f"flash-attention check: {exc}")
    traceback.print_exc()
print("FAILED:", failed or "none")
sys.exit(1 if failed else 0)
EOF
    local rc=$?
    # informative only (the imports above decide): the image's versions are not all known beforehand
    "$PY" scripts/gpu_vllm_set.py reqcheck scripts/gpu_vllm_wheels.txt ||
        echo "reqcheck: a shipped wheel's requirement is unmet (above); not fatal, the imports decide"
    vllm --version || rc=1
    return "$rc"
}

run_step() { # run_step NAME: the step's commands (its output goes to $WORK/NAME.log)
    # the lifecycle logs of the actors a step's tests start come back with the logs (per-hook times)
    export RL_LIFECYCLE_LOG_DIR="$WORK/lifecycle-logs/$1"
    mkdir -p "$RL_LIFECYCLE_LOG_DIR"
    case $1 in
    imports) imports ;;
    tests) "$PY" -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_vllm_gpu.py ;;
    http) "$PY" -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_vllm_http_gpu.py ;;
    demo)
        "$PY" -m actor_integration.tools.cli demo --engine vllm --model-config configs/qwen2-tiny --steps 5 \
            --save-every 2 --skip-sync 2 --inject-fault rollout:memory.pause@3 --corrupt-sync 4 \
            --out "$WORK/demo-vllm" --no-progress || return $?
        echo "=== lifecycle check"
        "$PY" -m actor_integration.tools.cli check "$WORK/demo-vllm/logs"
        ;;
    vime)
        if [[ ! -f .vime-source/vime/backends/vllm_utils/vllm_engine.py ]]; then
            echo "vime: no .vime-source here: carry it in this call (scripts/export_vime.py makes it)"
            return 2
        fi
        RL_LIFECYCLE_VIME_SOURCE=$PWD/.vime-source "$PY" -m pytest -m gpu -q -s -p no:cacheprovider \
            tests/gpu/test_vime_rollout_gpu.py
        ;;
    bench) "$PY" benchmarks/bench_vllm_sync.py --out "$WORK/gpu-out/vllm_sync.json" ;;
    esac
}
export PY WORK

ran=""
for s in "${steps[@]}"; do
    grep -qx "$s" "$WORK/done" 2>/dev/null && continue
    left=$((budget - ($(date +%s) - started)))
    if ((left < usual[$s])); then
        echo "=== next call: $s and after (${left} s left of this call's ${budget}; $s usually takes ${usual[$s]} s)"
        break
    fi
    echo "=== $s (up to $left s)"
    t0=$SECONDS
    if [[ -n ${GPU_VLLM_DRY_RUN:-} ]]; then
        echo "dry run: $s" >"$WORK/$s.log"
        rc=0
    elif [[ $s == report ]]; then
        finish >"$WORK/report.log"
        rc=$?
    else
        timeout -k 20 "$left" bash -c "$(declare -f imports run_step); run_step $s" >"$WORK/$s.log" 2>&1
        rc=$?
    fi
    if [[ $s == tests ]]; then # the backend the first engine chose (FA2 is stripped from the set)
        grep -ohE "Using [A-Z_0-9]+ attention backend|Using FlashAttention version [0-9]+" "$WORK/tests.log" |
            sort -u | sed 's/^/attention: /' >"$WORK/attention.log"
        cat "$WORK/attention.log"
    fi
    echo "$s $rc $((SECONDS - t0))" >>"$WORK/summary.txt"
    echo "$s" >>"$WORK/done"
    ran="$ran $s"
    tail -n "${TAIL:-15}" "$WORK/$s.log"
    echo "=== $s: rc=$rc in $((SECONDS - t0)) s"
    if [[ $s == imports && $rc -ne 0 && -z ${GPU_VLLM_FORCE:-} ]]; then
        echo "=== stopped: an import failed ($WORK/imports.log); fix the set, or GPU_VLLM_FORCE=1 to go on"
        sed -i '/^imports$/d' "$WORK/done"
        break
    fi
done
finish
