#!/usr/bin/env bash
# Here (a CPU machine that reaches PyPI, not the GPU machine): lay out everything slime's own GRPO job
# (scripts/slime_e2e.sh: slime 624b824a's train.py, Megatron-LM from source, SGLang 0.5.15.post1) needs on
# the GPU machine beyond its image, in parts that each fit one device call.
#   SGLANG_GPU=DIR RL_LIFECYCLE_SLIME_SOURCE=GIT RL_LIFECYCLE_MEGATRON_SOURCE=GIT scripts/gpu_slime_wheels.sh
#   (or the same variables with `make gpu-slime-prepare`)
# Output, all under the git-ignored .gpuw/slime/:
#   full/     every wheel as downloaded (a cache: kept between runs, never carried)
#   wheels/   the set to install (site/: SGLang's server, slime's driver and workers, Ray with its
#             dashboard; np1/: numpy 1.26.4 and scipy 1.17.1, for the processes that import slime)
#   src/      slime at 624b824a and Megatron-LM's megatron/ at 1dcf0daf, exported with git archive, with
#             slime's docker/patch/latest/megatron.patch (and megatron-sglang-aligned.patch) applied as
#             slime's image applies them; sglang-patch/: the files slime's docker/patch/latest/sglang*.patch
#             change in the SGLang wheel's package (scripts/slime_sglang_patch.py), on slime's pin only
#   p1..pN    the parts to carry, one a device call (<= PART_MIB MiB each, 56 by default: the working
#             tree travels beside them within the call's 64 MiB)
# The wheel list is scripts/gpu_slime_wheels.txt over $SGLANG_GPU/wheels.txt (the 0.5.17 set); the two
# big wheels are slimmed with $SGLANG_GPU/strip_wheel.py as fetch_wheels.sh slims them (sglang-kernel:
# only what sm90 loads with the triton attention backend; wandb: its service binaries, which only
# wandb.init starts). Then scripts/slime_import_closure.py checks the set against what slime's job imports.
# SGLANG_GPU names the directory of the SGLang wheel set (its wheels.txt and strip_wheel.py, as for
# scripts/gpu_wheels.sh); RL_LIFECYCLE_SLIME_SOURCE and RL_LIFECYCLE_MEGATRON_SOURCE a clone or git
# directory of slime and of NVIDIA's Megatron-LM holding those commits.
# The device calls it prints at the end are scripts/gpu_slime.sh's (see its header).
# SLIME_SGLANG=set lays out the same job on SGLang's own set instead of slime's pins (sglang,
# sglang-kernel and flashinfer-python at $SGLANG_GPU/wheels.txt's versions: 0.5.17), in
# .gpuw/slime-sglang-set/ (run with GPU_SLIME_SET=slime-sglang-set); the downloads are shared.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
part_mib=${PART_MIB:-56}
: "${SGLANG_GPU:?set SGLANG_GPU to the directory holding wheels.txt and strip_wheel.py}"
SLIME_GIT=${RL_LIFECYCLE_SLIME_SOURCE:?set RL_LIFECYCLE_SLIME_SOURCE to a slime clone or git directory (624b824a)}
MEGATRON_GIT=${RL_LIFECYCLE_MEGATRON_SOURCE:?set RL_LIFECYCLE_MEGATRON_SOURCE to a Megatron-LM clone or git directory (1dcf0daf)}
SLIME_COMMIT=624b824a
MEGATRON_COMMIT=1dcf0dafa884ad52ffb243625717a3471643e087 # slime 624b824a's docker/Dockerfile MEGATRON_COMMIT
unpinned="" # slime's pins left to SGLang's set
case ${SLIME_SGLANG:-pinned} in
pinned) D=.gpuw/slime ;;
set) D=.gpuw/slime-sglang-set unpinned="sglang|sglang-kernel|flashinfer-python" ;;
*)
    echo "SLIME_SGLANG must be pinned (slime's SGLang 0.5.15.post1, the default) or set (SGLang's own set), got '$SLIME_SGLANG'" >&2
    exit 2
    ;;
esac
py=python3
[[ -x .venv/bin/python ]] && py=.venv/bin/python
FULL=.gpuw/slime/full # every wheel as downloaded, for both
mkdir -p "$FULL"
rm -rf "$D/wheels" "$D/src" "$D"/p* "$D/all.tar"
mkdir -p "$D/wheels/site" "$D/wheels/np1" "$D/src"

