"""Operation bodies for tests of the machine on the recording fakes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lifecycle import Lifecycle
from lifecycle.testing import Recorders


def make_body(rec: Recorders, lifecycle: Lifecycle, operation: str, result: Any = None) -> Callable[[], Any]:
    """A body that checks the protocol, records itself, and returns `result`."""

    def body() -> Any:
        rec.check_body(lifecycle, operation)
        rec.log.add("body", operation)
        return result

    return body
