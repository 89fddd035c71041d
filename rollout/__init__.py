"""An RL rollout engine embedded in the trainer's process.

    engine = Engine(model, EngineConfig(kv_cache_tokens=65536, max_model_len=4096), tokenizer=tok)
    outs = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, logprobs=True, seed=0))

The package reads top-down (docs/architecture.md): `engine/` steps requests through `executor/`
(the model and its KV machinery) over `kv/`, `attention/`, `sample/` and `models/`; `spec/`
drafts and verifies; `colocation/` hands memory back to the trainer; `parallel/` shards across
ranks; `ops/` chooses each op's implementation; the kernels live in `rollout_kernels`.
"""

from .api import generate
from .colocation.weights import watch_optimizer
from .config import EngineConfig
from .engine.engine import Engine
from .engine.stats import EngineStats
from .requests.outputs import RolloutOutput, Sample
from .sample.params import SamplingParams
from .sample.support import Support, logprobs_on_support
from .spec.config import SpeculativeConfig

__all__ = ["Engine", "EngineConfig", "EngineStats", "RolloutOutput", "Sample", "SamplingParams",
           "SpeculativeConfig", "Support", "generate", "logprobs_on_support", "watch_optimizer"]
