"""Two GRPO steps under `accelerate launch --num_processes 2 --cpu` (gloo), run by
tests/integrations/test_trl_hook.py. Each rank builds and drives its own engine; each writes what its engine
did to OUT_DIR/rank<i>.json for the test to check."""

import json
import os
import sys

sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from models import char_tokenizer, tiny_model  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from rollout import EngineConfig  # noqa: E402
from trainer_hooks.trl import RolloutGRPOTrainer  # noqa: E402


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "broadcast", "broadcast_object_list", "barrier", "reduce", "gather", "scatter",
               "reduce_scatter_tensor")


class SleepCheck(TrainerCallback):
    def __init__(self):
        self.trainer, self.asleep = None, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.asleep.append(self.trainer.engine.is_sleeping)


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    tok = char_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
    data = Dataset.from_dict({"prompt": ["abc", "hello", "1+1=", "xyz", "q", "ok", "no", "z9"]})
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, report_to=[], max_steps=2,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      logging_steps=1, save_strategy="no", seed=0, temperature=0.8)
    check = SleepCheck()
    trainer = RolloutGRPOTrainer(
        model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args, train_dataset=data, processing_class=tok, callbacks=[check],
        engine_config=EngineConfig(kv_cache_tokens=256, max_model_len=32, max_num_seqs=8))
    check.trainer = trainer
    seen, collectives = [], []
    rollout_func = trainer.rollout_func

    def spy(prompts, t):
        # A collective inside the rollout would make this rank wait on the other's generation.
        seen.append(list(prompts))
        saved = {n: getattr(dist, n) for n in COLLECTIVES}
        for n in COLLECTIVES:
            setattr(dist, n, lambda *a, _n=n, **k: collectives.append(_n) or saved[_n](*a, **k))
        try:
            return rollout_func(prompts, t)
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)

    trainer.rollout_func = spy
    trainer.train()
    acc = trainer.accelerator
    stats = trainer.engine.stats
    report = dict(rank=acc.process_index, world=acc.num_processes, pid=os.getpid(),
                  device=str(trainer.engine.device), generated_tokens=stats.generated_tokens,
                  prompt_tokens=stats.prompt_tokens, calls=trainer.rollout.calls,
                  prompts=seen, collectives_in_rollout=collectives,
                  asleep_at_optimizer_step=check.asleep,
                  is_sleeping=trainer.engine.is_sleeping,
                  model_wrapper=type(trainer.model_wrapped).__name__)
    with open(os.path.join(out_dir, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(report, f)
    # Explicit teardown: left to interpreter exit, gloo can abort a rank after success.
    acc.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
