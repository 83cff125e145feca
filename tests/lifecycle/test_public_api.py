"""The core introduces itself: a version, every error at the top, a docstring on every public member."""

from __future__ import annotations

import importlib.metadata
import pydoc
import subprocess
import sys

import lifecycle
from lifecycle import errors
from tests.helpers.public_api import ROOT, members, undocumented


class TestPublicApi:
    def test_every_public_member_has_a_docstring(self) -> None:
        """Each name in `lifecycle.__all__`, and each public method and property of its classes."""
        assert len(list(members(lifecycle))) > len(lifecycle.__all__)
        missing = undocumented(lifecycle)
        assert missing == [], "public members without a docstring:\n" + "\n".join(missing)

    def test_all_is_sorted_and_every_name_exists(self) -> None:
        assert lifecycle.__all__ == sorted(lifecycle.__all__)
        assert len(set(lifecycle.__all__)) == len(lifecycle.__all__)
        assert all(hasattr(lifecycle, name) for name in lifecycle.__all__)

    def test_every_error_is_importable_from_the_package(self) -> None:
        """`from lifecycle import LifecycleNotConfiguredError` and every other class of lifecycle.errors
        (the adapters' errors are in actor_integration.errors)."""
        from lifecycle import LifecycleNotConfiguredError

        assert LifecycleNotConfiguredError is errors.LifecycleNotConfiguredError
        for name in errors.__all__:
            assert name in lifecycle.__all__ and getattr(lifecycle, name) is getattr(errors, name), name

    def test_the_version_is_the_installed_distribution_s(self) -> None:
        assert lifecycle.__version__ == importlib.metadata.version("rl-lifecycle")

    def test_without_the_distribution_the_version_says_it_is_unknown(self) -> None:
        code = (
            "import importlib.metadata as m\n"
            "def version(name): raise m.PackageNotFoundError(name)\n"
            "m.version = version\n"
            "import lifecycle; print(lifecycle.__version__)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
        )
        assert out.stdout.strip() == "0+unknown"

    def test_help_shows_the_docstring_and_the_public_names(self) -> None:
        text = pydoc.render_doc(lifecycle, renderer=pydoc.plaintext)
        assert "Lifecycle state machine for colocated RL actors" in text
        for name in ("Lifecycle", "LifecyclePolicy", "LifecycleNotConfiguredError", "configure_logging"):
            assert name in text
        assert "VERSION" in text and lifecycle.__version__ in text
