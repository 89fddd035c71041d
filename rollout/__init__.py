"""An RL rollout engine embedded in the trainer's process.

    engine = Engine(model, EngineConfig(kv_cache_tokens=65536, max_model_len=4096), tokenizer=tok)
    outs = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, logprobs=True, seed=0))
"""

from .api import generate
from .config import EngineConfig
from .engine import Engine
from .outputs import RolloutOutput, Sample
from .sampling_params import SamplingParams
from .stats import EngineStats

__all__ = ["Engine", "EngineConfig", "EngineStats", "RolloutOutput", "Sample", "SamplingParams",
           "generate"]
