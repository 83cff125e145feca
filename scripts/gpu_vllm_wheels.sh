#!/usr/bin/env bash
# Here (a CPU machine that reaches PyPI, not the GPU machine): lay out vLLM 0.26.0 and what it needs on
# the lent GPU machine beyond its image (torch 2.11.0 cu130, numpy 2.5, transformers 5.17, Python 3.12,
# no network), in parts that each fit one device call. NOTHING HERE HAS RUN ON A GPU YET.
#   VLLM_WHEEL=/path/to/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl scripts/gpu_vllm_wheels.sh
#   (or `make gpu-vllm-prepare`; without VLLM_WHEEL the wheel is downloaded, 290 MiB)
# The set is scripts/gpu_vllm_wheels.txt (its header says what is shipped, what the image has, what is
# dropped and why, and which members of the vllm and ray wheels are stripped). Steps:
#   1. download each `ship` wheel (--no-deps, cp312 manylinux x86_64) into $GPU_VLLM_CACHE (default
#      .gpuw/vllm/full: a cache, kept between runs, never carried)
#   2. the offline check: pip resolves vllm==0.26.0 ray==2.60.0 structlog transitions again with
#      --no-index over the shipped wheels and empty stand-ins ("stubs") of the `image` and `drop`
#      entries, under Python 3.12's markers ($PY312, default python3.12): a requirement the list
#      forgets fails here. Every distribution it installs must be a shipped wheel or a stub.
#   3. the import check: scripts/slime_import_closure.py walks the module-level imports from vLLM's
#      engine, worker, attention, model, sleep-mode and server modules and the project's vLLM adapter
#      through the shipped wheels; a required module neither shipped nor in the image fails here.
#      (Imports inside functions are not walked: the device's `imports` and `tests` steps see those.)
#   4. scripts/gpu_vllm_set.py pack: strip, store, one tar.xz, split into .gpuw/vllm/p1..pN (<= PART_MIB
#      MiB each, 56 by default: the working tree travels beside a part within a call's 64 MiB), each
#      part with the MANIFEST (sizes and sha256) that the device checks before it installs.
# Then, back to back on the device (the machine is given back 30 s after a call), scripts/gpu_vllm.sh's
# calls, printed at the end.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
part_mib=${PART_MIB:-56}
PY312=${PY312:-python3.12}
D=.gpuw/vllm
CACHE=${GPU_VLLM_CACHE:-$D/full}
LIST=scripts/gpu_vllm_wheels.txt
py=python3
[[ -x .venv/bin/python ]] && py=.venv/bin/python
"$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || {
    echo "PY312=$PY312 must be a Python 3.12 with pip (the markers of the machine's Python)" >&2
    exit 1
}
mkdir -p "$CACHE"
rm -rf "$D/check" "$D"/p[0-9]*
mkdir -p "$D/check/ship" "$D/check/stubs"

platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
    manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_5; do
    platforms+=(--platform "${p}_x86_64")
