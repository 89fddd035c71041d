"""Engine: the rollout engine a trainer embeds.

`add_request` / `step` / `abort` are the streaming API; `generate` is built on them, and so is
`rollout`, whose unfinished groups are carried into later calls (carry.py). Requests
are validated completely before anything is queued, so a bad one raises ValueError and leaves
the engine serving the others.

A step is a transaction (rollout/journal.py): scheduling is one unit, the forward and sampling
change no bookkeeping, committing is another unit; whatever is raised where, the step's new
slots go back and the engine is as it was after its last complete unit. The engine is
single-threaded and holds Ctrl-C while its bookkeeping changes (guard.py). Sleep, wake-up and
weight updates are its `colocation`'s (rollout/colocation/colocation.py), called through the
same guard (colocated.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

from ..colocation.colocation import Colocation
from ..config import EngineConfig, known_fields
from ..executor.stack import ModelStack, plain_tensors, pool_slots
from ..fields import as_bool
from ..journal import Journal, RollbackFailed
from ..lora.sync import LoraSync
from ..models.base import ROUTED_EXPERTS
from ..models.loader import (build_model, check_context, eos_token_ids, fit_max_model_len,
                             load_into, resolve_model)
from ..parallel import shared_seed, tensor_parallel
from ..parallel.agree import REQUESTS_DIFFER, agree_min, check_same_config, check_same_requests
from ..parallel.collectives import check_same, digest
from ..requests.intake import Prompt, check_request, check_requests, hold_key, prefix_ids
from ..requests.outputs import RolloutOutput, build_output
from ..requests.request import Request
from ..requests.sequence import Sequence
from ..sample.params import SamplingParams
from ..score.state import ScoreOutput
from ..spec.draft_model import build_draft_model
from ..spec.speculator import make_speculator
from .carry import Carry
from .chat import chat
from .colocated import ColocationCalls
from .commit import Committer
from .guard import EngineGuard
from .inspect import EngineView, check, current_stats, view
from .progress import progress
from .requests import RequestTable
from .scheduler import Scheduler
from .score import score
from .stats import EngineStats
from .step import StepRunner
from .stop import StopChecker


class Engine(ColocationCalls):
    @plain_tensors  # built inside torch.inference_mode, it must still run outside it
    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None,
                 process_group=None, **overrides) -> None:
        """`process_group`: the torch.distributed group of `tensor_parallel_size` ranks to run
        on; None builds one out of the world (rollout/parallel/group.py)."""
        if config is None:
            config = EngineConfig()
        elif not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig or None, got "
                             f"{type(config).__name__}")
        # The engine's own checked copy (replace reruns EngineConfig's checks), as with
        # SamplingParams: a field set after the config was built is checked here (it had
        # reached torch as "zeros: Dimension size must be non-negative"), and the caller's
        # later edits do not reach the running engine.
        config = dataclasses.replace(config, **known_fields(overrides))
        self.tp = tensor_parallel(config.tensor_parallel_size, process_group)
        if tokenizer is not None and not all(
                callable(getattr(tokenizer, f, None)) for f in ("encode", "decode")):
            raise ValueError(f"tokenizer must encode and decode (a transformers tokenizer), got "
                             f"{type(tokenizer).__name__}")
        hf_config, weights, device, dtype, tokenizer = resolve_model(model, config, tokenizer)
        self.config = config = fit_max_model_len(config, hf_config)
        self.hf_config, self.tokenizer, self.device = hf_config, tokenizer, device
        agree = None
        if self.tp.size > 1:  # before any rank builds (or refuses) anything the others do not
            check_same_config(config, hf_config, self.tp, device)
            agree = functools.partial(agree_min, tp=self.tp, device=device)
        check_context(hf_config, config.max_model_len)  # (after the ranks agree: all refuse)
        self.model = build_model(hf_config, config.max_model_len, dtype, device, self.tp,
                                 source=model)
        # A PEFT LoRA model: its base unmerged, its adapter beside it (rollout/lora/).
        self.lora = LoraSync(self.model, config.lora, config.batch_invariant)
        adapter = self.lora.plan(model)
        load_into(self.model, weights if adapter is None else adapter.tensors())
        self.vocab_size = hf_config.vocab_size
        self.journal = Journal()
        # Before the pool is sized, which counts the draft's pool and what its weights took.
        draft = build_draft_model(config.speculative, config, tokenizer, hf_config.vocab_size,
                                  dtype, device)
        self.stack = ModelStack(self.model, config,
                                pool_slots(self.model, config, dtype, device, agree, draft),
                                device, self.journal)
        # On the projections as the stack's backend set them up (none: a plain or merged model).
        self.lora.attach(adapter, self.stack.backend)
        if adapter is not None:
            self.lora.copy(adapter)
            self.lora.remember(adapter)
            self.model.pack_weights()
        self.kv, self.runner = self.stack.kv, self.stack.runner
        self.pool, self.cache = self.kv.pool, self.kv.cache
        self.scheduler = Scheduler(config, self.kv)
        self.stop = StopChecker(config.max_model_len, tokenizer)
        self.eos_ids = eos_token_ids(model, hf_config, tokenizer)
        # The ranks of a tensor-parallel engine must draw the same seeds for unseeded requests.
        seed = config.seed
        if seed is None and self.tp.size > 1:
            seed = shared_seed(self.tp, device)
        self.requests = RequestTable(self.journal, seed)
        self._stats = EngineStats()
        self.carry = Carry(self.scheduler, self.requests, self.kv, self.journal, self._stats,
                           config.carried_kv)
        sleepers: list = []  # the draft model's stack, once built
        self.colocation = colocation = Colocation(self.stack, device, self.carry,
                                                  lambda: sleepers, self.lora)
        colocation.took_weights_from(model)
        self.committer = Committer(self.kv, self.scheduler, self.stop, self.journal,
                                   lambda: colocation.weights_version)
        # The siblings lookup closes over the running dict, not the engine: a reference back
        # to the engine would make a cycle that keeps a dropped engine's pool alive until gc.
        running = self.requests.running
        self.speculator = make_speculator(config.speculative, self.stack, config, draft,
                                          lambda seq: running[seq.group].seqs)
        if self.speculator is not None:
            self.requests.forget = self.speculator.forget
            sleepers.append(self.speculator.drafter)
        self._guard = EngineGuard()
        self._broken: str | None = None
        tp = self.tp if self.tp.size > 1 else None
        self._stepper = StepRunner(self.stack, self.scheduler, self.committer, self.speculator,
                                   self.requests, self._guard, self._stats, tp,
                                   config.check_tensor_parallel and tp is not None)

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
        """Queue a request; its output comes from a later step(). `hold_kv` keeps each
        finished sample's KV locked under (request_id, sample index) for the next turn, which
        names it in `resume` (multi-turn: rollout/agent.py, docs/multi-turn.md)."""
        with self._entered("add_request"):
            text, ids, params = self.check_request(prompt, params)
            if request_id is not None:
                request_id = self._check_new_id("request_id", request_id)
            if not isinstance(hold_kv, bool):
                raise ValueError(f"hold_kv must be True or False, got {hold_kv!r}")
            resume = None if resume is None else hold_key(resume)
            with self.journal.unit():
                request = self.requests.make(text, ids, params, request_id, self.eos_ids)
                for seq in request.seqs:
                    seq.hold_key = (request.request_id, seq.sample_index) if hold_kv else None
                    seq.resume_key = resume
                self._enqueue(request)
                # An interrupt held meanwhile (e.g. during tokenization) raises here and
                # queues nothing, rather than after the request is queued.
                self._guard.deliver_held()
            return request.request_id

    def _check_new_id(self, name: str, request_id) -> str:
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"{name}: {request_id!r} is already running (or finished and not "
                             f"yet returned)")
        return request_id

    def check_request(self, prompt: Prompt, params: SamplingParams | None):
        """(text, token ids, params) of a request, or what add_request would refuse it for,
        refused now (an engine asleep too)."""
        self.colocation.check_ready()
        text, ids, params = check_request(prompt, params, self.vocab_size,
                                          self.config.max_model_len, self.tokenizer)
        if params.return_routed_experts and ROUTED_EXPERTS not in self.model.slot_extras():
            raise ValueError(f"return_routed_experts: the model "
                             f"({self.hf_config.model_type}) has no MoE layers")
        return text, ids, params

    def _enqueue(self, request: Request) -> None:
        self.requests.start(request)
        for seq in request.seqs:
            self.scheduler.add(seq)
        self.journal.add(self._stats, "prompt_tokens",
                         len(request.prompt_ids) * len(request.seqs))

    def abort(self, request_id: str) -> None:
        """Stop a running request (its computed K/V stays in the prefix cache), or drop the
        output of a finished one that step() has not returned yet (and its KV holds)."""
        with self._entered("abort"), self.journal.unit():
            if not self._drop_ready(str(request_id)):
                self._abort(request_id)

    def _drop_ready(self, request_id: str) -> bool:
        """A finished request's output leaves unreturned, and its KV holds with it (no one
        will resume them); False if it is not finished."""
        request = self.requests.take_ready(request_id)
        if request is None:
            return False
        for seq in request.seqs:
            self.kv.unhold(seq.hold_key)
        return True

    def _abort(self, request_id: str) -> None:
        """A running request stopped, its computed K/V kept in the prefix cache."""
        request = self.requests.running.get(str(request_id))
        if request is None:
            raise ValueError(f"request_id: {request_id!r} is not running")
        self.carry.abort(request, keep_kv=True)

    def release_hold(self, key: tuple[str, int]) -> bool:
        """Unlock the KV kept for a finished sample of a `hold_kv` request (the episode ended);
        False if it was released already (or dropped under memory pressure). `key` is read
        as `resume=` reads it."""
        with self._entered("release_hold"), self.journal.unit():
            return self.kv.unhold(hold_key(key, "key"))

    def abort_all(self) -> None:
        """Abort every running request and drop the outputs step() has yet to return (and
        their KV holds)."""
        with self._entered("abort_all"), self.journal.unit():
            for request_id in list(self.requests.running):
                self._abort(request_id)
            for request_id in list(self.requests.ready):
                self._drop_ready(request_id)

    @property
    def running_requests(self) -> list[str]:
        """Ids of the requests still running, oldest first."""
        return list(self.requests.running)

    @property
    def has_unfinished(self) -> bool:
        """Requests are running, or finished with outputs step() has yet to return."""
        return bool(self.requests.running) or bool(self.unreturned_outputs)

    @property
    def unreturned_outputs(self) -> int:
        """Finished requests whose outputs step() has yet to return (rollout()'s groups are
        rollout()'s to hand out)."""
        return sum(not r.from_rollout for r in self.requests.ready.values())

    @property
    def carried(self) -> list[str]:
        """Ids of rollout()'s groups not handed out yet (running, or complete beyond what the
        last call returned), oldest first: the next rollout() returns these first."""
        return [r.request_id for r in self.carry.carried()]

    # --- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RolloutOutput]:
        """Run one scheduler step; returns the requests that finished in it, preceded by the
        streaming requests (add_request) that finished while generate() was stepping."""
        with self._handing_over("step") as handed:
            # As in rollout(): an update whose restarts failed still counted, and a caller who
            # only streams must not be handed its stale groups either.
            self._enforce_staleness()
            if self.scheduler.has_work:
                self.colocation.check_ready()  # asleep, carried requests wait for wake_up
                self._step_or_raise()
            # rollout()'s groups wait for a rollout() call.
            if self.tp.size > 1:
                # As in rollout(): an interrupt held through the step stops every rank here,
                # or the interrupted rank alone would keep the outputs the others hand out.
                self._stepper.stop_together(functools.partial(self._at_hand_out, "step()"),
                                            "before handing outputs out")
            done = [r for r in self.requests.ready.values() if not r.from_rollout]
            outs = [self._output(r) for r in done]
            # An interrupt held through the step raises while the outputs are still kept
            # for the next step(), not after they were handed over.
            self._guard.deliver_held()
            for r in done:
                self.requests.take_ready(r.request_id)
            handed += done
            return outs

    @contextlib.contextmanager
    def _handing_over(self, call: str) -> Iterator[list[Request]]:
        """_entered, for a call that hands outputs over (the requests it lists): an interrupt
        held through its last bytecodes, after the hand-over, is delivered as the call ends
        and the outputs never reach the caller, so they go back for the next call."""
        handed: list[Request] = []
        try:
            with self._entered(call):
                yield handed
        except BaseException:  # (a SIGINT handler of the caller's own may raise another)
            for r in handed:
                self.requests.ready.setdefault(r.request_id, r)
            raise

    def _step_or_raise(self) -> None:
        if not self._stepper.run():
            s = self.scheduler
            raise RuntimeError(
                f"no step can run: {len(s.waiting)} sequences wait, {len(s.running)} run, "
                f"{self.kv.available} of {self.kv.num_slots} KV slots can be allocated; "
                f"check_invariants() tells whether slots leaked")

    def _output(self, request: Request) -> RolloutOutput:
        return build_output(request, self._text, self.vocab_size,
                            self.colocation.weights_version)

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
            def check():
                tqdm = as_bool("use_tqdm", use_tqdm)  # (per rank: a progress bar on one)
                return self._check_all(check_requests(prompts, params)), [], tqdm
            # (each request checks readiness: generate([]) asleep returns [])
            checked, use_tqdm = self._checked_alike(check, ready=False)
            seeds = self.requests.seed_draws
            requests: list[Request] = []
            ready = self.requests.ready
            try:
                self._queue(checked, requests)
                self._step_until(lambda: sum(r.request_id in ready for r in requests),
                                 len(requests), use_tqdm, "prompt")
                return [self._output(ready.pop(r.request_id)) for r in requests]
            except BaseException as e:
                # Nobody will collect this call's outputs (building one may fail too: the
                # others must not be left for step() to hand out): stop spending compute on
                # them, and a retry samples as if this call had not been.
                self.carry.abandon([r.request_id for r in requests], e)
                self.requests.give_back_seeds(seeds)
                raise

    def rollout(self, prompts=(), params: SamplingParams | list[SamplingParams] | None = None,
                groups: int | None = None, abort_rest: bool = False, use_tqdm: bool = False,
                request_ids=None) -> list[RolloutOutput]:
        """Partial rollouts (rollout/engine/carry.py): queue `prompts` (params as in generate)
        behind the groups carried from earlier calls, and return as soon as `groups` of them
        are complete: that many outputs, carried groups first, oldest first. The others stay
        in the engine (`carried`), across sleep and update_weights, and a later call returns
        them; `abort_rest=True` aborts them instead (over-sample and abort). `groups=None`:
        every group, carried and new. An interrupted call keeps its groups carried.
        `request_ids`: one per prompt, the ids their outputs will carry (default: drawn), so
        a caller can pair an output that comes back calls later with what it asked for."""
        with self._handing_over("rollout") as given:
            def check():
                pairs = check_requests(prompts, params)
                wanted = self.carry.groups_wanted(groups, len(pairs))
                rest = as_bool("abort_rest", abort_rest)
                tqdm = as_bool("use_tqdm", use_tqdm)
                ids = self._check_new_ids(request_ids, len(pairs))
                # The ids too (a digest): ids of each rank's own were queued, refused by the
                # first step, and carried on every rank, failing every later rollout().
                agreed = [wanted, rest, digest(ids)]
                return self._check_all(pairs), agreed, (wanted, rest, tqdm, ids)
            checked, (groups, abort_rest, use_tqdm, ids) = self._checked_alike(check)
            # Enforced at each update, and again here: an update whose restarts failed (rolled
            # back) still counted, and its stale groups must not be stepped or handed out.
            self._enforce_staleness()
            # (no list of them kept: a failed call keeps its groups carried, abandons none)
            self._queue(checked, [], from_rollout=True, request_ids=ids)
            self._step_until(self.carry.num_complete, groups, use_tqdm, "group")
            if self.tp.size > 1:
                # An interrupt held through the steps raises below, as the groups are handed
                # out: on one rank alone, it would keep them carried there only.
                self._stepper.stop_together(functools.partial(self._at_hand_out, "rollout()"),
                                            "before handing groups out")
            handed = self.carry.complete()[:groups]
            outs = [self._output(r) for r in handed]
            with self.journal.unit():
                self.carry.hand_out(handed, abort_rest)
                # As in step(): an interrupt held meanwhile raises with the outputs still kept.
                self._guard.deliver_held()
            given += handed
            return outs

    def _at_hand_out(self, call: str, held: bool) -> bool:
        """The ranks' agreement that `call` hands its outputs out (StepRunner.stop_together)."""
        return check_same([], self.tp, self.device, f"ranks of one engine are not all handing "
                          f"{call}'s outputs out", held)

    def _check_new_ids(self, request_ids, n: int) -> list[str | None]:
        if request_ids is None:
            return [None] * n
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, (list, tuple)):
            raise ValueError(f"request_ids must be a list of ids, one per prompt, got "
                             f"{type(request_ids).__name__}")
        if len(request_ids) != n:
            raise ValueError(f"request_ids: {len(request_ids)} ids for {n} prompts")
        # None: drawn, as when request_ids is None (it had become the id "None")
        ids = [None if r is None else self._check_new_id("request_ids", r) for r in request_ids]
        given = [r for r in ids if r is not None]
        if len(set(given)) != len(given):
            raise ValueError("request_ids: an id is given twice")
        return ids

    def _check_all(self, pairs) -> list:
        """(prompt, params) pairs checked, every one before any takes an id or a seed: a
        failed call changes nothing, not even the seeds later calls draw."""
        return [self.check_request(p, sp) for p, sp in pairs]

    def _checked_alike(self, check, ready: bool = True, differ: str = REQUESTS_DIFFER):
        """`check()`: a call's argument checks, giving (the checked requests, the ints its other
        arguments come to, what the call goes on with); the last is returned with the first.
        `ready`: the engine must be awake with its weights whole (checked first, as one of
        them). On an engine of several ranks every rank must get the same requests and ints
        (one all-reduce): a rank whose checks raised makes the others raise RuntimeError
        (saying the ranks `differ`), then raises its own error, so none goes on to wait for it
        at its first step."""
        def checks():
            if ready:
                self.colocation.check_ready()
            return check()
        if self.tp.size == 1:
            checked, _, rest = checks()
            return checked, rest
        try:
            checked, ints, rest = checks()
        except BaseException:
            with contextlib.suppress(RuntimeError):  # (the others failing alike pass)
                check_same_requests(None, self.tp, self.device, differ=differ)
            raise
        check_same_requests(checked, self.tp, self.device, ints, differ)
        return checked, rest

    def _queue(self, checked: list, requests: list[Request], from_rollout: bool = False,
               request_ids: list[str | None] | None = None) -> None:
        """Checked requests (_check_all) queued, each appended to `requests` as it is: a
        failure after any is queued (at this call's return too) finds them to abandon."""
        ids = request_ids or [None] * len(checked)
        given = frozenset(rid for rid in ids if rid is not None)
        with self.journal.unit():
            made = [self.requests.make(*c, rid, self.eos_ids, from_rollout, given)
                    for c, rid in zip(checked, ids)]
            for r in made:
                self._enqueue(r)
                requests.append(r)

    def _step_until(self, done, total: int, use_tqdm: bool, unit: str) -> None:
        """Steps until `done()` reaches `total` (a step that cannot run raises), the progress
        bar counting done()."""
        bar = progress(total, use_tqdm, unit)
        try:
            count = done()
            while count < total:
                self._step_or_raise()
                now = done()
                bar.update(min(now, total) - min(count, total))
                count = now
        finally:
            bar.close()

    def score(self, sequences, temperature: float = 1.0, top_logprobs: int = 0,
              start: int | list[int] = 1, use_tqdm: bool = False) -> list[ScoreOutput]:
        """Per sequence (a string or token ids), log_softmax(logits / temperature) of each
        token from `start` (per sequence or one for all; 1: every token but the first) given
        the tokens before it, and `top_logprobs` alternatives (rollout/engine/score.py).
        Sequences sharing a prefix compute it once; with `start` past a prompt the engine has
        cached, the prompt's K/V is reused."""
        with self._entered("score"):  # (readiness checked with the arguments, on every rank)
            return score(self, sequences, temperature, top_logprobs, start,
                         as_bool("use_tqdm", use_tqdm))

    def chat(self, conversations, params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template_kwargs: dict | None = None
             ) -> list[RolloutOutput]:
        """generate() over conversations (lists of {"role", "content"} messages), rendered by
        the tokenizer's chat template with the generation prompt (rollout/engine/chat.py). Each
        output's `prompt` is the templated text."""
        return chat(self, conversations, params, use_tqdm, chat_template_kwargs)

    def clear_draft_history(self) -> None:
        """Forget the earlier calls' samples speculation drafts from (SpeculativeConfig(
        method="suffix"), rollout/spec/history.py); a no-op for the other methods."""
        with self._entered("clear_draft_history"):
            if self.speculator is not None:
                self.speculator.drafter.clear()

    # --- inspection -------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return current_stats(self)

    def inspect(self) -> EngineView:
        """A snapshot of the engine's state (rollout/engine/inspect.py): pool, cache, holds,
        queues, sleep, implementations; what tests and dashboards read instead of internals."""
        return view(self)

    def cached_prefix_len(self, tokens) -> int:
        """How many leading tokens of `tokens` (a string or token ids, as a prompt) the prefix
        cache holds K/V for now."""
        return self.cache.prefix_len(prefix_ids("tokens", tokens, self.vocab_size,
                                                self.tokenizer, self.config.max_model_len))

    def implementations(self) -> dict[str, str]:
        """Which implementation each op runs: "backend", "attention", "sample", "projection"
        (the decoder's), "lm_head", "lora" (an adapter served unmerged) and one key per
        dispatched layer kind; docs/backends.md lists the values each can take."""
        return self.stack.implementations()

    def check_invariants(self) -> None:
        """Asserts the bookkeeping (rollout/engine/inspect.py `check`): every slot in one
        place, lock counts, queues against KV, requests against queues, the draft's pool."""
        with self._guard.exclusive("check_invariants"):
            check(self)
