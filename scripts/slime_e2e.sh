#!/usr/bin/env bash
# slime's own GRPO job on one GPU, plain and under the lifecycle's launch switch, side by side.
#
# STATUS: ran on one H100 on 2026-12-06 (scripts/gpu_slime.sh, SGLang 0.5.15.post1, 5 steps, SGLang's
# CUDA graphs off): plain and wrapped both finished every step; docs/measurements.md has the table.
# Its launch, flags and driver order are also what
# tests/actor_integration/frameworks/slime/test_slime_job_source.py runs on a CPU with stand-ins.
# Changed since that run, not yet run on a GPU: the reward (`math` gave 0 on the random model, so
# GRPO's loss and gradient were 0 and the weights never changed; `random` gives advantages) and the
# learning rate (1e-6 -> 1e-4, so that bf16 weights move each step).
#
# Usage (on the GPU machine, from the repository root):
#   SLIME_DIR=/path/to/slime MEGATRON_DIR=/path/to/Megatron-LM \
#   scripts/slime_e2e.sh [model|plain|wrapped|report|all]
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
# the runtime env alone: the launch switch's hook and RL_LIFECYCLE_WRAP=trainer,rollout.
set -euo pipefail

REPO="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
: "${SLIME_DIR:=}" "${MEGATRON_DIR:=}"
need_sources() {
  [ -n "$SLIME_DIR" ] || { echo "set SLIME_DIR to a checkout of slime at 624b824a" >&2; exit 2; }
  [ -n "$MEGATRON_DIR" ] || { echo "set MEGATRON_DIR to Megatron-LM at the commit slime pins" >&2; exit 2; }
}
OUT="${OUT:-$REPO/out/slime-e2e}"
STEPS="${STEPS:-6}"
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

job() {  # job NAME [wrapped]: one run of slime's train.py; its output in $OUT/NAME.log
  local name="$1" wrapped="${2:-}"
  need_sources
  slime_args "$name"
  local env_vars
  env_vars=$(printf '"PYTHONPATH": "%s:%s%s", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TENSORBOARD_DIR": "%s"' \
    "$MEGATRON_DIR" "$REPO" "${PYTHONPATH:+:$PYTHONPATH}" "$OUT/tb-$name")
  local runtime
  if [ -n "$wrapped" ]; then
    runtime=$(printf '{"worker_process_setup_hook": "actor_integration.frameworks.launch.slime", "env_vars": {%s, "RL_LIFECYCLE_WRAP": "trainer,rollout", "RL_LIFECYCLE_LOG_DIR": "%s"}}' \
      "$env_vars" "$OUT/lifecycle-logs")
    rm -rf "$OUT/lifecycle-logs"
  else
    runtime=$(printf '{"env_vars": {%s}}' "$env_vars")
  fi
  ray_up "$name"
  trap ray_down EXIT INT TERM
  (cd "$SLIME_DIR" && "$RAY" job submit --address="http://127.0.0.1:8265" --runtime-env-json="$runtime" \
    -- "$PY" "$SLIME_DIR/train.py" "${ARGS[@]}") 2>&1 | tee "$OUT/$name.log"
  ray_down
  trap - EXIT INT TERM
}

report() {  # slime's own figures per step, plain beside wrapped, and lifecycle check on the wrapped job's logs
  "$PY" "$REPO/scripts/slime_e2e_report.py" "$OUT"
  "$PY" -m actor_integration.tools.cli check "$OUT/lifecycle-logs"
}

case "${1:-all}" in
  model) model ;;
  plain) job plain ;;
  wrapped) job wrapped yes ;;
  report) report ;;
  all) model; job plain; job wrapped yes; report ;;
  *) echo "usage: $0 [model|plain|wrapped|report|all]" >&2; exit 2 ;;
esac
