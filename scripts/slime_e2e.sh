#!/usr/bin/env bash
# slime's own GRPO job on one GPU, plain and under the lifecycle's launch switch, side by side.
#
# STATUS: ran on one H100 (scripts/gpu_slime.sh, SGLang 0.5.15.post1, SGLang's CUDA graphs off) on
# 2026-12-06 (5 steps, plain and wrapped) and on 2026-12-07 (6 steps, lr 1e-4, the reward `random`):
# plain, wrapped and budget finished every step, every push checked equal, and fault-kill stopped on
# EngineDiedError with nothing left running; fault-hook (2026-12-07, later) stopped on
# LifecycleFailedError, nothing left running; docs/measurements.md has the tables. Those runs had
# SGLang 0.5.15.post1 without slime's SGLang patches (its image applies them; the set now carries
# them: scripts/slime_sglang_patch.py), not yet run on a GPU with them. Its launch, flags and driver
# order are also what tests/actor_integration/frameworks/slime/test_slime_job_source.py runs on a CPU with stand-ins.
#
# Usage (on the GPU machine, from the repository root):
#   SLIME_DIR=/path/to/slime MEGATRON_DIR=/path/to/Megatron-LM \
#   scripts/slime_e2e.sh [model|plain|wrapped|report|all|fault-hook|fault-kill]
#
# SLIME_DIR     a checkout of slime at 624b824a (its train.py is run as it is)
# MEGATRON_DIR  Megatron-LM at slime's Dockerfile pin (1dcf0daf): `fetch github:NVIDIA/Megatron-LM`
# SLIME_E2E_SPEC slime's --spec MODULE FUNCTION (default: actor_integration.models.megatron_spec
#               gpt_layer_spec, this project's layer spec without Transformer Engine: the norms inside
#               the QKV and FC1 linears under TE's names, core attention on torch SDPA per packed
#               sequence; tests/actor_integration/models/test_megatron_spec.py holds it to Qwen2's
#               logits and to slime's own qwen2 converter on CPU). Megatron's local spec alone fails
#               slime's packed sequences and its qwen2 converters.
# OUT           where everything goes (default out/slime-e2e)
# STEPS         rollout + train steps (default 6; a save every 2: slime #1886's path)
# SLIME_E2E_EXTRA_ARGS more of slime's flags, appended (e.g. SGLang's backends where its kernels are
#               slimmed: scripts/gpu_slime.sh passes --sglang-attention-backend triton)
# PY, RAY       the Python and the `ray` command (default python3, ray). The jobs' PYTHONPATH is
#               MEGATRON_DIR, this repository, then the caller's PYTHONPATH (Ray's env_vars replace
#               the workers' own, so packages installed off the default path must be on it here;
#               scripts/gpu_slime.sh puts numpy 1.26 and the carried wheels there).
#
# What each job is: slime's train.py under `ray job submit`, --colocate (both offloads) on one GPU, a
# tiny Qwen2 made here (scripts/make_tiny_qwen2.py: no hub), a generated prompt set, slime's reward
# `random` (no network; GRPO gets advantages on a random model), --check-weight-update-equal (slime
# checks the first push only), tensorboard offline. "wrapped" differs from "plain" by
# the runtime env alone: the launch switch's hook, RL_LIFECYCLE_WRAP=trainer,rollout, and
# RL_LIFECYCLE_CHECK_WEIGHTS=every (every later push checked with slime's own calls: its cost is in
# the wrapped step time, and apart in perf/lifecycle_weights_check_time).
#
# Faults inside the job (not in `all`; each a wrapped job of FAULT_STEPS rollouts, default 3, that
# must stop on a typed error): "fault-hook" sets RL_LIFECYCLE_FAULT=$FAULT_HOOK (default
# trainer:memory.pause@3, the trainer's third pause: the sleep that ends rollout 1's train) and
# expects LifecycleFailedError naming the rank, the transition and the residency; "fault-kill"
# SIGKILLs SGLang's scheduler (pgrep -f sglang::scheduler) once the job's log shows rollout
# $FAULT_KILL_ROLLOUT (default 1) starting, its responses made long (FAULT_KILL_ARGS) so the kill lands
# mid-rollout, and expects EngineDiedError. Each records in $OUT/NAME.result the job's rc, its
# seconds (and, for the kill, the seconds from the kill to the job's end), the typed error line, the
# job's SGLang/Megatron processes left (pgrep, waited for up to 60 s before Ray is stopped, and again
# after) and `lifecycle check` on its logs ($OUT/lifecycle-logs-NAME); `report` prints them. The step
# fails unless the job failed on the typed error, and nothing of it was left running.
set -euo pipefail

