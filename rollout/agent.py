"""Multi-turn episodes: the model acts, an environment answers, for several turns.

    episodes = run_episodes(engine, prompts, env_factory=Calculator,
                            params=SamplingParams(n=8, temperature=1.0, max_tokens=128,
                                                  stop=["</call>"], seed=0),
                            max_turns=6, max_episode_tokens=2048)
    ep = episodes[i][j]    # prompt i, sample j: one episode each
    ep.token_ids, ep.mask, ep.logprobs, ep.turns, ep.reward, ep.finish_reason

An episode is one token list after its prompt: model turns as sampled and environment
observations, never re-tokenised, so `prompt_ids + token_ids` is exactly what the model was
conditioned on. `mask` is 1 for model tokens and 0 for environment tokens; `logprobs` are the
sampler's for model tokens and 0.0 for the others.

Each turn is an engine request whose prompt is the episode so far: the prefix cache serves all
of it, and while the environment runs the episode's KV is held (locked) so other requests cannot
evict it; under memory pressure held episodes are released oldest first and recompute on their
next turn (`engine.stats.holds_dropped`). Environments run in a thread pool: an episode waiting
for its environment never stalls the batch, and a failing or slow `step` affects only its own
episode. `step` may be a coroutine function.

The environment protocol: `env_factory()` gives one environment per episode, with
`step(turn_ids: list[int], text: str | None) -> Step` and optionally `reset(prompt_ids)`.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence, Set
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from .engine.chat import check_template_kwargs, is_conversations, render_conversations
from .engine.engine import Engine
from .engine.progress import progress
from .env_calls import EnvCalls
from .fields import as_bool, as_float, as_int
from .requests.outputs import Sample
from .sample.params import SamplingParams

# Threads (and event loops) a run may take for its environments' calls.
MAX_ENV_WORKERS = 1024
# Seconds between looks at a call waiting for a free pool thread: its env_timeout starts when
# a thread takes it, which wakes no wait.
QUEUED_POLL = 0.05
# Marks the assistant's content when a chat template renders an observation (message_tokens).
_MARK = "\x00rollout-assistant\x00"


@dataclass
class Step:
    """An environment's answer to a model turn. `observation`: token ids (appended as they
    are), text (tokenised alone), a chat message dict ({"role": "tool", "content": ...}:
    the chat template's rendering of it after an assistant turn) or None."""

    observation: str | Sequence[int] | dict | None = None
    reward: float = 0.0
    done: bool = False

    def __post_init__(self) -> None:
        # An environment's mistakes are refused where it makes them (the episode then ends as
        # "abort" with the error): bytes are not token ids, a set's ids have no order to append
        # them in, NaN is no reward, "no" is not False.
        if isinstance(self.observation, (bytes, bytearray)):
            raise ValueError("observation: bytes; give text (str), token ids or a chat message")
        if isinstance(self.observation, Set):  # (a dict's keys too)
            raise ValueError(f"observation: a {type(self.observation).__name__} is unordered; "
                             "give the token ids in order (a list)")
        self.reward = as_float("reward", self.reward)
        self.done = as_bool("done", self.done)


@dataclass
class Episode:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # model and env tokens, in order
    mask: list[int] = field(default_factory=list)  # 1: sampled by the model; 0: environment
    logprobs: list[float] = field(default_factory=list)  # sampler's; 0.0 for env tokens
    # Under the truncated distribution each token was drawn from (Sample.sampling_logprobs)
    sampling_logprobs: list[float] = field(default_factory=list)
    turns: int = 0  # model turns
    reward: float = 0.0  # sum of the environment's step rewards
    finish_reason: str | None = None  # "done" | "max_turns" | "length" | "abort"
    error: str | None = None  # why an episode aborted


def run_episodes(engine: Engine, prompts, env_factory: Callable[[], object],
                 params: SamplingParams | None = None, max_turns: int = 8,
                 max_episode_tokens: int | None = None, use_tqdm: bool = False,
                 env_workers: int = 8, env_timeout: float | None = None,
                 chat_template_kwargs: dict | None = None) -> list[list[Episode]]:
    """`params.n` episodes per prompt (prompt i, sample j: `episodes[i][j]`). `max_turns`:
    model turns per episode; `max_episode_tokens`: model + env tokens after the prompt (the
    episode ends with "length"; capped by the engine's max_model_len); `params.max_tokens`
    bounds each model turn. `prompts`: strings (encoded with the engine's tokenizer), token-id
    lists or 1-D tensors, or chat conversations (lists of {"role", "content"} messages,
    rendered by the tokenizer's chat template with the generation prompt, as Engine.chat).
    `env_timeout`: seconds an environment's reset or step may take; one that takes longer
    ends its episode ("abort", its KV released) and, if it is a coroutine, is cancelled.
    `chat_template_kwargs`: the template's options (Qwen3's enable_thinking, say) for the
    prompts and for the chat-message observations alike, as Engine.chat takes them."""
    if params is not None and not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams or None, got {type(params).__name__}")
    if not callable(env_factory):
        raise ValueError(f"env_factory must be callable (it makes one environment per "
                         f"episode), got {type(env_factory).__name__}")
    params = SamplingParams() if params is None else dataclasses.replace(params)
    use_tqdm = as_bool("use_tqdm", use_tqdm)
    max_turns = as_int("max_turns", max_turns, low=1)
    env_workers = as_int("env_workers", env_workers, 1, MAX_ENV_WORKERS)
    if max_episode_tokens is not None:
        max_episode_tokens = as_int("max_episode_tokens", max_episode_tokens, low=1)
    if env_timeout is not None:
        env_timeout = as_float("env_timeout", env_timeout)
        if env_timeout <= 0:
            raise ValueError(f"env_timeout must be > 0 seconds or None, got {env_timeout}")
        env_timeout = min(env_timeout, threading.TIMEOUT_MAX)  # what waits can take
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a list of strings or of token-id lists")
    for extra in ("return_support", "return_routed_experts"):
        if getattr(params, extra):  # asked for, an Episode would silently lack it
            raise ValueError(f"params.{extra}: an Episode carries tokens, mask and logprobs "
                             f"only; run_episodes returns no {extra[len('return_'):]}")
    if engine.config.tensor_parallel_size > 1:
        # Each rank's environments answer in their own order: the ranks would disagree on
        # which turns a step admits.
        raise ValueError(f"tensor_parallel_size: run_episodes runs on one rank's engine, got "
                         f"{engine.config.tensor_parallel_size}")
    template_kwargs = check_template_kwargs(chat_template_kwargs)
    if is_conversations(prompts):
        prompts = [ids for _, ids in render_conversations(engine.tokenizer, prompts,
                                                          template_kwargs)]
    if engine.has_unfinished:
        raise ValueError("engine: run_episodes steps the engine itself and needs it idle; "
                         f"{len(engine.running_requests)} requests are running and "
                         f"{engine.unreturned_outputs} finished ones wait for step() to "
                         f"return them")
    runner = _Runner(engine, env_factory, params, max_turns, max_episode_tokens, env_workers,
                     env_timeout, template_kwargs)
    return runner.run(list(prompts), use_tqdm)


@dataclass
class _Live:
    """An episode in flight."""

    episode: Episode
    env: object
    index: tuple[int, int]  # (prompt, sample)
    hold: tuple[str, int] | None = None  # the engine's hold on its KV
    resetting: bool = False  # its reset is under way: its first step waits for it
    # (request id, sample, error) of its first turn, sampled before its reset answered
    parked: tuple | None = None


class _Runner:
    def __init__(self, engine: Engine, env_factory, params: SamplingParams, max_turns: int,
                 max_episode_tokens: int | None, env_workers: int,
                 env_timeout: float | None, template_kwargs: dict) -> None:
        self.engine, self.env_factory, self.params = engine, env_factory, params
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.env_timeout, self.template_kwargs = env_timeout, template_kwargs
        # An episode's tokens end where a sequence's do; each later turn's prompt leaves the
        # model a token (_env_turn ends the episode when an observation would not).
        self.limit = engine.config.max_model_len
        self.workers = env_workers
        # (`or`: vLLM's logprobs=k keeps its k alternatives)
        self.turn_params = dataclasses.replace(params, n=1, logprobs=params.logprobs or True)
        # The ids a turn stops on, as the engine reads them (a base model's chat runs often
        # stop on the template's end-of-turn through stop_token_ids, not on its eos)
        self.end_ids = params.stop_ids(engine.eos_ids)
        self.requests: dict[str, list[_Live | None]] = {}  # request id -> its episodes
        self.turn_ids = itertools.count()  # names the turns' requests (_submit)
        self.waiting: dict[Future, _Live] = {}  # environment steps under way
        self.resets: dict[Future, _Live] = {}  # and resets
        # Every episode: one whose environment has answered is in neither of the above until
        # its next turn is queued, and a failure meanwhile must still release its hold.
        self.lives: list[_Live] = []
        self.abandoned = False  # a synchronous call timed out and still runs

    def run(self, prompts: list, use_tqdm: bool) -> list[list[Episode]]:
        engine = self.engine
        # Every prompt first, as add_request checks it (an engine asleep too): before any
        # environment is made
        checked = [engine.check_request(p, self.params)[1] for p in prompts]
        if not checked:  # (as generate([]): no seed drawn from the engine's stream)
            return []
        # Unseeded, the run draws its seed from the engine's stream, as a request does, and a
        # failed run gives it back (a retry samples what a fresh engine would).
        draws = engine.requests.seed_draws
        self.base_seed = (self.params.seed if self.params.seed is not None
                          else engine.requests.draw_seed())
        result: list[list[Episode]] = []
        bar = self.bar = progress(len(prompts) * self.params.n, use_tqdm, unit="episode")
        self.envs = EnvCalls(self.workers)
        failed = True
        try:
            # Every environment made and its reset under way before any is waited on: the
            # resets run together (synchronous ones env_workers at a time), and so do the
            # env_timeouts of hung ones, and with the first turns: an episode's first step
            # waits for its own reset only.
            started = [[self._start(Episode(list(ids)), (i, j))
                        for j in range(self.params.n)] for i, ids in enumerate(checked)]
            for i, (ids, lives) in enumerate(zip(checked, started)):
                result.append([live.episode for live in lives])
                first = dataclasses.replace(
                    self.params, logprobs=True, seed=self._seed(i, 0, 0),
                    max_tokens=min(self.params.max_tokens, self._budget(lives[0].episode)))
                self._submit(ids, first, [live if live.episode.finish_reason is None
                                          else None for live in lives], None)
            while self.requests or self.waiting or self.resets:
                self._advance()
            failed = False
        except BaseException:
            self._abandon()
            engine.requests.give_back_seeds(draws)
            raise
        finally:
            bar.close()
            # A failed run does not wait for its environments' steps still under way, nor a
            # run for the synchronous steps it gave up on (their threads finish on their own).
            self.envs.close(wait=not failed and not self.abandoned)
        return result

    def _start(self, episode: Episode, index: tuple[int, int]) -> _Live:
        """The episode with its environment, whose reset (if it has one) is under way."""
        live = _Live(episode, None, index)
        self.lives.append(live)
        try:
            live.env = self.env_factory()
            if not callable(getattr(live.env, "step", None)):  # (rather than after its turn)
                self._end(live, "abort", f"environment: a {type(live.env).__name__} has no "
                                         f"step method (step(turn_ids, text) -> Step)")
                return live
            reset = getattr(live.env, "reset", None)
            if reset is not None:
                self.resets[self._call(live, reset, list(episode.prompt_ids))] = live
                live.resetting = True
        except Exception as e:
            self._end(live, "abort", f"environment reset: {type(e).__name__}: {e}")
        return live

    def _reset(self, live: _Live, future: Future) -> None:
        """The episode after its reset answered or outlived env_timeout: its first turn, if
        sampled meanwhile, goes to its environment."""
        live.resetting = False
        if not future.done():
            return self._give_up(live, future, "reset")
        try:
            future.result()
        except Exception as e:
            return self._end(live, "abort", f"environment reset: {type(e).__name__}: {e}")
        if live.parked is not None:
            parked, live.parked = live.parked, None
            self._model_turn(live, *parked)

    def _slot(self, live: _Live) -> int:
        """The episode's number: which of the run's event loops its coroutines run on."""
        return live.index[0] * self.params.n + live.index[1]

    def _call(self, live: _Live, method, *args) -> Future:
        """The environment's `method(*args)` under way (EnvCalls.call: timed from when it
        starts running, not from a wait for a free worker)."""
        return self.envs.call(self._slot(live), method, *args)

    def _wait(self) -> None:
        """(Nothing to compute) Until an environment call answers or outlives env_timeout."""
        calls = [*self.resets, *self.waiting]
        if calls:
            wait(calls, self._until_a_deadline(calls), return_when=FIRST_COMPLETED)

    def _answered(self, calls: dict[Future, _Live]):
        """The calls that answered or outlived env_timeout, each taken out of `calls` as it is
        handed over."""
        now = time.monotonic()
        for future in [f for f in calls if f.done() or self._expired(f, now)]:
            yield future, calls.pop(future)

    def _expired(self, future: Future, now: float) -> bool:
        return (self.env_timeout is not None and future.started is not None
                and future.started + self.env_timeout < now)

    def _until_a_deadline(self, calls) -> float | None:
        """How long a wait for `calls` may last before one of them outlives env_timeout; while
        one waits for a worker, at most QUEUED_POLL (nothing wakes this wait when it starts)."""
        if self.env_timeout is None:
            return None
        now = time.monotonic()
        started = [f.started for f in calls if f.started is not None]
        until = max(0.0, min(started) + self.env_timeout - now) if started else None
        if len(started) < len(calls):
            until = QUEUED_POLL if until is None else min(until, QUEUED_POLL)
        return until

    def _give_up(self, live: _Live, future: Future, call: str) -> None:
        """A call that outlived env_timeout ends its episode: a coroutine is cancelled; a
        thread cannot be, and finishes on its own (the run then does not wait for it at the
        end), with a thread more in the pool for the calls queued behind it."""
        if not future.cancel():
            self.abandoned = True
            self.envs.abandoned()
        self._end(live, "abort", f"environment {call}: took over "
                                 f"env_timeout={self.env_timeout:g} s")

    def _submit(self, prompt_ids: list[int], params: SamplingParams,
                lives: list[_Live | None], resume) -> None:
        if all(live is None for live in lives):
            return
        # Named and listed before it is queued: a failure once it is (add_request raising as it
        # returns, an interrupt before the run had its id) must find it for _abandon to abort,
        # or it runs on in the engine.
        request_id = next(rid for rid in map("episode-turn-{}".format, self.turn_ids)
                          if rid not in self.engine.requests)
        self.requests[request_id] = lives
        self.engine.add_request(prompt_ids, params, request_id, hold_kv=True, resume=resume)

    def _advance(self) -> None:
        """One engine step, or, with nothing to compute, a wait for an environment."""
        stepping = self.engine.has_unfinished
        if stepping:
            for out in self.engine.step():
                lives = self.requests.get(out.request_id)
                if lives is None:
                    continue  # someone else's streaming request
                for live, sample in zip(lives, out.samples):
                    if live is not None and live.episode.finish_reason is None:
                        self._model_turn(live, out.request_id, sample, out.error)
                    else:  # its episode ended before its first turn (its environment failed):
                        # the turn's KV is nobody's
                        self.engine.release_hold((out.request_id, sample.index))
                # Listed until its samples are taken: should this fail, _abandon releases
                # their holds.
                del self.requests[out.request_id]
        else:
            self._end_lost_turns()
            self._wait()
        for future, live in self._answered(self.resets):
            self._reset(live, future)
        for future, live in self._answered(self.waiting):
            if future.done():
                self._env_turn(live, future)
            else:
                self._give_up(live, future, "step")

    def _end_lost_turns(self) -> None:
        """(The engine idle) Turns still listed were aborted outside the run, between its steps
        (Engine.abort or abort_all from another thread): an abort drops the output, so none
        will come, and waiting for it would spin for ever. Their episodes end."""
        for request_id, lives in list(self.requests.items()):
            del self.requests[request_id]
            for live in lives:
                if live is not None:
                    self._end(live, "abort", f"the turn's request {request_id!r} was aborted "
                                             f"outside run_episodes")

    def _model_turn(self, live: _Live, request_id: str, sample: Sample, error: str | None):
        live.hold = (request_id, sample.index)
        if live.resetting:  # its environment is not ready: the turn waits, its KV held
            live.parked = (request_id, sample, error)
            return
        ep = live.episode
        ep.turns += 1
        ep.token_ids += sample.token_ids
        ep.mask += [1] * len(sample.token_ids)
        ep.logprobs += sample.logprobs
        ep.sampling_logprobs += sample.sampling_logprobs
        if sample.finish_reason == "abort":
            return self._end(live, "abort", error or "aborted by the engine")
        self.waiting[self._call(live, live.env.step, list(sample.token_ids), sample.text)] = live

    def _env_turn(self, live: _Live, future: Future) -> None:
        ep = live.episode
        try:
            step = future.result()
            if not isinstance(step, Step):
                raise TypeError(f"step() must return a rollout.agent.Step, got "
                                f"{type(step).__name__}")
            ep.reward += float(step.reward)
            if step.done:
                return self._end(live, "done")
            if ep.turns >= self.max_turns:
                return self._end(live, "max_turns")
            last = ep.token_ids[-1] if ep.token_ids else None
            obs = self._observation(step.observation, last)
        except Exception as e:
            return self._end(live, "abort", f"environment step: {type(e).__name__}: {e}")
        except BaseException as e:  # (KeyboardInterrupt, SystemExit): the run fails
            self._end(live, "abort", f"environment step: {type(e).__name__}")
            raise
        budget = self._budget(ep)
        if len(obs) >= budget:  # the observation would leave the model no token
            return self._end(live, "length")
        ep.token_ids += obs
        ep.mask += [0] * len(obs)
        ep.logprobs += [0.0] * len(obs)
        ep.sampling_logprobs += [0.0] * len(obs)
        params = dataclasses.replace(
            self.turn_params, max_tokens=min(self.params.max_tokens, budget - len(obs)),
            seed=self._seed(*live.index, ep.turns))
        self._submit(ep.prompt_ids + ep.token_ids, params, [live], live.hold)
        live.hold = None

    def _seed(self, prompt: int, sample: int, turn: int) -> int:
        """A turn's seed, a function of the run's seed and where the turn is (the first turn is
        one request for all of a prompt's samples: sample 0): episodes sample the same
        whatever order their environments answer in."""
        return hash((self.base_seed, prompt, sample, turn)) & ((1 << 63) - 1)

    def _budget(self, ep: Episode) -> int:
        """Tokens the episode may still add (observation and the next model turn)."""
        left = self.limit - len(ep.prompt_ids) - len(ep.token_ids)
        if self.max_episode_tokens is not None:
            left = min(left, self.max_episode_tokens - len(ep.token_ids))
        return left

    def _observation(self, observation, last_token: int | None) -> list[int]:
        tok = self.engine.tokenizer
        if observation is None:
            return []
        if isinstance(observation, dict):
            # Whichever end id the turn stopped on (an instruct model's end-of-turn may not be
            # the tokenizer's eos_token), it is in the episode.
            ended = last_token is not None and last_token in self.end_ids
            return message_tokens(tok, observation,
                                  token_text(tok, last_token) if ended else None,
                                  self.template_kwargs)
        if isinstance(observation, str):
            if tok is None:
                raise ValueError("a text observation needs the engine's tokenizer")
            return list(tok.encode(observation, add_special_tokens=False))
        ids = [as_int("observation: token id", t) for t in observation]
        bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise ValueError(f"observation: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.engine.vocab_size})")
        return ids

    def _end(self, live: _Live, reason: str, error: str | None = None) -> None:
        # The first end stands: a reset may fail after its episode's first turn was lost.
        if live.episode.finish_reason is None:
            live.episode.finish_reason, live.episode.error = reason, error
            self.bar.update(1)
        if live.hold is not None:
            self.engine.release_hold(live.hold)
            live.hold = None

    def _abandon(self) -> None:
        """The run failed: stop its requests, release its holds, leave its envs to finish."""
        for live in self.lives:
            if live.hold is not None:
                self.engine.release_hold(live.hold)
        for future in [*self.resets, *self.waiting]:
            future.cancel()
        for request_id, lives in self.requests.items():
            try:
                self.engine.abort(request_id)  # running, or finished and not yet stepped out
            except ValueError:  # stepped out with the failing step's outputs (its samples
                # hold KV), or never queued (add_request failed first: nothing held)
                for j in range(len(lives)):
                    self.engine.release_hold((request_id, j))


def token_text(tokenizer, token: int) -> str:
    """A token as its text, a special token's included (`<|eot_id|>`)."""
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return tokenizer.convert_ids_to_tokens(token)
    return tokenizer.decode([token])


def message_tokens(tokenizer, message: dict, ended_with: str | None,
                   template_kwargs: dict | None = None) -> list[int]:
    """The tokens a chat template puts after an assistant turn for `message` (a tool or user
    message), generation prompt included; `ended_with`: the text of the end token the model's
    turn ended with (None: it ended otherwise), which the template renders as the end of the
    assistant turn, so it is not put there twice; `template_kwargs`: the template's options
    (checked: check_template_kwargs), the generation prompt this function's to set. Refused when the
    template is not prefix-preserving (rendering one more message changes what came before),
    since the episode's tokens could then not be what a trainer's template would give."""
    options = {k: v for k, v in (template_kwargs or {}).items()
               if k not in ("add_generation_prompt", "continue_final_message")}
    # (the template may come in template_kwargs, as render_conversations takes it)
    if tokenizer is None or (getattr(tokenizer, "chat_template", None) is None
                             and options.get("chat_template") is None):
        raise ValueError("a chat-message observation needs a chat template: the tokenizer's, "
                         "or chat_template_kwargs={'chat_template': ...}")
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
    prefix = tokenizer.apply_chat_template(base, tokenize=False, **options)
    full = tokenizer.apply_chat_template(base + [message], tokenize=False,
                                         add_generation_prompt=True, **options)
    if not full.startswith(prefix):
        raise ValueError("the chat template is not prefix-preserving: appending a message "
                         "changes the rendering of the turns before it")
    tail = full[full.index(_MARK) + len(_MARK):]
    # (Llama-2's template writes a space before the end token: the model's turn has its own
    # end token, and its tokens are never re-tokenised, so what comes before it goes too.)
    if ended_with and tail.lstrip().startswith(ended_with):
        tail = tail.lstrip()[len(ended_with):]
    return list(tokenizer.encode(tail, add_special_tokens=False))
