"""The training library: what turns rollouts into a policy update.

    advantages.py   group-normalised (GRPO) and GAE (PPO) advantages
    losses.py       clipped GRPO / PPO objectives, KL to a reference
    logprobs.py     the trainer's side of the importance ratio
    batch.py        a step's rollouts as padded training tensors
    value_head.py   PPO's critic on the policy's hidden states
    warmstart.py    the supervised warm start (teacher forcing on prompt -> answer)
    custom_loop.py  the GRPO / PPO loop on the engine (`--trainer custom`)
    trl_loop.py     TRL's GRPOTrainer fed by the engine (`--trainer trl`)
"""
