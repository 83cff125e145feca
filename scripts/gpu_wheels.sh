#!/usr/bin/env bash
# Here (not on the GPU machine): lay out every wheel the GPU runs of SGLang need, in parts that
# each fit one device call (the working tree and the carried paths travel together, 64 MiB).
#   scripts/gpu_wheels.sh            # .gpuw/p1 .. .gpuw/pN, one part each (git-ignore /.gpuw/)
# With RL_LIFECYCLE_SLIME_SOURCE set (a slime checkout or git directory), slime's engine modules
# are exported to .gpuw/r33/slime for the `slime` step; with RL_LIFECYCLE_MILES_SOURCE, miles' to
# .gpuw/r33/miles for the `miles` step; with RL_LIFECYCLE_AREAL_SOURCE, the AReaL files its remote
# SGLang engine imports (tests/helpers/areal_engine.py ENGINE_FILES, about 1.5 MB) to
# .gpuw/r33/areal for the `areal` step.
# Then, back to back (the machine is given back 30 s after a call):
#   run(carry=[".gpuw/p1"], command="bash scripts/gpu_sglang.sh stage")   ... for p1 .. pN-1
#   run(carry=[".gpuw/pN"], command="bash scripts/gpu_sglang.sh stage run")
# The SGLang set is what $SGLANG_GPU/fetch_wheels.sh lays out (sglang 0.5.17 for the machine's
# torch 2.11, slimmed; SGLANG_GPU names the directory that holds it, outside this repository);
# the rest is what the project and Ray import that the machine's image lacks, installed there only
# where missing (`gpu_sglang.sh` asks pip for each distribution first).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
part_mib=${PART_MIB:-56}
: "${SGLANG_GPU:?set SGLANG_GPU to the directory holding fetch_wheels.sh and strip_wheel.py}"
[[ -d .sgw/batch1 && -d .sgw/batch2 ]] || "$SGLANG_GPU/fetch_wheels.sh" .sgw >/dev/null
rm -rf .gpuw/wheels && mkdir -p .gpuw/wheels
rm -rf .gpuw/p* .gpuw/all.tar
cp .sgw/batch1/*.whl .sgw/batch2/*.whl .gpuw/wheels/
# Ray and the project's own imports the machine's image lacks (its package list is in the device
# library's KINDS.md: click, msgpack, rich, psutil, matplotlib, pyyaml, requests, protobuf and
# packaging are there). Set PROJECT_WHEELS_ALL=1 for a machine without them.
project=(ray==2.60.0 structlog transitions megatron-core==0.19.2)
if [[ -n ${PROJECT_WHEELS_ALL:-} ]]; then
    project+=(click msgpack rich markdown-it-py mdurl pygments psutil matplotlib contourpy cycler fonttools
        kiwisolver pyparsing pillow python-dateutil six pyyaml requests urllib3 certifi charset-normalizer idna
        protobuf packaging)
fi
rm -rf .gpuw/project
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .gpuw/project "${project[@]}" 2>/dev/null
mkdir -p .gpuw/wheels/project
for whl in .gpuw/project/*.whl; do
    case $(basename "$whl") in
    # Ray's Java jar and the dashboard's source maps: 32 MiB of 76 that nothing here loads.
    ray-*) python3 "${SGLANG_GPU}/strip_wheel.py" "$whl" ".gpuw/wheels/project/$(basename "$whl")" \
        'ray/jars/*' 'ray/dashboard/client/build/static/js/*.map' >/dev/null ;;
    *) cp "$whl" .gpuw/wheels/project/ ;;
    esac
done
tar -cf .gpuw/all.tar -C .gpuw wheels
split -b "${part_mib}m" -d -a 1 .gpuw/all.tar .gpuw/all.tar.part
n=0
for part in .gpuw/all.tar.part*; do
    n=$((n + 1))
    mkdir -p ".gpuw/p$n"
    mv "$part" ".gpuw/p$n/"
done
for part in .gpuw/p*; do echo "$n" >"$part/parts"; done # the device side knows when it has them all
rm -f .gpuw/all.tar
echo "$n parts of <= ${part_mib} MiB:"
du -sh .gpuw/p*
# The frameworks' engine sources for `gpu_sglang.sh slime` / `miles` / `areal` (never committed),
# each from its RL_LIFECYCLE_<NAME>_SOURCE when set: carry .gpuw/r33 with the last part.
py=python3
[[ -x .venv/bin/python ]] && py=.venv/bin/python # the source helpers import torch: `make install` has it
for name in slime miles areal; do
    source_env="RL_LIFECYCLE_${name^^}_SOURCE"
    [[ -n ${!source_env:-} ]] || continue
    rm -rf ".gpuw/r33/$name"
    PYTHONPATH=$here "$py" -c 'import importlib, sys; from pathlib import Path
name = sys.argv[1]
modules = (
    importlib.import_module("tests.helpers.areal_engine").ENGINE_FILES
    if name == "areal"
    else getattr(importlib.import_module("tests.helpers.engine_source"), f"{name.upper()}_MODULES")
)
source = getattr(importlib.import_module(f"tests.helpers.{name}_source"), f"{name.capitalize()}Source")
print(name, source.find().export(Path(sys.argv[2]), (*modules, source.PROBE)).resolved_commit(), "->", sys.argv[2])' \
        "$name" ".gpuw/r33/$name"
done
if [[ -d .gpuw/r33 ]]; then du -sh .gpuw/r33/* .gpuw/r33; fi
