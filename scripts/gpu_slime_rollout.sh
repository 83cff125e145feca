#!/usr/bin/env bash
# slime's rollout half on a real SGLang 0.5.17 HTTP server (tests/gpu/test_slime_rollout_gpu.py), in
# two back-to-back device calls (the machine is given back 30 s after a call). Here, first:
#   "$SGLANG_GPU"/fetch_wheels.sh .sgw                 # .sgw/batch1, .sgw/batch2 (SGLang's set, < 50 MiB each)
#   pip download ... -d .gpuw/r33/extra structlog transitions six requests urllib3 certifi \
#       charset-normalizer idna psutil packaging      # what the project and slime's engine import
#   export slime 624b824a's slime/ray/ray_actor.py, slime/backends/sglang_utils/sglang_engine.py and
#   slime/backends/megatron_utils/actor.py to .gpuw/r33/slime (FrameworkSource.export; never committed)
# Then:
#   run(carry=[".sgw/batch1"], command="bash scripts/gpu_slime_rollout.sh stage")
#   run(carry=[".sgw/batch2", ".gpuw/r33"], command="bash scripts/gpu_slime_rollout.sh run")
# (The device tool sends the session's checkout: from a helper's worktree, lay the tree, with .sgw/batch2
# and .gpuw/r33 inside it, in an ignored folder of that checkout, carry it, and cd there first.)
# `run` installs once per machine, runs the test (figures as JSON in $OUT), then `lifecycle check` on
# the engine's log.
set -u
SITE=$HOME/sgw/site
PSITE=$HOME/sgw/proj-site
WORK=${WORK:-/tmp/gpu-slime-rollout}
PY=${PY:-python3}
mkdir -p "$WORK" "$HOME/sgw/wheels"
export PYTHONPATH=$SITE:$PSITE:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TVM_FFI_CACHE_DIR=$HOME/sgw/tvmffi
export PYTHONUNBUFFERED=1 LIFECYCLE_GPU_OUT=$WORK RL_LIFECYCLE_LOG_DIR=$WORK/logs
export RL_LIFECYCLE_SLIME_SOURCE=$PWD/.gpuw/r33/slime

case ${1:-} in
stage)
    cp .sgw/batch1/*.whl "$HOME/sgw/wheels/" && ls "$HOME/sgw/wheels" | wc -l
    ;;
run)
    start=$SECONDS
    if [[ ! -f $HOME/sgw/.installed-r33 ]]; then
        cp .sgw/batch2/*.whl "$HOME/sgw/wheels/"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$HOME"/sgw/wheels/*.whl
        missing=()
        for whl in .gpuw/r33/extra/*.whl; do
            name=$(basename "$whl" | cut -d- -f1)
            PYTHONPATH=$SITE "$PY" -c 'import importlib.metadata as m, sys; m.version(sys.argv[1])' "$name" \
                2>/dev/null || missing+=("$whl")
        done
        echo "installing ${#missing[@]} wheels the image lacks: ${missing[*]##*/}"
        [[ ${#missing[@]} -eq 0 ]] || "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$PSITE" "${missing[@]}"
        touch "$HOME/sgw/.installed-r33"
    fi
    echo "=== install: $((SECONDS - start)) s"
    "$PY" -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__)'
    start=$SECONDS
    timeout -k 10 "${TEST_LIMIT:-430}" "$PY" -m pytest -m gpu -q -s -p no:cacheprovider \
        tests/gpu/test_slime_rollout_gpu.py >"$WORK/test.log" 2>&1
    echo "=== test: rc=$? in $((SECONDS - start)) s"
    grep -E '^\[slime_rollout|passed|failed|error|Error' "$WORK/test.log" | tail -n 40
    "$PY" -m actor_integration.tools.cli check "$WORK/logs" >"$WORK/check.log" 2>&1
    echo "=== lifecycle check: rc=$?"
    tail -n 5 "$WORK/check.log"
    if [[ -n ${OUT:-} ]]; then
        cp "$WORK"/*.json "$WORK"/*.log "$OUT/" 2>/dev/null
        tail -c 20000 "$WORK/test.log" >"$OUT/test-tail.log"
        [[ -d $TVM_FFI_CACHE_DIR ]] && tar -czf "$OUT/tvmffi.tgz" -C "$TVM_FFI_CACHE_DIR" . 2>/dev/null
    fi
    ;;
*) echo "usage: gpu_slime_rollout.sh stage|run" ;;
esac
