"""A real NCCL 2.29.7+ `libnccl.so.2` for tests that load it with LD_PRELOAD (tests only).

It needs no GPU to answer `ncclGetVersion`, or to refuse a NULL communicator.
"""

from __future__ import annotations

import glob
import sysconfig
import zipfile
from pathlib import Path


def nccl_library(directory: Path) -> Path | None:
    """The library installed next to torch (`nvidia-nccl-cu13`), else taken out of a wheel on disk."""
    installed = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    if installed.exists():
        return installed
    wheels = sorted(glob.glob("/opt/pypi-more/files/nvidia_nccl_cu1[23]-2.3*.whl"))
    if not wheels:
        return None
    with zipfile.ZipFile(wheels[-1]) as wheel:
        return Path(wheel.extract("nvidia/nccl/lib/libnccl.so.2", directory))
