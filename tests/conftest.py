"""Keep lifecycle events off the console during tests; tests that read events capture them."""

import io

import lifecycle

lifecycle.configure_logging(stream=io.StringIO(), level="warning")
