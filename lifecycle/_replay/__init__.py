"""The per-machine rules of `lifecycle.checker`'s replay: one module per kind of lifecycle event.

`state` holds what they share (the replayed machine, where findings go, how a line is compared
with the replay); `messages` how findings name things. The rules import only those two.
"""
