"""The vLLM wheel set for the GPU machine (scripts/gpu_vllm_wheels.txt) against what vLLM 0.26.0 really
imports at load, in CI: scripts/slime_import_closure.py walks the pinned wheel (fetched once by hash,
as the adapter's source checks do) from the roots scripts/gpu_vllm_wheels.sh names, and every module
that walk finds required at load must be a distribution the list ships or the machine's image has.

The first H100 run of the set failed on `No module named 'llguidance'`: vLLM's structured-output
backends read a LazyLoader's attribute in a dataclass annotation, so llguidance and xgrammar load
with the engine core, and the list had dropped them. This is that failure's check, run on every
change; the offline check in gpu_vllm_wheels.sh (the whole set, its wheels walked too) runs only
where the set is built.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.benchmarks import load_script

ROOT = Path(__file__).resolve().parents[2]
LIST = ROOT / "scripts" / "gpu_vllm_wheels.txt"
# Import names that differ from their distribution's (normalized) name, among those vLLM reaches.
DISTRIBUTION_OF = {"zmq": "pyzmq", "yaml": "pyyaml", "cv2": "opencv-python-headless", "PIL": "pillow"}


@pytest.fixture(scope="module")
def required_at_load() -> dict[str, str]:
    """Top-level module -> where vLLM's (and the adapter's) load first requires it, beyond vLLM,
    the repository, the standard library and the image's modules the walker knows."""
    from tests.helpers.vllm_source import cache_dir, cached_wheel, open_tree

    open_tree().close()  # the wheel, fetched once (or this test skips offline)
    assert cached_wheel() is not None
    closure = load_script("slime_import_closure")
    script = (ROOT / "scripts" / "gpu_vllm_wheels.sh").read_text()
    found = re.search(r"^roots=\((.*?)\)", script, re.S | re.M)
    assert found is not None, "scripts/gpu_vllm_wheels.sh names no roots=( ... )"
    sources = closure.Sources(dirs=[ROOT], follow_wheels=frozenset({"vllm"}))
    sources.add_wheels(cache_dir())
    missing, read, _ = closure.closure(sources, found.group(1).split())
    assert read > 500, f"the walk read {read} modules: is the vLLM wheel there?"
    return dict(missing.required)


def uncarried(required: dict[str, str], list_text: str) -> list[str]:
    """What the list neither ships nor finds in the image, each with where it is required."""
    vset = load_script("gpu_vllm_set")
    carried = {e.key for e in vset.parse_list(list_text) if e.role in ("ship", "image")}
    return [
        f"{top} (required at {where})"
        for top, where in sorted(required.items())
        if vset.normalize(DISTRIBUTION_OF.get(top, top)) not in carried
    ]


def test_every_module_vllm_requires_at_load_is_shipped_or_in_the_image(
    required_at_load: dict[str, str],
) -> None:
    assert {"llguidance", "xgrammar", "pydantic", "zmq"} <= set(required_at_load)  # the walk reaches them
    assert uncarried(required_at_load, LIST.read_text()) == []


def test_it_names_a_dropped_module_and_where_vllm_loads_it(required_at_load: dict[str, str]) -> None:
    """The list as it was before the H100 run: llguidance dropped."""
    text = LIST.read_text().replace("llguidance==1.7.6\tship", "llguidance==1.7.6\tdrop")
    assert uncarried(required_at_load, text) == [
        "llguidance (required at vllm.v1.structured_output.backend_guidance:144)"
    ]
