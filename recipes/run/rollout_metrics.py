"""Per-step engine numbers from its cumulative EngineStats: throughput, prefix-cache hit rate,
weight syncs, and speculative acceptance when the engine reports it."""

from __future__ import annotations


class EngineMeter:
    def __init__(self, engine) -> None:
        self.engine = engine
        self._before: dict = {}

    def start(self) -> None:
        self._before = self.engine.stats.as_dict()

    def finish(self, seconds: float) -> dict:
        now = self.engine.stats.as_dict()
        delta = {k: now[k] - self._before.get(k, 0) for k in now
                 if isinstance(now[k], (int, float)) and not isinstance(now[k], bool)}
        prompt = delta.get("prompt_tokens", 0)
        out = {
            "rollout/generated_tokens": delta.get("generated_tokens", 0),
            # Engine steps the rollout took: what a tail of few long samples costs where a step
            # costs about the same whatever its batch (a GPU at these sizes), the time it saves.
            "rollout/engine_steps": delta.get("steps", 0),
            "rollout/tokens_per_second": delta.get("generated_tokens", 0) / seconds
            if seconds > 0 else 0.0,
            # Share of prompt tokens (n per prompt counted) served from the radix tree.
            "rollout/prefix_cache_hit_rate": delta.get("prompt_hit_tokens", 0) / prompt
            if prompt else 0.0,
            "rollout/prompt_tokens_computed": delta.get("prompt_tokens_computed", 0),
            "rollout/preemptions": delta.get("preemptions", 0),
        }
        # The step's weight syncs (ColocatedRollout's, on entering): bytes and seconds of the
        # last, and whether it copied a LoRA adapter only (rollout/lora/).
        if delta.get("weight_syncs"):
            out["weights/sync_bytes"] = now["weight_sync_bytes"]
            out["weights/sync_seconds"] = now["weight_sync_seconds"]
            out["weights/adapter_only"] = delta.get("adapter_syncs", 0) / delta["weight_syncs"]
        # Only when speculative decoding proposed drafts this step (it may be off, or switched
        # off for large batches, where a 0/0 rate would read as "nothing accepted").
        if delta.get("spec_proposed"):
            out["rollout/spec_acceptance"] = delta["spec_accepted"] / delta["spec_proposed"]
            out["rollout/spec_tokens_per_verification"] = (
                delta["spec_emitted"] / delta["spec_verifications"])
            # Per draft source (method "suffix": self, siblings, history).
            before = self._before.get("spec_sources", {})
            for source, (proposed, accepted) in now["spec_sources"].items():
                was = before.get(source, [0, 0])
                if proposed > was[0]:
                    out[f"rollout/spec_acceptance/{source}"] = (
                        (accepted - was[1]) / (proposed - was[0]))
                    out[f"rollout/spec_proposed/{source}"] = proposed - was[0]
        return out
