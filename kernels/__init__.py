"""The kernels of the rollout engine, one leaf package the engine calls into (it imports nothing
from `rollout`):

- `rollout_kernels.triton`: Triton kernels for the CUDA backend, and the torch references they
  are tested against. Importing it imports triton.
- `rollout_kernels.cpu`: C kernels for the CPU backend, compiled at first use with the machine's
  C compiler, cached, and called through ctypes.

Importing this package itself imports neither and changes nothing in the process.
"""

if __name__ == "kernels":
    # Imported as `kernels`, not as rollout_kernels: the repository root is on sys.path (python
    # -m from it, a script or notebook there), and this folder hides Hugging Face's hub-kernels
    # distribution, which transformers imports (from 5.25 on it is a dependency). Hand the
    # import over to that distribution where it is installed; without it, nothing changes.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.has_location:  # a package or module, not a bare folder
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # what the import statement returns
        _spec.loader.exec_module(_module)
