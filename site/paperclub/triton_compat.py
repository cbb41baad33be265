"""Work-arounds for Triton's CPU interpreter (``TRITON_INTERPRET=1``), shared by every repro, and
the check whether it is in use.

Triton 3.6's interpreter turns a scalar tensor into a Python int with ``int(array)`` on a
one-element array, which numpy >= 2.4 refuses; any loop over a run-time bound then fails. The
fix converts through the element instead. It touches only the interpreter, only when it is in use.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``): no GPU, and no
    inline PTX or Gluon there."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fix_interpreter_index() -> None:
    """Install the ``__index__`` fix once (a no-op unless ``TRITON_INTERPRET=1``)."""
    if not interpreting():
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_paperclub_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._paperclub_fixed = True
    interpreter._patch_lang_tensor = patched
