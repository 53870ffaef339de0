"""Launch plans memoized per call signature.

An op's host work before its launch (argument checks, dtype and layout parsing, launch-shape
arithmetic, the kernel lookup, the marshalling of the kernel's arguments) depends only on the
arguments' shapes, strides, dtypes, alignments (address modulo 16), devices and options, not on
their contents or addresses. Every op keys that work on such a signature and does it once: a
repeated call checks what depends on the addresses of caller-given buffers (overlaps), allocates
its outputs and launches, patching the pointers into the planned launch (``_launch.Launch``).
A signature holding anything unhashable (a list where an array belongs) is never stored: the call
is planned, and so checked, every time.
"""

from __future__ import annotations

#: Plans kept per op; the memo starts over when full (a process that sees more signatures than
#: this is not repeating calls).
MAX_PLANS = 4096

#: Every op's memo (each a module-level object that lives as long as the process).
_ALL: list = []


class Plans(dict):
    """signature -> plan, for one op. A None signature (a call not memoized) or an unhashable one
    (an argument such as a list) is never stored."""

    def __init__(self):
        super().__init__()
        _ALL.append(self)

    def lookup(self, key):
        if key is None:
            return None
        try:
            return self.get(key)
        except TypeError:
            return None

    def keep(self, key, plan):
        """Store ``plan`` under ``key`` (unless None or unhashable) and return it."""
        if key is not None:
            if len(self) >= MAX_PLANS:
                self.clear()
            try:
                self[key] = plan
            except TypeError:
                pass
        return plan


def clear() -> None:
    """Forget every plan of every op (for tests that change a planner's tables or functions)."""
    for plans in _ALL:
        plans.clear()
