"""Test-session settings. Without a GPU, Triton kernels run under the interpreter: triton reads
TRITON_INTERPRET when it is imported, so it is set here, before any test module imports it."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