REPO="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
: "${SLIME_DIR:=}" "${MEGATRON_DIR:=}"
need_sources() {
  [ -n "$SLIME_DIR" ] || { echo "set SLIME_DIR to a checkout of slime at 624b824a" >&2; exit 2; }
  [ -n "$MEGATRON_DIR" ] || { echo "set MEGATRON_DIR to Megatron-LM at the commit slime pins" >&2; exit 2; }
}
OUT="${OUT:-$REPO/out/slime-e2e}"
STEPS="${STEPS:-6}"
FAULT_STEPS="${FAULT_STEPS:-3}"
FAULT_HOOK="${FAULT_HOOK:-trainer:memory.pause@3}"
FAULT_KILL_ROLLOUT="${FAULT_KILL_ROLLOUT:-1}"
FAULT_KILL_ARGS="${FAULT_KILL_ARGS:---rollout-max-response-len 1024}"
PY="${PY:-python3}"
RAY="${RAY:-ray}"
mkdir -p "$OUT"

model() {
  "$PY" "$REPO/scripts/make_tiny_qwen2.py" "$OUT/tiny" --hidden 256 --layers 2 --vocab 2048 --prompts 256
}

slime_args() {  # the job's flags, slime's names (the model's must match make_tiny_qwen2.py's config)
  local name="$1"
  local SLIME_E2E_SPEC="${SLIME_E2E_SPEC:-actor_integration.models.megatron_spec gpt_layer_spec}"
  # shellcheck disable=SC2206  # the spec is two words on purpose
  local spec=($SLIME_E2E_SPEC)
  ARGS=(
    --actor-num-nodes 1 --actor-num-gpus-per-node 1 --num-gpus-per-node 1
    --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1 --colocate
    --hf-checkpoint "$OUT/tiny/model" --ref-load "$OUT/tiny/model"
    --save "$OUT/ckpt-$name" --save-interval 2
    --prompt-data "$OUT/tiny/prompts.jsonl" --input-key prompt --label-key label --apply-chat-template
    --rm-type random --num-rollout "$STEPS" --rollout-batch-size 8 --n-samples-per-prompt 4
    --global-batch-size 32 --rollout-max-response-len 64 --rollout-temperature 1 --seed 1234
    --advantage-estimator grpo --optimizer adam --lr 1e-4 --lr-decay-style constant
    --num-layers 2 --hidden-size 256 --ffn-hidden-size 768 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --norm-epsilon 1e-6 --rotary-base 10000
    --swiglu --disable-bias-linear --add-qkv-bias --normalization RMSNorm --position-embedding-type rope
    --transformer-impl local --spec "${spec[@]}"
    --no-rope-fusion --no-gradient-accumulation-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion
    --no-masked-softmax-fusion --no-persist-layer-norm --attention-dropout 0.0 --hidden-dropout 0.0
    --sglang-mem-fraction-static 0.4 --check-weight-update-equal
    --use-tensorboard --tb-project-name "slime-e2e-$name"
  )
  # shellcheck disable=SC2206  # extra flags are words on purpose
  [ -z "${SLIME_E2E_EXTRA_ARGS:-}" ] || ARGS+=($SLIME_E2E_EXTRA_ARGS)
}

RAY_PID=""
ray_up() {  # a head of our own, stopped by its pid (nothing else on the machine is touched)
  local temp="$OUT/ray-$1"
  rm -rf "$temp"
  "$RAY" start --head --block --node-ip-address 127.0.0.1 --num-gpus 1 --num-cpus 8 --disable-usage-stats \
    --temp-dir "$temp" >"$OUT/ray-$1.log" 2>&1 &
  RAY_PID=$!
  for _ in $(seq 120); do grep -q "will now block" "$OUT/ray-$1.log" && return 0; sleep 1; done
  echo "ray start --head did not come up: $OUT/ray-$1.log" >&2
  return 1
}

ray_down() {
  [ -n "$RAY_PID" ] || return 0
  kill -TERM "$RAY_PID" 2>/dev/null || true
  wait "$RAY_PID" 2>/dev/null || true
  RAY_PID=""
}

