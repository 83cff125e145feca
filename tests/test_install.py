"""The core installs alone: a bare `pip install rl-lifecycle` brings transitions and structlog, and
`import lifecycle`, `lifecycle check` and `lifecycle diagram` work there without torch or Ray; each
extra names what it enables, and a subcommand that needs one says which."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib

from actor_integration.tools.cli import EXTRA_FOR_MODULE

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# A trainer's sleep and wake on the core's own fakes, its events in a per-rank log.
RUN = """
import importlib.util, sys
assert importlib.util.find_spec("torch") is None and importlib.util.find_spec("ray") is None
import actor_integration, lifecycle, lifecycle.checker, lifecycle.timeline
from lifecycle import LifecyclePolicy, State, configure_rank_log, flush_logs
from lifecycle.testing import recording_lifecycle
configure_rank_log("trainer", 0, log_dir=sys.argv[1])
machine, _ = recording_lifecycle(LifecyclePolicy(offload_train=True), rank=0, role="trainer")
machine.sleep()
machine.wake_up()
assert machine.state is State.AWAKE, machine.state
flush_logs()
assert "torch" not in sys.modules and "ray" not in sys.modules
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert lifecycle.CorruptBucketError.__module__ == "actor_integration.errors"  # 0.1's name, one release
assert [w.category for w in caught] == [DeprecationWarning], caught
print(lifecycle.__version__)
"""


def _requirement_name(requirement: str) -> str:
    return requirement.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()


@pytest.fixture(scope="module")
def core_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A fresh virtual environment (no system packages) with the project's wheel installed bare."""
    where = tmp_path_factory.mktemp("core-env")
    # Built from a copy of the tracked files: setuptools leaves build/ in the tree it builds.
    source = where / "source"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in tracked.stdout.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    wheels = where / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            wheels,
            source,
        ],
        check=True,
    )
    (wheel,) = wheels.glob("rl_lifecycle-*.whl")
    venv.EnvBuilder(with_pip=True).create(where / "venv")
    python = where / "venv" / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel], check=True)
    return python, wheel


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, *args], capture_output=True, text=True, cwd=cwd)


class TestBareInstall:
    def test_the_wheel_requires_transitions_and_structlog_only(self, core_env):
        """Everything else sits behind an extra."""
        _, wheel = core_env
        with zipfile.ZipFile(wheel) as archive:
            (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
            metadata = email.message_from_bytes(archive.read(name))
        bare = {_requirement_name(r) for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r}
        assert bare == {"transitions", "structlog"}

    def test_the_core_runs_logs_and_checks_without_torch_or_ray(self, core_env, tmp_path):
        """A sleep and a wake on the core's fakes write a per-rank log that `lifecycle check` calls
        clean, and `lifecycle diagram` draws the table; neither torch nor Ray is there to import."""
        python, _ = core_env
        out = _run(python, "-c", RUN, str(tmp_path / "logs"), cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == PYPROJECT["project"]["version"]
        lifecycle = python.parent / "lifecycle"
        (log,) = (tmp_path / "logs").glob("trainer-rank0.jsonl")
        check = subprocess.run([lifecycle, "check", log], capture_output=True, text=True, cwd=tmp_path)
        assert check.returncode == 0 and check.stderr.strip().endswith(": clean"), check.stdout + check.stderr
        diagram = subprocess.run([lifecycle, "diagram"], capture_output=True, text=True, cwd=tmp_path)
        assert diagram.returncode == 0 and "stateDiagram" in diagram.stdout, diagram.stderr

    def test_a_subcommand_that_needs_an_extra_names_it(self, core_env, tmp_path):
        """`lifecycle demo` (torch, Ray) and a timeline's PNG (matplotlib) answer in one line."""
        python, _ = core_env
        lifecycle = python.parent / "lifecycle"
        demo = subprocess.run(
            [lifecycle, "demo", "--steps", "1"], capture_output=True, text=True, cwd=tmp_path
        )
        assert demo.returncode == 2
        assert "pip install 'rl-lifecycle[demo]'" in demo.stderr, demo.stderr
        assert "Traceback" not in demo.stderr
        log = tmp_path / "logs"
        assert _run(python, "-c", RUN, str(log), cwd=tmp_path).returncode == 0
        timeline = subprocess.run(
            [lifecycle, "timeline", log, "-o", tmp_path / "run"], capture_output=True, text=True, cwd=tmp_path
        )
        assert timeline.returncode == 2, timeline.stdout + timeline.stderr
        assert "pip install 'rl-lifecycle[plots]' (or --no-png" in timeline.stderr, timeline.stderr
        assert (tmp_path / "run.json").stat().st_size > 0  # the trace was written before the picture


class TestExtras:
    def test_every_module_the_cli_names_is_in_the_extra_it_names(self):
        """The hint `pip install 'rl-lifecycle[X]'` brings the module it was given for."""
        extras = PYPROJECT["project"]["optional-dependencies"]

        def closure(extra: str) -> set[str]:
            names: set[str] = set()
            for requirement in extras[extra]:
                if requirement.startswith("rl-lifecycle["):
                    for inner in requirement[len("rl-lifecycle[") : -1].split(","):
                        names |= closure(inner)
                else:
                    names.add(_requirement_name(requirement))
            return names

        distribution = {"megatron": "megatron-core", "torch_memory_saver": "torch-memory-saver"}
        for module, extra in EXTRA_FOR_MODULE.items():
            assert distribution.get(module, module) in closure(extra), (module, extra)
            assert distribution.get(module, module) in closure("all"), module
