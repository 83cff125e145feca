"""The tools a user runs: the `lifecycle` command (`cli`), `doctor` (what this host can do) and the
colocated `demo`.
"""
