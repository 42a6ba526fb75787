"""Where the Triton kernels can run: CUDA tensors, or any tensors under Triton's CPU interpreter.

triton.jit chooses interpreter or compiler from TRITON_INTERPRET when it decorates, and triton's own
library functions are decorated when triton is imported, so the choice is made once per process: the
variable must be set before the first `import triton`. INTERPRETED records the choice our kernels got
(this module is imported right before they are decorated).
"""

from __future__ import annotations

import torch
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)


def check_device(*tensors: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; say what to do instead of failing inside the launcher."""
    if INTERPRETED:
        return
    for t in tensors:
        if not t.is_cuda:
            raise ValueError(
                f"Triton kernels need CUDA tensors, got a tensor on {t.device}; on CPU call the _ref twin "
                "(kernels.reference), or run the interpreter: TRITON_INTERPRET=1 set before triton is "
                "imported."
            )