runtime_env() {  # runtime_env NAME [LOGS [EXTRA]]: the job's runtime env JSON in RUNTIME; wrapped when
  # LOGS (its RL_LIFECYCLE_LOG_DIR) is given, EXTRA more env_vars (', "NAME": "VALUE"')
  local name="$1" logs="${2:-}" extra="${3:-}"
  local env_vars
  # Each job compiles its kernels into caches of its own, emptied first: a job run after another would
  # otherwise find Triton's kernels (SGLang's triton attention) compiled, and its first step be faster.
  rm -rf "$OUT/cache-$name"
  env_vars=$(printf '"PYTHONPATH": "%s:%s%s", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TENSORBOARD_DIR": "%s", "TRITON_CACHE_DIR": "%s", "TORCHINDUCTOR_CACHE_DIR": "%s"' \
    "$MEGATRON_DIR" "$REPO" "${PYTHONPATH:+:$PYTHONPATH}" "$OUT/tb-$name" "$OUT/cache-$name/triton" \
    "$OUT/cache-$name/inductor")
  if [ -n "$logs" ]; then
    RUNTIME=$(printf '{"worker_process_setup_hook": "actor_integration.frameworks.launch.slime", "env_vars": {%s, "RL_LIFECYCLE_WRAP": "trainer,rollout", "RL_LIFECYCLE_LOG_DIR": "%s"%s}}' \
      "$env_vars" "$logs" "$extra")
    rm -rf "$logs"
  else
    RUNTIME=$(printf '{"env_vars": {%s}}' "$env_vars")
  fi
}

lifecycle_logs() {  # lifecycle_logs NAME: where job NAME's ranks write their lifecycle logs (the wrapped
  # job's without a suffix, as the runs before the budget and fault jobs wrote them)
  if [ "$1" = wrapped ]; then echo "$OUT/lifecycle-logs"; else echo "$OUT/lifecycle-logs-$1"; fi
}

job() {  # job NAME [wrapped]: one run of slime's train.py; its output in $OUT/NAME.log. wrapped: with
  # RL_LIFECYCLE_CHECK_WEIGHTS=every (each later push checked as slime checks the first). NAME budget:
  # the same with RL_LIFECYCLE_MEMORY_BUDGET=rollout, its logs in $OUT/lifecycle-logs-budget
  local name="$1" wrapped="${2:-}"
  need_sources
  slime_args "$name"
  local RUNTIME runtime
  local check=', "RL_LIFECYCLE_CHECK_WEIGHTS": "every"'  # every push after slime's checked first one
  if [ "$name" = budget ]; then
    runtime_env "$name" "$(lifecycle_logs "$name")" ', "RL_LIFECYCLE_MEMORY_BUDGET": "rollout"'"$check"
  elif [ -n "$wrapped" ]; then
    runtime_env "$name" "$(lifecycle_logs "$name")" "$check"
  else
    runtime_env "$name"
  fi
  runtime=$RUNTIME
  ray_up "$name"
  trap ray_down EXIT INT TERM
  (cd "$SLIME_DIR" && "$RAY" job submit --address="http://127.0.0.1:8265" --runtime-env-json="$runtime" \
    -- "$PY" "$SLIME_DIR/train.py" "${ARGS[@]}") 2>&1 | tee "$OUT/$name.log"
  ray_down
  trap - EXIT INT TERM
}

leftovers() {  # leftovers WAIT_S: the job's SGLang and Megatron processes still running, waited for up to WAIT_S
  local until found
  until=$(($(date +%s) + $1))
  while :; do
    found=$(pgrep -af 'sglang::|ray::.*(MegatronTrainRayActor|RolloutManager|SGLangEngine)' || true)
    if [ -z "$found" ] || [ "$(date +%s)" -ge "$until" ]; then break; fi
    sleep 1
  done
  printf '%s' "$found"
}

kill_scheduler_when() {  # kill_scheduler_when LOG: once LOG shows rollout $FAULT_KILL_ROLLOUT starting, SIGKILL
  # SGLang's scheduler, as a crash would; the time and pids in $OUT/fault-kill.killed
  local log="$1" pids
  local marker="slime's rollout $FAULT_KILL_ROLLOUT (generate): watching"
  for _ in $(seq 9000); do
    if grep -qF "$marker" "$log" 2>/dev/null; then
      pids=$(pgrep -f 'sglang::scheduler' || true)
      if [ -n "$pids" ]; then
        # shellcheck disable=SC2086  # one pid a word
        kill -KILL $pids
        echo "$(date +%s.%N) $pids" >"$OUT/fault-kill.killed"
        echo "[slime_e2e] rollout $FAULT_KILL_ROLLOUT started: SIGKILL to sglang::scheduler (pid $pids)"
        return 0
      fi
    fi
    sleep 0.2
  done
  echo "[slime_e2e] no sglang::scheduler was killed: rollout $FAULT_KILL_ROLLOUT never showed, or no such process"
}

seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }  # seconds FROM TO

fault_job() {  # fault_job fault-hook|fault-kill: a wrapped job that must stop on a typed error (see the head)
  local name="$1" log="$OUT/$1.log" logs rc=0 killer="" extra="" expect t0 t1
  need_sources
  local STEPS="$FAULT_STEPS" RUNTIME
  logs=$(lifecycle_logs "$name")
  slime_args "$name"
  if [ "$name" = fault-hook ]; then
    extra=$(printf ', "RL_LIFECYCLE_FAULT": "%s"' "$FAULT_HOOK")
    expect=LifecycleFailedError
  else
    # shellcheck disable=SC2206  # extra flags are words on purpose
    ARGS+=($FAULT_KILL_ARGS)
    expect=EngineDiedError
  fi
  runtime_env "$name" "$logs" "$extra"
  rm -f "$OUT/fault-kill.killed"
  : >"$log"
  ray_up "$name"
  trap ray_down EXIT INT TERM
  if [ "$name" = fault-kill ]; then
    kill_scheduler_when "$log" &
    killer=$!
  fi
  t0=$(date +%s.%N)
  (cd "$SLIME_DIR" && "$RAY" job submit --address="http://127.0.0.1:8265" --runtime-env-json="$RUNTIME" \
    -- "$PY" "$SLIME_DIR/train.py" "${ARGS[@]}") 2>&1 | tee "$log" || rc=$?
  t1=$(date +%s.%N)
  if [ -n "$killer" ]; then
    kill "$killer" 2>/dev/null || true
    wait "$killer" 2>/dev/null || true
  fi
  local left after typed killed="" check
  left=$(leftovers 60)
  ray_down
  trap - EXIT INT TERM
  after=$(leftovers 0)
  typed=$(grep -m1 -oE "$expect: .*" "$log" | cut -c1-600 || true)
  check=$("$PY" -m actor_integration.tools.cli check "$logs" 2>&1 | tail -n 4 || true)
  [ -f "$OUT/fault-kill.killed" ] && killed=$(cat "$OUT/fault-kill.killed")
  {
    echo "job: $name (STEPS=$STEPS${extra:+, RL_LIFECYCLE_FAULT=$FAULT_HOOK})"
    echo "rc: $rc"
    echo "seconds: $(seconds "$t0" "$t1")"
    if [ "$name" = fault-kill ]; then
      if [ -n "$killed" ]; then
        echo "killed: pid ${killed#* } at +$(seconds "$t0" "${killed%% *}") s; the job ended $(seconds "${killed%% *}" "$t1") s after the kill"
      else
        echo "killed: nothing (see $log)"
      fi
    fi
    echo "typed error: ${typed:-NONE ($expect expected)}"
    echo "left running after the job: ${left:-none}"
    echo "left running after ray stop: ${after:-none}"
    echo "lifecycle check:"
    echo "$check"
  } | tee "$OUT/$name.result"
  [ "$rc" -ne 0 ] && [ -n "$typed" ] && [ -z "$left" ] && { [ "$name" = fault-hook ] || [ -n "$killed" ]; }
}

report() {  # slime's own perf metrics per step, plain beside each wrapped job that ran (wrapped, budget),
  # and lifecycle check on that job's logs; then the fault jobs' results, where they ran
  local rc=0 job compared=""
  for job in wrapped budget; do
    [ -f "$OUT/plain.log" ] && [ -f "$OUT/$job.log" ] || continue
    "$PY" "$REPO/scripts/slime_e2e_report.py" "$OUT" "$job" || rc=$?
    "$PY" -m actor_integration.tools.cli check "$(lifecycle_logs "$job")" || rc=$?
    compared="$compared $job"
  done
  [ -n "$compared" ] || echo "report: nothing to put side by side in $OUT: run plain and wrapped (or budget) first"
  for name in fault-hook fault-kill; do
    [ -f "$OUT/$name.result" ] || continue
    echo "=== $name"
    cat "$OUT/$name.result"
  done
  return "$rc"
}

case "${1:-all}" in
  model) model ;;
  plain) job plain ;;
  wrapped) job wrapped yes ;;
  budget) job budget yes ;;
  report) report ;;
  all) model; job plain; job wrapped yes; report ;;
  fault-hook | fault-kill) fault_job "$1" ;;
  *) echo "usage: $0 [model|plain|wrapped|budget|report|all|fault-hook|fault-kill]" >&2; exit 2 ;;
esac