# name==version<TAB>where: this project's list first, then SGLang's set for every name it does not name.
list=$(mktemp)
trap 'rm -f "$list"' EXIT
grep -v '^#' scripts/gpu_slime_wheels.txt | grep . >"$list"
[[ -z $unpinned ]] || sed -i -E "/^($unpinned)==/d" "$list" # SGLang's own versions of what slime pins
norm() { tr 'A-Z_.' 'a-z--' <<<"$1"; }
ours=" $(cut -d= -f1 "$list" | while read -r n; do printf '%s ' "$(norm "$n")"; done)"
grep -v '^#' "$SGLANG_GPU/wheels.txt" | grep . | while IFS=$'\t' read -r spec _; do
    [[ $ours == *" $(norm "${spec%%==*}") "* ]] || printf '%s\tsite\n' "$spec"
done >>"$list"

platforms=()
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 \
    manylinux1 manylinux_2_5; do platforms+=(--platform "${p}_x86_64"); done
fetch() { # fetch SPEC: the wheel's file name in $FULL (downloaded once)
    local spec=$1 name file
    name=$(norm "${spec%%==*}")
    file=$(find "$FULL" -maxdepth 1 -name '*.whl' -printf '%f\n' | sort | while read -r f; do
        [[ $(norm "${f%%-*}") == "$name" && ${f#*-} == "${spec##*==}-"* ]] && echo "$f"
    done | head -1)
    if [[ -z $file ]]; then
        pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
            --abi abi3 --abi none "${platforms[@]}" --platform any "$spec" -d "$FULL" >&2 2>/dev/null ||
            { echo "pip download $spec failed" >&2; return 1; }
        fetch "$spec"
        return
    fi
    echo "$file"
}

while IFS=$'\t' read -r spec where; do
    [[ ${spec##*==} == - ]] && continue
    file=$(fetch "$spec")
    out="$D/wheels/$where/$file"
    case $(norm "${spec%%==*}") in
    sglang-kernel) python3 "$SGLANG_GPU/strip_wheel.py" "$FULL/$file" "$out" 'sgl_kernel/flash_ops*' \
        'sgl_kernel/flashmla_ops*' 'sgl_kernel/infllm_ops*' 'sgl_kernel/sm100/*' >/dev/null ;;
    xgrammar) python3 "$SGLANG_GPU/strip_wheel.py" "$FULL/$file" "$out" 'xgrammar/lib/libxgrammar.a' >/dev/null ;;
    # Ray's Java jar and the dashboard's source maps (as scripts/gpu_wheels.sh strips them)
    ray) python3 "$SGLANG_GPU/strip_wheel.py" "$FULL/$file" "$out" 'ray/jars/*' \
        'ray/dashboard/client/build/static/js/*.map' >/dev/null ;;
    wandb) python3 "$SGLANG_GPU/strip_wheel.py" "$FULL/$file" "$out" 'wandb/bin/*' >/dev/null ;;
    *) cp "$FULL/$file" "$out" ;;
    esac
done <"$list"
# The kernel must be the CUDA 13 build (the image's torch is cu130): its sm90 library links libcudart.so.13.
kernel=$(ls "$D"/wheels/site/sglang_kernel-*.whl)
python3 - "$kernel" <<'EOF'
import sys, zipfile
data = zipfile.ZipFile(sys.argv[1]).read("sgl_kernel/sm90/common_ops.abi3.so")
assert b"libcudart.so.13" in data, f"{sys.argv[1]} is not the CUDA 13 build (no libcudart.so.13)"
print("sglang-kernel: CUDA 13 build (sm90 library links libcudart.so.13)")
EOF

# Sources, exported without .git: slime whole but its docs and images; Megatron-LM's megatron/ package.
mkdir -p "$D/src/slime" "$D/src/Megatron-LM"
git -C "$SLIME_GIT" archive "$SLIME_COMMIT" -- . ':!docs' ':!imgs' | tar -x -C "$D/src/slime"
git -C "$MEGATRON_GIT" archive "$MEGATRON_COMMIT" megatron | tar -x -C "$D/src/Megatron-LM"
# slime's image applies its Megatron patch (docker/Dockerfile: docker/patch/${PATCH_VERSION}/megatron.patch,
# PATCH_VERSION=latest) over that commit; so does this set. Without it megatron.core's import sets
# torch_memory_saver.hook_mode = "torch" in every process that imports it, SGLang's scheduler included
# (its dumper imports megatron.core when it is on the path), and SGLang's pauseable CUDA graphs then
# assert "Only hook_mode=preload supports pauseable CUDA Graph" (seen on the first GPU run, 2026-12-06).
git -C "$SLIME_GIT" show "$SLIME_COMMIT:docker/patch/latest/megatron.patch" >"$D/megatron.patch"
patch -s -p1 -d "$D/src/Megatron-LM" <"$D/megatron.patch" # it touches megatron/ only
grep -q '# torch_memory_saver.hook_mode = "torch"' "$D/src/Megatron-LM/megatron/core/inference/contexts/dynamic_context.py" || {
    echo "slime's megatron.patch did not take (megatron/core/inference/contexts/dynamic_context.py)" >&2
    exit 1
}
# Then, as the Dockerfile does when it is there, docker/patch/latest/megatron-sglang-aligned.patch (its
# FP32 residual-add + RMSNorm boundary, off unless MEGATRON_USE_SGLANG_FUSED_RESIDUAL_RMS=1).
aligned=""
if git -C "$SLIME_GIT" show "$SLIME_COMMIT:docker/patch/latest/megatron-sglang-aligned.patch" >"$D/megatron-sglang-aligned.patch" 2>/dev/null; then
    patch -s -p1 -d "$D/src/Megatron-LM" <"$D/megatron-sglang-aligned.patch"
    aligned=" + megatron-sglang-aligned.patch"
fi
echo "$(git -C "$SLIME_GIT" rev-parse "$SLIME_COMMIT") slime" >"$D/src/COMMITS"
echo "$(git -C "$MEGATRON_GIT" rev-parse "$MEGATRON_COMMIT") Megatron-LM + slime's docker/patch/latest/megatron.patch$aligned" >>"$D/src/COMMITS"
# slime's image patches its SGLang too (docker/patch/latest/sglang*.patch over the checkout it installs);
# on slime's pin the same patches go over the wheel's sglang/, and the files they change travel in
# src/sglang-patch/ for scripts/gpu_slime.sh's install to copy over the installed package. They are
# written for 0.5.15.post1: SGLang's own set (SLIME_SGLANG=set) runs unpatched, as no image of slime's has it.
if [[ -z $unpinned ]]; then
    "$py" scripts/slime_sglang_patch.py --slime "$SLIME_GIT" --commit "$SLIME_COMMIT" \
        --wheel "$(ls "$D"/wheels/site/sglang-[0-9]*.whl)" --out "$D/src/sglang-patch"
    echo "SGLang $(ls "$D"/wheels/site/sglang-[0-9]*.whl | sed 's/.*sglang-\([^-]*\)-.*/\1/') + slime's docker/patch/latest/sglang*.patch (src/sglang-patch/PATCHED)" >>"$D/src/COMMITS"
fi

echo "wheels: $(find "$D/wheels" -name '*.whl' | wc -l) ($(du -sh "$D/wheels" | cut -f1)); sources: $(du -sh "$D/src" | cut -f1)"
closure_rc=0
overlay=()
[[ -d $D/src/sglang-patch ]] && overlay=(--overlay "$D/src/sglang-patch") # what slime's SGLang patches import
"$py" scripts/slime_import_closure.py --source "$D/src/slime" --source "$D/src/Megatron-LM" --source . \
    --wheels "$D/wheels" "${overlay[@]}" || closure_rc=$?

tar -cf "$D/all.tar" -C "$D" wheels src
split -b "${part_mib}m" -d -a 1 "$D/all.tar" "$D/all.tar.part"
n=0
for part in "$D"/all.tar.part*; do
    n=$((n + 1))
    mkdir -p "$D/p$n"
    mv "$part" "$D/p$n/"
done
for part in "$D"/p*; do echo "$n" >"$part/parts"; done # the device side knows when it has them all
rm -f "$D/all.tar"
echo "$n parts of <= ${part_mib} MiB ($(du -shc "$D"/p* | tail -1 | cut -f1) in all):"
du -sh "$D"/p*
command="bash scripts/gpu_slime.sh"
[[ $D == .gpuw/slime ]] || command="GPU_SLIME_SET=${D#.gpuw/} $command"
echo "Next session, back to back (the machine is given back 30 s after a call):"
for k in $(seq "$n"); do
    echo "  run(carry=[\"$D/p$k\"], command=\"$command\", timeout_s=600)"
done
echo "  then again with carry=[] until its table says every step ran (imports, model, plain, wrapped, report)"
exit "$closure_rc"
