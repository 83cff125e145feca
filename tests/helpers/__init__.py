"""Helpers of this project's own tests; the product never imports them.

Users' testing kit is `lifecycle.testing` (fakes with the real backends' interfaces); what is here
serves only our suite: spawned multi-process worlds, a slime-shaped actor on the fakes, an engine
behind a pipe, small models.
"""
