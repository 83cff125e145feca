"""The README's code: every Python block parses, and every name it imports from this project exists."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
OURS = ("lifecycle", "actor_integration")


def imports(block: str) -> list[tuple[str, str]]:
    return [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS
        for alias in node.names
    ]


class TestReadme:
    def test_there_are_examples(self):
        assert len(BLOCKS) >= 4 and any(imports(block) for block in BLOCKS)

    @pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
    def test_every_imported_name_exists(self, block: str):
        """An example that imports a moved or renamed name fails here, not in a reader's hands."""
        missing = [
            f"from {module} import {name}"
            for module, name in imports(block)
            if not hasattr(importlib.import_module(module), name)
        ]
        assert missing == []