done
norm() { tr 'A-Z_.' 'a-z--' <<<"$1"; }
cached() { # cached NAME VERSION: the wheel's path in $CACHE, or nothing
    local f b
    for f in "$CACHE"/*.whl; do
        b=$(basename "$f")
        if [[ $(norm "${b%%-*}") == "$(norm "$1")" && ${b#*-} == "$2-"* ]]; then
            echo "$f"
            return
        fi
    done
}

# 1. the shipped wheels
if [[ -n ${VLLM_WHEEL:-} && ! -f $CACHE/$(basename "$VLLM_WHEEL") ]]; then cp "$VLLM_WHEEL" "$CACHE/"; fi
ship=()
while IFS=$'\t' read -r spec _; do
    name=${spec%%==*} version=${spec##*==}
    file=$(cached "$name" "$version")
    if [[ -z $file ]]; then
        "$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --abi cp312 --abi abi3 --abi none "${platforms[@]}" --platform any -d "$CACHE" "$spec" 2>/dev/null ||
            { echo "pip download $spec failed" >&2; exit 1; }
        file=$(cached "$name" "$version")
    fi
    [[ -n $file ]] || { echo "no wheel of $spec in $CACHE after download" >&2; exit 1; }
    ship+=("$file")
    ln -sf "$(cd "$(dirname "$file")" && pwd)/$(basename "$file")" "$D/check/ship/"
done < <("$py" scripts/gpu_vllm_set.py list "$LIST" --role ship)
echo "1. ${#ship[@]} shipped wheels ($(du -chL "${ship[@]}" | tail -1 | cut -f1) as downloaded)"

# 2. the offline check
"$py" scripts/gpu_vllm_set.py stubs "$LIST" "$D/check/stubs" "$D/check/constraints.txt"
rc=0
"$PY312" -m pip install -q --dry-run --ignore-installed --no-index --find-links "$D/check/ship" \
    --find-links "$D/check/stubs" -c "$D/check/constraints.txt" --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform any --target "$D/check/target" \
    --report "$D/check/report.json" vllm==0.26.0 ray==2.60.0 structlog==26.1.0 transitions==0.9.3 torch-memory-saver==0.0.10 \
    >"$D/check/pip.log" 2>&1 || rc=$?
grep -v 'is ignored: it is neither' "$D/check/pip.log" | grep -v 'does not provide the extra' || true
[[ $rc -eq 0 ]] || { echo "2. the offline check FAILED (pip rc=$rc): $D/check/pip.log" >&2; exit 1; }
"$py" - "$D/check/report.json" "$LIST" <<'PYEOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "scripts")
from gpu_vllm_set import normalize, read_list
entries = {e.key: e for e in read_list(Path(sys.argv[2]))}
installed = {normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
bad = [f"{n}=={v}" for n, v in installed.items() if n not in entries]
roles = {r: sorted(n for n in installed if n in entries and entries[n].role == r) for r in ("ship", "image", "drop")}
unused = sorted(n for n, e in entries.items() if n not in installed)
print(f"2. offline check: pip resolved {len(installed)} distributions with --no-index: "
      f"{len(roles['ship'])} shipped, {len(roles['image'])} the image's, {len(roles['drop'])} dropped")
if unused:
    print(f"   listed but required by nothing resolved (kept for imports the metadata does not name): {' '.join(unused)}")
if bad:
    sys.exit(f"   resolved to distributions the list does not name: {' '.join(bad)}")
PYEOF

# 3. the import check (module-level imports from vLLM's and the adapter's entry modules)
roots=(vllm vllm.entrypoints.llm vllm.v1.engine.llm_engine vllm.v1.engine.core vllm.v1.engine.core_client
    vllm.v1.engine.async_llm vllm.v1.executor.uniproc_executor vllm.v1.executor.multiproc_executor
    vllm.v1.worker.gpu_worker vllm.v1.worker.gpu_model_runner vllm.model_executor.models.qwen2
    vllm.model_executor.models.qwen3 vllm.model_executor.model_loader.dummy_loader
    vllm.v1.attention.backends.flash_attn vllm.v1.attention.backends.triton_attn vllm.v1.sample.sampler
    vllm.device_allocator.cumem vllm.device_allocator.sleep_mode_backend
    vllm.distributed.weight_transfer.ipc_engine vllm.distributed.weight_transfer.factory
    vllm.entrypoints.openai.api_server vllm.entrypoints.cli.main vllm.entrypoints.serve.dev.sleep.api_router
    vllm.platforms.cuda vllm.vllm_flash_attn.flash_attn_interface vllm.v1.structured_output
    actor_integration.engines.vllm.offline actor_integration.engines.vllm.http_engine
    actor_integration.engines.vllm.worker actor_integration.engines.vllm.actor actor_integration.tools.cli
    ray ray.util.placement_group)
root_args=()
for r in "${roots[@]}"; do root_args+=(--root "$r"); done
"$py" scripts/slime_import_closure.py --source . --wheels "$D/check/ship" --follow all "${root_args[@]}" \
    >"$D/check/imports.txt" || {
    grep -v '^absent' "$D/check/imports.txt"
    echo "3. the import check FAILED: a module imported at load is neither shipped nor the image's" >&2
    exit 1
}
echo "3. import check: $(grep -c '^absent' "$D/check/imports.txt") modules absent under an if or a try" \
    "(not loaded on this path), none required: $D/check/imports.txt"

# 4. the parts
"$py" scripts/gpu_vllm_set.py pack "${ship[@]}" --list "$LIST" --out "$D" --part-mib "$part_mib"
n=$(find "$D" -maxdepth 1 -name 'p[0-9]*' -type d | wc -l)
echo "4. $n parts of <= ${part_mib} MiB:"
du -sh "$D"/p[0-9]*
echo "Then, back to back (the machine is given back 30 s after a call):"
for k in $(seq "$n"); do
    echo "  run(carry=[\"$D/p$k\"], command=\"bash scripts/gpu_vllm.sh\", timeout_s=600)"
done
echo "  and again with carry=[] while its table says a step is still to run"
