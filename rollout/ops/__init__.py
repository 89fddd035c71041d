"""The one dispatch for implementations: backends (backend.py) and the ops and layers that have
an implementation per backend (op.py); and a step's host lists as tensors (host_lists.py)."""
