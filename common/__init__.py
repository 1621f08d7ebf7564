"""tidegate.common: facts and helpers that the engine and the operator share.

It imports nothing else of Tidegate and nothing heavy (no torch, no kopf), so that either side,
and the `tidegate` command, can use it without pulling in the other.
"""
