"""Engine: the rollout engine a trainer embeds.

`add_request` / `step` / `abort` are the streaming API; `generate` is built on them. Requests
are validated completely before anything is queued, so a bad one raises ValueError and leaves
the engine serving the others.

A step is a transaction (rollout/journal.py): scheduling is one unit, the forward and sampling
change no bookkeeping, committing is another unit; whatever is raised where, the step's new
slots go back and the engine is as it was after its last complete unit. The engine is
single-threaded and holds Ctrl-C while its bookkeeping changes (rollout/guard.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import time
from collections.abc import Iterator

import torch

from .chat import render_conversations
from .colocation import Colocation
from .commit import Committer, Failure
from .config import EngineConfig
from .counter_noise import sample_seed
from .guard import EngineGuard
from .intake import Group, Prompt, check_request, check_requests
from .journal import Journal, RollbackFailed
from .progress import progress
from .kv_pool import kv_bytes_per_token, size_pool
from .model_stack import ModelStack
from .models.base import ROUTED_EXPERTS
from .models.loader import build_model, eos_token_ids, load_into, resolve_model
from .outputs import RolloutOutput, build_output
from .parallel import check_same_tokens, shared_seed, tensor_parallel
from .request import Sequence
from .sampler import SamplingBatch
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .spec.speculator import Speculator
from .spec.verify import verify
from .stats import EngineStats
from .stop import StopChecker


class Engine(Colocation):
    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None,
                 process_group=None, **overrides) -> None:
        """`process_group`: the torch.distributed group of `tensor_parallel_size` ranks to run
        on; None builds one out of the world (rollout/parallel/group.py)."""
        config = config or EngineConfig()
        if overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self.tp = tensor_parallel(config.tensor_parallel_size, process_group)
        hf_config, weights, device, dtype, tokenizer = resolve_model(model, config, tokenizer)
        self.hf_config, self.tokenizer, self.device = hf_config, tokenizer, device
        self.model = build_model(hf_config, config.max_model_len, dtype, device, self.tp)
        load_into(self.model, weights)
        self.vocab_size = hf_config.vocab_size
        layers = self.model.kv_layout.num_layers
        per_token = kv_bytes_per_token(layers, self.model.kv_layout.kv_heads,
                                       self.model.kv_layout.head_dim, dtype,
                                       self.model.slot_extras())
        num_slots = size_pool(config.kv_cache_tokens, config.kv_memory_fraction,
                              config.max_model_len, config.max_num_seqs, per_token, device)
        self.journal = Journal()
        self.stack = ModelStack(self.model, config, num_slots, device, self.journal)
        self.kv, self.runner = self.stack.kv, self.stack.runner
        self.pool, self.cache = self.kv.pool, self.kv.cache
        self.scheduler = Scheduler(config, self.kv)
        self.stop = StopChecker(config.max_model_len, tokenizer)
        self.committer = Committer(self.kv, self.scheduler, self.stop, self.journal)
        self.eos_ids = eos_token_ids(model, hf_config, tokenizer)
        self._groups: dict[str, Group] = {}
        # Finished requests whose outputs are not handed out yet: generate() takes its own,
        # step() the rest (streaming requests that finished while generate() stepped).
        self._ready: dict[str, Group] = {}
        self._ids = itertools.count()  # sequence ids
        self._request_ids = itertools.count()
        # The ranks of a tensor-parallel engine must draw the same seeds for unseeded requests.
        seed = config.seed
        if seed is None and self.tp.size > 1:
            seed = shared_seed(self.tp, device)
        self._seed_rng = random.Random(seed)
        self._stats = EngineStats()
        self.speculator = self._make_speculator(config.speculative)
        self._sample = self.stack.backends.sample
        self.sleep_level = 0
        self._weights_missing = False
        self._guard = EngineGuard()
        self._broken: str | None = None

    def _make_speculator(self, spec) -> Speculator | None:
        if spec is None:
            return None
        drafter = None
        if spec.method == "draft":
            from .counter_noise import DRAFT_STREAM, TOKEN_STREAM
            from .spec.draft_model import DraftModelDrafter

            stream = TOKEN_STREAM if spec.acceptance == "coupled" else DRAFT_STREAM
            drafter = DraftModelDrafter(spec.draft_model, self, stream)
        # The siblings lookup closes over the groups dict, not the engine: a reference back
        # to the engine would make a cycle that keeps a dropped engine's pool alive until gc.
        groups = self._groups
        return Speculator(spec, self.kv, self.config.max_model_len,
                          lambda seq: groups[seq.group].seqs, drafter)

    @contextlib.contextmanager
    def _entered(self, call: str) -> Iterator[None]:
        """Every public call that changes state: one thread at a time, Ctrl-C held except
        during forwards, and refused once a rollback could not finish."""
        with self._guard.hold_interrupts(), self._guard.exclusive(call):
            if self._broken is not None:
                raise RuntimeError(f"{call}: {self._broken}")
            try:
                yield
            except RollbackFailed as e:
                self._broken = (f"the engine's bookkeeping could not be restored after a "
                                f"failure ({e.__cause__!r}); build a new Engine")
                raise

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, hold_kv: bool = False,
                    resume: tuple[str, int] | None = None) -> str:
        """Queue a request; its output comes from a later step(). Multi-turn (see
        rollout/agent.py): `hold_kv` keeps each finished sample's KV locked in the prefix cache
        under the key (request_id, sample index) until `release_hold(key)`, or until memory
        runs short (oldest first; counted in stats.holds_dropped); `resume` names the hold of
        the previous turn, released once this request is admitted on top of it (a hold
        dropped meanwhile costs only the recomputation)."""
        with self._entered("add_request"):
            text, ids, params = self._check_request(prompt, params)
            if request_id is not None:
                request_id = str(request_id)
                if request_id in self._groups or request_id in self._ready:
                    raise ValueError(f"request_id: {request_id!r} is already running (or "
                                     f"finished and not yet returned by step())")
            if not isinstance(hold_kv, bool):
                raise ValueError(f"hold_kv must be True or False, got {hold_kv!r}")
            with self.journal.unit():
                group = self._make_group(text, ids, params, request_id)
                for seq in group.seqs:
                    seq.hold_key = (group.request_id, seq.sample_index) if hold_kv else None
                    seq.resume_key = resume
                self._enqueue(group)
                # An interrupt held meanwhile (e.g. during tokenization) raises here and
                # queues nothing, rather than after the request is queued.
                self._guard.deliver_held()
            return group.request_id

    def _check_request(self, prompt: Prompt, params: SamplingParams | None):
        self._check_ready()
        text, ids, params = check_request(prompt, params, self.vocab_size,
                                          self.config.max_model_len, self.tokenizer)
        if params.return_routed_experts and ROUTED_EXPERTS not in self.model.slot_extras():
            raise ValueError(f"return_routed_experts: the model "
                             f"({self.hf_config.model_type}) has no MoE layers")
        return text, ids, params

    def _make_group(self, text: str | None, ids: list[int], params: SamplingParams,
                    request_id: str | None) -> Group:
        """Draws the request's id (unless given) and seed: only for a checked request."""
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
        return Group(request_id, text, ids, params, seqs)

    def _new_request_id(self) -> str:
        # A counter of its own, skipping the ids in use: callers may name requests "3" too.
        while True:
            request_id = str(next(self._request_ids))
            if request_id not in self._groups and request_id not in self._ready:
                return request_id

    def _enqueue(self, group: Group) -> None:
        self._groups[group.request_id] = group
        self.journal.record(lambda: self._groups.pop(group.request_id))
        for seq in group.seqs:
            self.scheduler.add(seq)
        self.journal.add(self._stats, "prompt_tokens", len(group.prompt_ids) * len(group.seqs))

    def abort(self, request_id: str) -> None:
        """Stop a running request (its computed K/V stays in the prefix cache), or drop the
        output of a finished one that step() has not returned yet (and its KV holds)."""
        with self._entered("abort"), self.journal.unit():
            group = self._ready.pop(str(request_id), None)
            if group is None:
                self._abort(request_id, keep_kv=True)
                return
            self.journal.record(lambda: self._ready.__setitem__(group.request_id, group))
            for seq in group.seqs:
                self.kv.unhold(seq.hold_key)

    def _abort(self, request_id: str, keep_kv: bool) -> None:
        """keep_kv: the computed K/V goes to the prefix cache (a plain abort) or is dropped."""
        group = self._groups.get(str(request_id))
        if group is None:
            raise ValueError(f"request_id: {request_id!r} is not running")
        self._end(group)
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort", keep_kv)

    def _end(self, group: Group) -> None:
        """The request leaves the running set."""
        del self._groups[group.request_id]
        self.journal.record(lambda: self._groups.__setitem__(group.request_id, group))
        if self.speculator is not None:
            self.speculator.forget(group.seqs)

    def release_hold(self, key: tuple[str, int]) -> bool:
        """Unlock the KV kept for a finished sample of a `hold_kv` request (the episode ended);
        False if it was released already (or dropped under memory pressure)."""
        with self._entered("release_hold"), self.journal.unit():
            return self.kv.unhold(key)

    def abort_all(self) -> None:
        """Abort every running request and drop the outputs step() has yet to return."""
        with self._entered("abort_all"), self.journal.unit():
            for request_id in list(self._groups):
                self._abort(request_id, keep_kv=True)
            self._ready.clear()

    @property
    def running_requests(self) -> list[str]:
        """Ids of the requests still running, oldest first."""
        return list(self._groups)

    @property
    def has_unfinished(self) -> bool:
        """Requests are running, or finished with outputs step() has yet to return."""
        return bool(self._groups) or bool(self._ready)

    # --- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RolloutOutput]:
        """Run one scheduler step; returns the requests that finished in it, preceded by the
        streaming requests (add_request) that finished while generate() was stepping."""
        with self._entered("step"):
            if self.scheduler.has_work:
                self._step_or_raise()
            outs = [self._output(g) for g in self._ready.values()]
            # An interrupt held through the step raises while the outputs are still kept
            # for the next step(), not after they were handed over.
            self._guard.deliver_held()
            self._ready = {}
            return outs

    def _step_or_raise(self) -> None:
        if not self._step():
            s = self.scheduler
            raise RuntimeError(
                f"no step can run: {len(s.waiting)} sequences wait, {len(s.running)} run, "
                f"{self.kv.available} of {self.kv.num_slots} KV slots can be allocated; "
                f"check_invariants() tells whether slots leaked")

    def _step(self) -> bool:
        """One scheduler step; False when nothing could be scheduled."""
        marks = [time.perf_counter()]
        try:
            with self.journal.unit():
                batch = self.scheduler.schedule()
            if batch is None:
                return False
            marks.append(time.perf_counter())
            speculating = self.speculator is not None and self.speculator.propose(batch) > 0
            marks.append(time.perf_counter())
            inputs = self.runner.prepare(batch)
            marks.append(time.perf_counter())
            # Nothing below changes bookkeeping until the commit: Ctrl-C may land at once.
            with self._guard.allow_interrupts():
                logits = self.runner.run(inputs)
                marks.append(time.perf_counter())
                items = [it for it in batch.items if it.sample]
                emitted, logprobs, verdicts = self._sample_items(logits, items, speculating)
                if self.config.check_tensor_parallel and self.tp.size > 1:
                    check_same_tokens(emitted, self.tp, self.device)
            marks.append(time.perf_counter())
            with self.journal.unit():
                finished, failed = self.committer.commit(batch, emitted, logprobs)
                if speculating:
                    self.speculator.after_commit(batch, verdicts)
                for request_id, failure in failed.items():
                    self._fail(request_id, failure)
                self._retire(finished, failed)
                self.kv.settle()
            marks.append(time.perf_counter())
        except BaseException:
            self._discard_pending()
            raise
        if speculating:
            self._stats.record_verdicts([v for v, it in zip(verdicts, items) if it.draft])
        self._stats.record_step(batch, sum(map(len, emitted)), tuple(marks))
        return True

    def _discard_pending(self) -> None:
        try:
            self.kv.discard_pending()
            if self.speculator is not None:
                self.speculator.discard_pending()
        except BaseException as e:
            raise RollbackFailed("discarding a failed step's slots") from e

    def _sample_items(self, logits: torch.Tensor, items, speculating: bool):
        """Tokens and logprobs per sampled item (verification's accepted drafts plus one)."""
        rows = self._sampling_batch(items)
        if speculating:
            verdicts = verify(logits, rows, [it.draft for it in items],
                              [it.draft_probs for it in items], self.config.speculative.acceptance,
                              self.stack.backends.accept)
            return [v.tokens for v in verdicts], [v.logprobs for v in verdicts], verdicts
        tokens, lps = self._sample(logits, rows)
        return [[t] for t in tokens.tolist()], [[lp] for lp in lps.tolist()], None

    def _sampling_batch(self, items) -> SamplingBatch:
        """One row per sampled position: a verifying item has len(draft) + 1 of them."""
        rows = [(it.seq, j) for it in items for j in range(len(it.draft) + 1)]
        return SamplingBatch.for_sequences(rows, self.device)

    def _fail(self, request_id: str, failure: Failure) -> None:
        """The request ends as aborted, saying why; the other requests go on."""
        group = self._groups[request_id]
        error = group.error
        group.error = failure.error
        self.journal.record(lambda: setattr(group, "error", error))
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort", failure.keep_kv)

    def _retire(self, finished: list[Sequence], failed: dict[str, Failure]) -> None:
        """Requests whose last sample finished this step wait in `_ready` to be handed out."""
        for request_id in dict.fromkeys([*(s.group for s in finished), *failed]):
            group = self._groups[request_id]
            if group.done:
                self._end(group)
                self._ready[request_id] = group
                self.journal.record(lambda rid=request_id: self._ready.pop(rid))

    def _output(self, group: Group) -> RolloutOutput:
        return build_output(group, self._text)

    def _text(self, seq: Sequence) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.stop.decode(seq.output_ids)
        return text if seq.stop_text_at is None else text[:seq.stop_text_at]

    # --- generate ---------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RolloutOutput]:
        """n samples per prompt; one RolloutOutput per prompt, in order. A request the engine
        aborted (non-finite logits) comes back with finish_reason "abort" and `error`.
        Streaming requests that finish meanwhile are kept for the next step() to return."""
        with self._entered("generate"):
            # Every request is checked before any takes an id or a seed: a failed call changes
            # nothing, not even the seeds later calls draw.
            checked = [self._check_request(p, sp) for p, sp in check_requests(prompts, params)]
            with self.journal.unit():
                groups = [self._make_group(*c, None) for c in checked]
                for g in groups:
                    self._enqueue(g)
            wanted = {g.request_id: i for i, g in enumerate(groups)}
            results: list[RolloutOutput | None] = [None] * len(groups)
            bar = progress(len(groups), use_tqdm)
            try:
                pending = len(groups)
                while pending:
                    self._step_or_raise()
                    for request_id in [r for r in self._ready if r in wanted]:
                        results[wanted[request_id]] = self._output(self._ready.pop(request_id))
                        pending -= 1
                        bar.update(1)
            except BaseException:
                # Nobody will collect this call's outputs: stop spending compute on them.
                self._drop([g.request_id for g in groups])
                raise
            finally:
                bar.close()
            return results

    def chat(self, conversations, params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template_kwargs: dict | None = None
             ) -> list[RolloutOutput]:
        """generate() over conversations (lists of {"role", "content"} messages), rendered by
        the tokenizer's chat template with the generation prompt (rollout/chat.py). Each
        output's `prompt` is the templated text."""
        rendered = render_conversations(self.tokenizer, conversations, chat_template_kwargs)
        outs = self.generate([ids for _, ids in rendered], params, use_tqdm=use_tqdm)
        for out, (text, _) in zip(outs, rendered):
            out.prompt = text
        return outs

    def _drop(self, request_ids: list[str]) -> None:
        """Abort what still runs of these requests and forget their outputs. Their K/V goes
        to the prefix cache; should that fail too, it is freed instead."""
        for request_id in request_ids:
            self._ready.pop(request_id, None)
            if request_id not in self._groups:
                continue
            try:
                with self.journal.unit():
                    self._abort(request_id, keep_kv=True)
            except Exception:
                with self.journal.unit():
                    self._abort(request_id, keep_kv=False)

    # --- inspection -------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        s = self._stats
        s.prompt_tokens_computed = self.committer.prompt_tokens_computed
        s.cache_hit_tokens = self.kv.cache_hit_tokens
        s.preemptions = self.scheduler.num_preemptions
        s.holds_dropped = self.kv.holds_dropped
        s.forward_seconds = self.runner.forward_seconds
        return s

    def check_invariants(self) -> None:
        """Every slot is in exactly one place (free list, tree, one sequence's private tail);
        lock counts equal the running sequences that pin each node; the queues agree with
        what holds KV; every request's sequences are queued, running or finished. The draft
        model's pool, when speculating with one, is checked the same way. Asleep, nothing is
        held."""
        with self._guard.exclusive("check_invariants"):
            self.kv.check()
            self.scheduler.check()
            live = {s.seq_id for g in self._groups.values() for s in g.seqs
                    if not s.is_finished}
            queued = {s.seq_id for s in (*self.scheduler.waiting, *self.scheduler.running)}
            assert live == queued, "requests' sequences differ from those queued or running"
            if self.is_sleeping:
                assert not self._groups and not self.pool.is_allocated
            if self.speculator is not None:
                self.speculator.check_invariants()
