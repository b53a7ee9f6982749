"""Speculative decoding: propose tokens cheaply, verify them in one target forward, keep what the
target's own distribution would have produced (greedy: its argmax; sampling: rejection sampling).
"""
