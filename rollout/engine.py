"""Engine: the rollout engine a trainer embeds.

`add_request` / `step` / `abort` are the streaming API; `generate` is built on them. Requests
are validated completely before anything is queued, so a bad one raises ValueError and leaves
the engine serving the others.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from collections.abc import Sequence as Seq

import torch

from .config import EngineConfig
from .kv_pool import kv_bytes_per_token, size_pool
from .model_stack import ModelStack
from .models.loader import build_model, eos_token_ids, load_into, resolve_model
from .outputs import RolloutOutput, Sample
from .request import Sequence
from .sampler import SamplingBatch, sample, sample_seed
from .sampling_params import SamplingParams, as_int
from .sleep import tensor_bytes
from .spec.speculator import Speculator
from .spec.verify import verify
from .stats import EngineStats
from .stop import StopChecker
from .weights import buckets, named_shapes_and_tensors

Prompt = str | Seq[int]


@dataclasses.dataclass
class _Group:
    """One prompt's request: its n sequences and what the output needs."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]

    @property
    def done(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class Engine:
    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None,
                 **overrides) -> None:
        config = config or EngineConfig()
        if overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        hf_config, weights, device, dtype, tokenizer = resolve_model(model, config, tokenizer)
        self.hf_config, self.tokenizer, self.device = hf_config, tokenizer, device
        self.model = build_model(hf_config, config.max_model_len, dtype, device)
        load_into(self.model, weights)
        self.vocab_size = hf_config.vocab_size
        layers = hf_config.num_hidden_layers
        per_token = kv_bytes_per_token(layers, self.model.num_kv_heads, self.model.head_dim, dtype)
        num_slots = size_pool(config.kv_cache_tokens, config.kv_memory_fraction,
                              config.max_model_len, config.max_num_seqs, per_token, device)
        self.stack = ModelStack(self.model, config, num_slots, device)
        self.pool, self.cache, self.table = self.stack.pool, self.stack.cache, self.stack.table
        self.scheduler, self.backend = self.stack.scheduler, self.stack.backend
        self.runner = self.stack.runner
        self.stop = StopChecker(config.max_model_len, tokenizer)
        self.eos_ids = eos_token_ids(model, hf_config, tokenizer)
        self._groups: dict[str, _Group] = {}
        # Outputs of streaming requests that finished while generate() stepped; the next
        # step() returns them.
        self._held: dict[str, RolloutOutput] = {}
        self._ids = itertools.count()  # sequence ids
        self._request_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._stats = EngineStats()
        self.speculator = self._make_speculator(config.speculative)
        self._sample = _triton_sample if device.type == "cuda" else sample
        self.sleep_level = 0
        self._weights_missing = False

    def _make_speculator(self, spec) -> Speculator | None:
        if spec is None:
            return None
        drafter = None
        if spec.method == "draft":
            from .sampler import DRAFT_STREAM, TOKEN_STREAM
            from .spec.draft_model import DraftModelDrafter

            stream = TOKEN_STREAM if spec.acceptance == "coupled" else DRAFT_STREAM
            drafter = DraftModelDrafter(spec.draft_model, self, stream)
        return Speculator(spec, self.scheduler, self.config.max_model_len,
                          lambda seq: self._groups[seq.group].seqs, drafter)

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        text, ids, params = self._check_request(prompt, params)
        if request_id is not None:
            request_id = str(request_id)
            if request_id in self._groups or request_id in self._held:
                raise ValueError(f"request_id: {request_id!r} is already running (or finished "
                                 f"and not yet returned by step())")
        group = self._make_group(text, ids, params, request_id)
        self._enqueue(group)
        return group.request_id

    def _check_request(self, prompt: Prompt, params: SamplingParams | None
                       ) -> tuple[str | None, list[int], SamplingParams]:
        """Everything a request must pass, changing no state: its text, its token ids and the
        engine's own validated copy of its params."""
        self._check_ready()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        # A copy built through __init__ re-runs validation on the fields as they are now (they
        # may have been set after construction) and keeps later edits of the caller's object,
        # often reused for the next batch, away from this request.
        params = dataclasses.replace(params)
        params.check_vocab(self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; pass tokenizer= to Engine")
        text, ids = self._prompt_ids(prompt)
        return text, ids, params

    def _make_group(self, text: str | None, ids: list[int], params: SamplingParams,
                    request_id: str | None) -> _Group:
        """Draws the request's id (unless given) and seed: only for a request that passed
        _check_request."""
        if request_id is None:
            request_id = self._new_request_id()
        # Greedy requests take no seed, so adding an evaluation does not shift later rollouts.
        if params.seed is not None or params.greedy:
            base = params.seed or 0
        else:
            base = self._seed_rng.getrandbits(63)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_ids)
        seqs = [Sequence(seq_id=next(self._ids), group=request_id, sample_index=j,
                         prompt_ids=ids, params=params, seed=sample_seed(base, j),
                         stop_ids=stop_ids) for j in range(params.n)]
        return _Group(request_id, text, ids, params, seqs)

    def _new_request_id(self) -> str:
        # A counter of its own, skipping the ids in use: callers may name requests "3" too.
        while True:
            request_id = str(next(self._request_ids))
            if request_id not in self._groups and request_id not in self._held:
                return request_id

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a string prompt needs a tokenizer; pass tokenizer= "
                                 "to Engine or give token ids")
            text, prompt = prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: empty prompt; it needs at least 1 token")
        limit = self.config.max_model_len - 1
        if len(ids) > limit:
            raise ValueError(f"prompt: {len(ids)} tokens, but max_model_len="
                             f"{self.config.max_model_len} allows at most {limit} so that one "
                             f"token can be generated")
        ids = [as_int("prompt: token id", t) for t in ids]
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt: token id {t!r} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        return text, ids

    def _enqueue(self, group: _Group) -> None:
        self._groups[group.request_id] = group
        for seq in group.seqs:
            self.scheduler.add(seq)
        self._stats.prompt_tokens += len(group.prompt_ids) * len(group.seqs)

    def abort(self, request_id: str) -> None:
        self._abort(request_id, keep_kv=True)

    def _abort(self, request_id: str, keep_kv: bool) -> None:
        """keep_kv: the computed K/V goes to the prefix cache (a plain abort) or is dropped."""
        group = self._groups.pop(str(request_id), None)
        if group is None:
            raise ValueError(f"request_id: {request_id!r} is not running")
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort", keep_kv)

    def abort_all(self) -> None:
        """Abort every running request and drop the outputs step() has yet to return."""
        for request_id in list(self._groups):
            self.abort(request_id)
        self._held.clear()

    @property
    def has_unfinished(self) -> bool:
        """Requests are running, or finished with outputs step() has yet to return."""
        return bool(self._groups) or bool(self._held)

    # --- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RolloutOutput]:
        """Run one scheduler step; returns the requests that finished in it, preceded by the
        streaming requests (add_request) that finished while generate() was stepping."""
        outs = self._step()
        if self._held:
            outs = [*self._held.values(), *outs]
            self._held.clear()
        return outs

    def _step(self) -> list[RolloutOutput]:
        marks = [time.perf_counter()]
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        marks.append(time.perf_counter())
        speculating = self.speculator is not None and self.speculator.propose(batch) > 0
        marks.append(time.perf_counter())
        inputs = self.runner.prepare(batch)
        marks.append(time.perf_counter())
        logits = self.runner.run(inputs)
        marks.append(time.perf_counter())
        items = [it for it in batch.items if it.sample]
        rows = self._sampling_batch(items)
        if speculating:
            verdicts = verify(logits, rows, [it.draft for it in items],
                              [it.draft_probs for it in items], self.config.speculative.acceptance)
            emitted = [v.tokens for v in verdicts]
            logprobs = [v.logprobs for v in verdicts]
        else:
            tokens, lps = self._sample(logits, rows)
            emitted = [[t] for t in tokens.tolist()]
            logprobs = [[lp] for lp in lps.tolist()]
        bad = [it.seq for it, lps in zip(items, logprobs) if not all(map(math.isfinite, lps))]
        if bad:
            self.scheduler.undo(batch)
            self._abort_bad(bad)
        marks.append(time.perf_counter())
        finished = self.scheduler.commit(batch, emitted, logprobs, self.stop)
        if speculating:
            drafted = [v for v, it in zip(verdicts, items) if it.draft]
            self.speculator.after_commit(batch, drafted)
            self._stats.record_verdicts(drafted)
        marks.append(time.perf_counter())
        self._stats.record_step(batch, sum(map(len, emitted)), tuple(marks))
        return self._collect_finished(finished)

    def _sampling_batch(self, items) -> SamplingBatch:
        """One row per sampled position: a verifying item has len(draft) + 1 of them."""
        rows = [(it.seq, j) for it in items for j in range(len(it.draft) + 1)]
        return SamplingBatch.for_sequences(rows, self.device)

    def _abort_bad(self, seqs: list[Sequence]) -> None:
        groups = sorted({s.group for s in seqs})
        for request_id in groups:
            # Their K/V may hold the non-finite values: cached, it would poison later requests
            # that share the prefix.
            self._abort(request_id, keep_kv=False)
        raise ValueError(f"logits: the model produced non-finite values (nan/inf) for "
                         f"request(s) {groups}; they were aborted, the others go on")

    def _collect_finished(self, finished: list[Sequence]) -> list[RolloutOutput]:
        """Outputs of the requests whose last sample finished in this step (only the groups
        of this step's finished samples are looked at, not every request in flight)."""
        ids = dict.fromkeys(s.group for s in finished)  # ordered, unique
        done = [self._groups[i] for i in ids if self._groups[i].done]
        for g in done:
            del self._groups[g.request_id]
        return [self._output(g) for g in done]

    def _output(self, group: _Group) -> RolloutOutput:
        samples = []
        for seq in group.seqs:
            ids = seq.output_ids
            samples.append(Sample(
                index=seq.sample_index, token_ids=ids,
                logprobs=list(seq.logprobs) if group.params.logprobs else None,
                finish_reason=seq.finish_reason, text=self._text(seq)))
        return RolloutOutput(group.request_id, group.prompt_ids, samples, group.prompt)

    def _text(self, seq: Sequence) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.stop.decode(seq.output_ids)
        return text if seq.stop_text_at is None else text[:seq.stop_text_at]

    # --- generate ---------------------------------------------------------------------------
    def generate(self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] = None,
                 use_tqdm: bool = False) -> list[RolloutOutput]:
        """n samples per prompt; one RolloutOutput per prompt, in order. Streaming requests
        that finish meanwhile are kept for the next step() to return."""
        if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a list of strings or of token-id lists")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        # Every request is checked before any takes an id or a seed: a failed call changes
        # nothing, not even the seeds later calls draw.
        checked = [self._check_request(p, sp) for p, sp in zip(prompts, params)]
        groups = [self._make_group(*c, None) for c in checked]
        for g in groups:
            self._enqueue(g)
        wanted = {g.request_id: i for i, g in enumerate(groups)}
        results: list[RolloutOutput | None] = [None] * len(groups)
        bar = _progress(len(groups), use_tqdm)
        pending = len(groups)
        try:
            while pending:
                for out in self._step():
                    if out.request_id in wanted:
                        results[wanted[out.request_id]] = out
                        pending -= 1
                        bar.update(1)
                    else:
                        self._held[out.request_id] = out
        except BaseException:
            # Nobody will collect this call's outputs: stop spending compute on them.
            for g in groups:
                if g.request_id in self._groups:
                    self.abort(g.request_id)
            raise
        finally:
            bar.close()
        return results

    # --- colocation -------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    @property
    def needs_weights(self) -> bool:
        """True after sleep(level=2) until update_weights has refilled every weight."""
        return self._weights_missing

    def _check_ready(self) -> None:
        if self.is_sleeping:
            raise RuntimeError("the engine is asleep: call wake_up() first")
        if self._weights_missing:
            raise RuntimeError("the engine has no weights since sleep(level=2): call "
                               "update_weights(...) before generating")

    def _check_idle(self, what: str) -> None:
        if self._groups:
            raise RuntimeError(f"{what}: {len(self._groups)} requests are still running; "
                               f"let them finish or abort() them first")

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (the prefix cache empties) and park the weights: on host memory
        (level 1) or nowhere (level 2, update_weights must run after wake_up)."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self._check_idle("sleep")
        if level <= self.sleep_level:
            return
        # Deepening 1 -> 2 only drops the weights parked on the host: waking first would
        # allocate the pools and weights on a device the trainer may have filled since.
        deepen = self.is_sleeping
        self.stack.sleep(level)
        if self.speculator is not None and not deepen:
            self.speculator.drafter.sleep()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.sleep_level = level
        self._weights_missing = self._weights_missing or level == 2

    def wake_up(self) -> None:
        if not self.is_sleeping:
            return
        self.stack.wake_up()
        if self.speculator is not None:
            self.speculator.drafter.wake_up()
        self.sleep_level = 0

    def update_weights(self, source, bucket_bytes: int = 256 << 20) -> dict:
        """Copy new weights in place: `source` is the trainer's model (DDP/compile/PEFT wrapped
        or not) or (HF name, tensor) pairs. Clears the prefix cache, whose KV came from the
        old weights. Every name and shape is checked before the first copy, so an unknown
        name or a wrong shape raises ValueError and changes nothing. Returns {'bytes',
        'seconds'}."""
        if self.is_sleeping:
            raise RuntimeError("update_weights: the engine is asleep: call wake_up() first")
        self._check_idle("update_weights")
        t0 = time.perf_counter()
        shapes, named = named_shapes_and_tensors(source)
        written = self.model.check_weights(shapes)
        if self._weights_missing:
            missing = self.model.expected_weight_names() - written
            if missing:
                raise ValueError(f"update_weights: after sleep(level=2) every weight is needed; "
                                 f"{len(missing)} missing, e.g. {sorted(missing)[:3]}")
        dtype = self.model.model.embed_tokens.weight.dtype
        moved = 0
        try:
            for bucket in buckets(named, self.device, dtype, bucket_bytes):
                self.model.load_weights(bucket)
                moved += sum(t.numel() * t.element_size() for _, t in bucket)
        finally:
            # KV computed by the old weights goes, even when a copy failed half way.
            self.cache.evict(self.cache.total_size)
        self._weights_missing = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"bytes": moved, "seconds": time.perf_counter() - t0}

    def memory_held(self) -> int:
        """Bytes of tensors the engine holds on its device (weights, KV pool, slot table)."""
        tensors = [*self.model.parameters(), *self.model.buffers(), self.pool.buffer,
                   self.pool.free_slots() if self.pool.is_allocated else None, self.table.table]
        return tensor_bytes(t for t in tensors if t is not None and t.device == self.device)

    # --- inspection -------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        s = self._stats
        s.prompt_tokens_computed = self.scheduler.prompt_tokens_computed
        s.cache_hit_tokens = self.scheduler.cache_hit_tokens
        s.preemptions = self.scheduler.num_preemptions
        s.forward_seconds = self.runner.forward_seconds
        return s

    def check_invariants(self) -> None:
        """Every slot is in exactly one place (free list, tree, one sequence's private tail);
        lock counts equal the running sequences that pin each node. The draft model's pool,
        when speculating with one, is checked the same way."""
        self.scheduler.check_invariants()
        if self.speculator is not None:
            self.speculator.drafter.check_invariants()


def _triton_sample(logits: torch.Tensor, rows: SamplingBatch):
    """The fused Triton sampler; same noise and filters as rollout.sampler.sample."""
    from kernels import sample as kernel_sample

    return kernel_sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p,
                         rows.seed, rows.position)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, use_tqdm: bool):
    if not use_tqdm:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="rollout", unit="prompt")
