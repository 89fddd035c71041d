"""Training recipes on the rollout engine, in three parts:

    algo/     the training library: advantages, losses, the trainer's logprobs, rollouts as
              training batches, PPO's value head, the supervised warm start, and the loops
              (custom_loop.py: GRPO/PPO; trl_loop.py: TRL's GRPOTrainer)
    run/      the plumbing of one run: config, model/tokenizer/engine building (and the
              built-in tiny model), the session that sequences a run, prompt sharding over
              ranks, held-out evaluation, metrics, tracking (JSONL + W&B), plots
    tasks/    where prompts, answers and rewards come from, one file per task

Entry points: `recipes/grpo.py` (accelerate-launchable: custom GRPO/PPO loop or TRL) and
`recipes/demo.py` (`make demo`), with their YAML configs in `recipes/configs/`.

Where the next features go: multi-turn episodes (rollout/agent.py) add a task with an
environment in tasks/ (e.g. tasks/calculator.py), batches that mask env tokens in algo/batch.py
and an episode rollout in the loops; data x tensor-parallel runs change run/build.py (one
engine per tensor-parallel group), run/shard.py (prompts per data-parallel rank) and
run/session.py (process groups).
"""
