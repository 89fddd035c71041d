"""Running the model: a model with the KV machinery and backends that serve it (stack.py), one
step's metadata and forward (runner.py, context.py), and decode steps replayed from CUDA graphs
(cuda_graph.py)."""
