"""Lets the CUDA build of torchvision 0.28.0 import beside vLLM's CPU torch, for the vision e2e processes only.

Its `_C.so` (the C++ detection ops) links libtorch_cuda and does not load beside torch 2.13.0+cpu; torchvision
then still registers fake kernels for `torchvision::nms` and `torchvision::qnms` unconditionally
(`torchvision/_meta_registrations.py`), which fails for ops that were never defined. Declaring their schemas
(as `torchvision/csrc/ops/nms.cpp` does) is enough for `import torchvision` to succeed; calling them would
fail, and Qwen2-VL's preprocessing never does. This directory reaches only the processes the vision stack
starts, through PYTHONPATH (tests/e2e/vision_stack.py); see docs/multimodal-e2e.md.
"""

import importlib.util
from pathlib import Path

import torch


def _ops_load() -> bool:
    """Whether torchvision's own C++ ops load here (a CPU build would: then this shim must stay out of its way)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return True  # no torchvision: nothing to do
    for lib in Path(spec.origin).parent.glob("_C*.so"):
        try:
            torch.ops.load_library(str(lib))
            return True
        except OSError:
            return False
    return False


if not _ops_load():
    _lib = torch.library.Library("torchvision", "DEF")
    _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
