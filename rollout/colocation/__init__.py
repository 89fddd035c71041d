"""Colocation with the trainer: sleep, wake-up and weight updates (colocation.py), the weights'
parking (parking.py), where new weights come from (weights.py), and the memory given back
(device_memory.py, host_heap.py)."""
