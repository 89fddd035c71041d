"""The plumbing of one run: everything around the training library that a launch needs.

    config.py           RecipeConfig: every knob, from YAML and `--key value`, checked
    options.py          its dict-valued keys as library configs (speculative, lora)
    build.py            tokenizer, model, reference copy and engine from a config
    tiny.py             the built-in model: a tiny Llama and a character tokenizer
    session.py          one run: set up, warm start, score, train, score, report
    shard.py            which prompts each process rolls out
    evaluate.py         held-out greedy accuracy through the engine
    rollout_metrics.py  per-step engine numbers (throughput, cache hits, syncs, acceptance)
    tracking.py         metrics to the returned history, JSONL and W&B
    plot.py             the reward curve PNG
"""
