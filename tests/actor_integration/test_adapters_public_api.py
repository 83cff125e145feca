"""The adapters introduce themselves: a version, the lazy names listed without importing them, and a
docstring on every public member."""

from __future__ import annotations

import json
import pydoc
import re
import subprocess
import sys

import actor_integration
import lifecycle
from tests.helpers.public_api import ROOT, undocumented


class TestPublicApi:
    def test_every_public_member_has_a_docstring(self) -> None:
        """Each name in `actor_integration.__all__`, and each public method and property of its classes."""
        missing = undocumented(actor_integration)
        assert missing == [], "public members without a docstring:\n" + "\n".join(missing)

    def test_dir_lists_the_lazy_names_without_importing_torch(self) -> None:
        code = (
            "import json, sys, actor_integration as a\n"
            "print(json.dumps([dir(a), a.__all__, [m for m in ('torch', 'ray') if m in sys.modules]]))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
        )
        names, all_, imported = json.loads(out.stdout)
        assert set(all_) <= set(names) and all_ == sorted(all_)
        assert imported == []

    def test_the_docstring_names_every_public_name(self) -> None:
        """`help(actor_integration)` says what is there before anything is imported."""
        doc = actor_integration.__doc__ or ""
        named = set(re.findall(r"`(\w+)`", doc))
        assert sorted(set(actor_integration.__all__) - named) == []

    def test_the_version_is_lifecycle_s(self) -> None:
        assert actor_integration.__version__ == lifecycle.__version__

    def test_help_shows_the_docstring_and_the_classes(self) -> None:
        text = pydoc.render_doc(actor_integration, renderer=pydoc.plaintext)
        assert "Adapters between the lifecycle core and the outside systems" in text
        for name in ("class LifecycleMixin", "class WeightSender", "class RolloutActor", "select_transport"):
            assert name in text
