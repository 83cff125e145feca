"""The test suite (its own helpers live in `tests.helpers`)."""
