"""TRL's asynchronous GRPO trainer (`trl.experimental.async_grpo.AsyncGRPOTrainer`, TRL 1.16) on
the engine, in the trainer's process.

TRL's own worker drives a vLLM server over HTTP and syncs weights over NCCL. Here a thread owns
the engine: it keeps `groups_in_flight` prompt groups in the engine and calls
`Engine.rollout(groups=1)` over and over (partial rollouts: a group is handed out as soon as it
is complete, the others stay), scores each group with the trainer's reward functions
(synchronous or asynchronous: the coroutines of a group are awaited together, on one event loop
for the thread's life, as TRL's worker does), computes GRPO's group-normalised advantages and
pushes one `RolloutSample` per completion, its
`old_log_probs` the engine's logprobs (untruncated, or with `importance_ratio="full_policy"`
the truncated distribution's each token was drawn from: trl_rollout.EngineRollout's). Weights
come in through `EngineWeightTransfer`: pause (the thread finishes its current call and waits),
`update_weights` in place (carried groups are retracted and go on under the new weights), resume.

Each sample is tagged with the trainer's model version of its *oldest* token, so TRL's
`max_staleness` drops what is too old; the engine gets the same bound (EngineConfig.
max_staleness, set by `engine_async_grpo`), so a carried group past it is restarted from its
prompt instead of being finished and then dropped, which would bias training toward short
answers. With TRL's fixed-count batches (`token_budget <= 0`) the worker keeps at most
max_staleness steps' samples ahead of the trainer (`max_pending`: queued, or of groups in the
engine; one group at least): TRL takes a step's samples one step early (below), so what is
queued behind them would be taken past max_staleness and dropped. Under a token budget a step's
count is known only once it is packed: the worker keeps to groups_in_flight and queue_maxsize,
as TRL's own worker does.

TRL checks staleness when it takes a sample from the queue, not when it trains on it: accelerate's
dispatcher takes the next micro-batch before the current one trains, so the first micro-batch of
each step is taken before the previous step's sync and trained one version older (max_staleness
+ 1 at most; with max_staleness 0 and one micro-batch a step, 20 of the 24 samples of 6 steps
while TRL logs sample/staleness_max 0), and TokenBudgetBatcher holds the sample that closed a
micro-batch over into the next one (max_staleness + 2). The worker cannot narrow this: those
samples are taken before the sync that makes them older.

    trainer = engine_async_grpo(engine, model, reward_funcs, args, train_dataset, tokenizer)
    trainer.train()

A checkpoint records where the worker's prompts resume (the first group drawn and not
trained, in TRL's rollout_state.json, which TRL writes and reads for its own worker only), and
a run resumed from it draws from there (engine_trainer_class).

What the engine cannot give is refused with a ValueError: tools and environments (TRL's async
tool loop), `repetition_penalty`, a PEFT model's adapter-only sync (its merged weights are sent).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import itertools
import json
import os
import queue
import threading
import time
import warnings
from collections.abc import Mapping

import numpy as np
from trl.chat_template_utils import add_response_schema, parse_response
from trl.trainer.utils import get_callable_name

from rollout import Engine, SamplingParams
from rollout.engine.chat import render_conversations
from rollout.fields import as_choice, as_int, show
from rollout.requests.intake import prompt_ids
from rollout.sample.params import MAX_N

from .trl_rollout import IMPORTANCE_RATIOS as SYNC_RATIOS, behaviour_logprobs, completion_limit

STOP_WAIT = 60.0  # seconds stop() waits for the thread before it says where it is
TAKE_WAIT = 0.01  # seconds between looks at the queue while the trainer has all it can use
# trl_rollout's but "on_support", which needs TRL's side renormalised: AsyncGRPOTrainer's
# forward takes the whole vocabulary.
IMPORTANCE_RATIOS = tuple(r for r in SYNC_RATIOS if r != "on_support")


class EngineRolloutWorker:
    """TRL's `RolloutWorkerProtocol`, backed by an engine in a thread of this process."""

    def __init__(self, engine: Engine, dataset, reward_funcs, tokenizer, num_generations: int,
                 params: SamplingParams, groups_in_flight: int = 4, queue_maxsize: int = 0,
                 chat_template_kwargs: dict | None = None,
                 importance_ratio: str = "untruncated", max_pending: int | None = None) -> None:
        """`max_pending`: the most samples produced and not yet taken by the trainer (queued,
        or of the groups in the engine) the thread keeps; it starts no group beyond them (None:
        no bound but groups_in_flight and queue_maxsize).
        `importance_ratio`: which engine logprobs are TRL's `old_log_probs`, the sampling
        logprobs its ratio divides by: "untruncated", log_softmax(logits / T), what TRL's
        forward recomputes (the ratio then measures the engine-trainer mismatch and the
        staleness alone); "full_policy", Sample.sampling_logprobs, so under top-k/top-p/min-p
        the ratio also carries the truncation (pi / mu, below 1 by the mass cut)."""
        # Checked here: in the thread, a bad argument would only surface at check_health.
        if not isinstance(engine, Engine):
            raise ValueError(f"engine must be an Engine, got {type(engine).__name__}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        reward_funcs = [reward_funcs] if callable(reward_funcs) else reward_funcs
        if (not isinstance(reward_funcs, (list, tuple)) or not reward_funcs
                or not all(callable(f) for f in reward_funcs)):
            raise ValueError(f"reward_funcs must be a function or a non-empty list of "
                             f"functions, got {show(reward_funcs)}")
        self.engine, self.dataset, self.tokenizer = engine, dataset, tokenizer
        self.reward_funcs = list(reward_funcs)
        self.reward_names = [get_callable_name(f) for f in self.reward_funcs]  # as TRL logs them
        self.params = dataclasses.replace(params, logprobs=params.logprobs or True,  # k: kept
                                          n=as_int("num_generations", num_generations, 1, MAX_N))
        self.groups_in_flight = as_int("groups_in_flight", groups_in_flight, 1)
        # At least one group, or the thread could start none.
        self.max_pending = None if max_pending is None else as_int("max_pending", max_pending,
                                                                   self.params.n)
        self.importance_ratio = as_choice("importance_ratio", importance_ratio,
                                          IMPORTANCE_RATIOS)
        self.chat_template_kwargs = {} if chat_template_kwargs is None else chat_template_kwargs
        self._parses = has_response_parser(tokenizer)
        self._check_rows()
        self.rollout_buffer: queue.Queue = queue.Queue(
            maxsize=as_int("queue_maxsize", queue_maxsize, 0))
        self.metrics_queue: queue.Queue = queue.Queue()
        self.model_version = 0
        # The trainer's model version of each engine weights version (set at each sync).
        self._versions = {engine.weights_version: 0}
        # Where start() draws its first row: a position counts the rows drawn since the run
        # began, across epochs (row = position mod the dataset's size); a resumed run's is the
        # checkpoint's (EngineAsyncGRPOTrainer).
        self.dataset_start = 0
        self._next_position = 0
        # Dataset rows in flight with their positions, by the request id of their group (which
        # comes back steps later, and not in the order asked: rows with the same prompt may
        # differ otherwise), and the positions of the groups pushed, by group id: where a
        # checkpoint resumes (resume_position). Read by the trainer's thread under _book.
        self._rows: dict[str, tuple[int, dict]] = {}
        self._pushed: dict[int, int] = {}
        self._book = threading.Lock()
        self._request_ids = (f"trl-async-{i}" for i in itertools.count())
        self._group_ids = itertools.count()
        self._run = threading.Event()  # set: the thread may call the engine
        self._idle = threading.Event()  # set: the thread is outside every engine call
        self._idle.set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_push = time.time()
        self._aio: asyncio.AbstractEventLoop | None = None  # the thread's, for reward coroutines

    # --- the protocol -----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("start: the engine's rollout thread is still running")
        # The last thread's failure and silence are not the new one's (check_health).
        self._error, self._last_push = None, time.time()
        with self._book:
            self._next_position = self.dataset_start
            self._pushed.clear()  # an earlier train()'s groups: not this run's to resume
        self._stop.clear()
        self._run.set()
        self._thread = threading.Thread(target=self._loop, name="engine-rollout", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Returns once the thread is out of the engine for good, having aborted what the
        engine still holds: only then is the engine free for the caller (one thread at a time
        may call it). A thread in an engine call is waited for (one group's completion at
        most); one stuck outside the engine (a reward function that does not return) is left
        behind after STOP_WAIT, with a warning: it calls the engine no more."""
        self._stop.set()
        self._run.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=STOP_WAIT)
            if thread.is_alive() and not self._idle.is_set():
                warnings.warn(f"stop: the engine's rollout thread is still in an engine call "
                              f"after {STOP_WAIT:g} s; waiting for it to return",
                              RuntimeWarning, stacklevel=2)
                self._idle.wait()
                thread.join(timeout=STOP_WAIT)
            if thread.is_alive():
                warnings.warn(f"stop: the engine's rollout thread is still running outside the "
                              f"engine after {STOP_WAIT:g} s (in a reward function, or pushing "
                              f"a sample); left behind: it calls the engine no more",
                              RuntimeWarning, stacklevel=2)
        self.engine.abort_all()  # the thread is out of the engine for good
        with self._book:
            self._rows.clear()  # their groups are gone

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def resume_position(self, trained: set[int]) -> int:
        """The position of the first group drawn that the trainer has not trained (`trained`:
        its group ids), in the engine or pushed, else the next to draw: TRL's rule for where a
        checkpoint's prompts resume (its own worker draws its groups in order; this one's
        complete out of order, so trained groups past that position are drawn again)."""
        with self._book:
            waiting = [p for g, p in self._pushed.items() if g not in trained]
            waiting += [p for p, _ in self._rows.values()]
            return min(waiting, default=self._next_position)

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError("the engine's rollout thread failed") from self._error
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the engine's rollout thread is not running")
        if self._run.is_set() and time.time() - self._last_push > stale_after_s:
            raise RuntimeError(f"the engine's rollout thread pushed nothing for "
                               f"{stale_after_s:.0f} s")

    # --- pausing for a weight update --------------------------------------------------------
    def pause(self) -> None:
        """Returns once the thread is outside the engine (its current call done)."""
        self._run.clear()
        self._idle.wait()

    def resume(self) -> None:
        self._last_push = time.time()
        self._run.set()

    def synced(self) -> None:
        """The engine's new weights are the trainer's next model version (TRL bumps it by one
        right after each sync)."""
        self._versions[self.engine.weights_version] = self.model_version + 1

    # --- the thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        self._aio = asyncio.new_event_loop()
        try:
            while not self._stop.is_set():
                self._run.wait()
                outs = None
                self._idle.clear()
                try:
                    # Checked once marked inside: stop() aborts the engine's groups as soon as
                    # it sees the thread outside, and a pause waits for it the same way.
                    if self._stop.is_set() or not self._run.is_set():
                        continue
                    new = self._groups_to_start()
                    if new or self.engine.carried:
                        prompts, ids = [], []
                        for _ in range(new):
                            index = self._next_position % len(self.dataset)
                            row = self.dataset[index]
                            prompts.append(self._prompt_ids(row, index))
                            ids.append(next(self._request_ids))
                            with self._book:
                                self._rows[ids[-1]] = (self._next_position, row)
                                self._next_position += 1
                        outs = self.engine.rollout(prompts, self.params, groups=1,
                                                   request_ids=ids)
                finally:
                    self._idle.set()
                if outs is None:  # the trainer has all it can use before it is stale
                    self._last_push = time.time()  # waiting for it is not a stall
                    self._stop.wait(TAKE_WAIT)
                    continue
                for out in outs:
                    if self._stop.is_set():  # stop() may have dropped their rows already
                        break
                    self._push(out)
        except BaseException as e:  # check_health raises it in the trainer
            self._error = e
        finally:
            self._aio.close()

    def _groups_to_start(self) -> int:
        """New groups for the engine: up to groups_in_flight, and within max_pending with what
        the trainer has yet to take (the queue, the groups in the engine)."""
        carried = len(self.engine.carried)
        new = self.groups_in_flight - carried
        if self.max_pending is not None:
            room = (self.max_pending - self.rollout_buffer.qsize()) // self.params.n - carried
            new = min(new, room)
        return max(new, 0)

    def _check_rows(self) -> None:
        """The first row read as the thread reads every row (its prompt rendered)."""
        try:
            size = len(self.dataset)
            row = self.dataset[0] if size else None
        except Exception as e:
            raise ValueError(f"dataset must be a sized, indexable collection of rows (TRL's "
                             f"Dataset), got {type(self.dataset).__name__}") from e
        if size == 0:
            raise ValueError("dataset: empty; the worker needs prompts to roll out")
        if not isinstance(row, Mapping) or "prompt" not in row:
            raise ValueError(f"dataset: rows must be dicts with a 'prompt', got {show(row)}")
        self._prompt_ids(row, 0)

    def _prompt_ids(self, row: dict, index: int) -> list[int]:
        """Row `index`'s prompt as the engine takes it, checked as the engine checks it: the
        engine refuses the thread's whole call, naming no row. (Not every row up front: that
        would tokenize the whole dataset before the first step.)"""
        prompt = row["prompt"]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)  # as the engine's intake encodes a string
        else:
            ids = render_conversations(self.tokenizer, [prompt], self.chat_template_kwargs)[0][1]
        try:
            return prompt_ids(ids, self.engine.vocab_size, self.engine.config.max_model_len,
                              self.tokenizer)[1]
        except ValueError as e:
            raise ValueError(f"dataset row {index}: {e}") from e

    def _push(self, out) -> None:
        with self._book:
            position, row = self._rows.pop(out.request_id)
            if out.error is not None:  # aborted (non-finite logits): no completions to train on
                return
            group_id = next(self._group_ids)
            self._pushed[group_id] = position  # untrained until the trainer says so
        prompt_ids = list(out.prompt_token_ids)
        if isinstance(row["prompt"], str):
            completions = [s.text or "" for s in out.samples]
        else:
            completions = [[self._message(s, prompt_ids)] for s in out.samples]
        n = len(out.samples)
        extra = {k: [v] * n for k, v in row.items() if k not in ("prompt", "completion",
                                                                  "completion_ids")}
        columns = [func(prompts=[row["prompt"]] * n, completions=completions,
                        completion_ids=[s.token_ids for s in out.samples], **extra)
                   for func in self.reward_funcs]
        waiting = [i for i, c in enumerate(columns) if inspect.isawaitable(c)]
        if waiting:  # asynchronous reward functions: their coroutines run together
            for i, column in zip(waiting, self._aio.run_until_complete(
                    _gather([columns[i] for i in waiting]))):
                columns[i] = column
        rewards, advantages, spread = group_advantages(columns)
        per_function = reward_table(columns).T  # [completion, function]
        for s, completion, advantage, reward, own in zip(out.samples, completions, advantages,
                                                         rewards, per_function):
            oldest = min(s.weights_versions, default=self.engine.weights_version)
            # TRL's worker's metrics: the sum, the spread and each function's reward by name
            metrics = {"reward": float(reward), "reward_std": spread,
                       **{f"rewards/{name}": float(r) for name, r in zip(self.reward_names, own)}}
            self._put(_sample(
                row["prompt"], completion, prompt_ids, s.token_ids,
                behaviour_logprobs(s, self.importance_ratio), float(advantage),
                self._versions.get(oldest, 0), group_id, metrics))
        self._last_push = time.time()

    def _message(self, sample, prompt_ids: list[int]) -> dict:
        """A conversational completion as TRL's worker gives it to the reward functions:
        parsed with the tokenizer's response template (a reasoning block apart from the
        content, tool calls); the decoded text where there is none."""
        if self._parses:
            return parse_response(self.tokenizer, list(sample.token_ids), prefix=prompt_ids)
        return {"role": "assistant", "content": sample.text or ""}

    def _put(self, sample) -> None:
        """Into the bounded queue (TRL's queue_maxsize: backpressure), giving up at stop()."""
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=0.5)
                return
            except queue.Full:  # the trainer is behind: waiting is not a stall
                self._last_push = time.time()


async def _gather(awaitables: list) -> list:
    return await asyncio.gather(*awaitables)


def has_response_parser(tokenizer) -> bool:
    """Whether the tokenizer parses responses: a response template (or legacy schema) of its
    own, or one TRL sets for a chat template it knows (add_response_schema, as TRL's worker
    does, on the tokenizer itself). TRL's worker refuses any other template; here those
    completions stay decoded text."""
    if (getattr(tokenizer, "response_template", None) is not None
            or getattr(tokenizer, "response_schema", None) is not None):
        return True
    try:
        add_response_schema(tokenizer)
    except ValueError:  # "Unrecognized chat template"
        return False
    return True


def reward_table(columns: list[list]) -> np.ndarray:
    """[function, completion] rewards of one group, None (unscorable) as NaN."""
    return np.array([[np.nan if r is None else r for r in c] for c in columns], dtype=float)


def group_advantages(columns: list[list]) -> tuple[np.ndarray, np.ndarray, float]:
    """(rewards, advantages, the rewards' spread) of one group from each reward function's
    column, as TRL's own worker scores them: the functions' rewards summed; a completion every
    function returned None for is unscorable (reward NaN, advantage 0: a 0 would pull the
    policy away from it as if wrong), and the others are normalised among themselves."""
    table = reward_table(columns)
    rewards = np.nansum(table, axis=0)
    rewards[np.isnan(table).all(axis=0)] = np.nan
    scored = ~np.isnan(rewards)
    advantages, spread = np.zeros_like(rewards), float("nan")
    if scored.any():
        spread = float(rewards[scored].std())
        advantages[scored] = (rewards[scored] - rewards[scored].mean()) / (spread + 1e-8)
    return rewards, advantages, spread


def _sample(prompt, completion, prompt_ids, token_ids, logprobs, advantage, version, group_id,
            metrics):
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    ids = prompt_ids + list(token_ids)
    return RolloutSample(
        prompt=prompt, completion=completion, input_ids=np.asarray(ids, dtype=np.int64),
        completion_mask=np.asarray([0] * len(prompt_ids) + [1] * len(token_ids),
                                   dtype=np.int64),
        old_log_probs=np.asarray([0.0] * len(prompt_ids) + list(logprobs), dtype=np.float32),
        advantage=advantage, model_version=version, group_id=group_id, metrics=metrics,
        enqueued_at=time.time())


class EngineWeightTransfer:
    """TRL's `WeightTransferProtocol`: the trainer's weights into the engine, in place."""

    def __init__(self, worker: EngineRolloutWorker) -> None:
        self.worker = worker

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        self.worker.pause()

    def send_weights(self, iterator) -> None:
        engine = self.worker.engine
        before = engine.weights_version
        try:
            engine.update_weights(list(iterator))
        finally:
            # An update failing after its copy (packing the weights, say) still counts in the
            # engine, which stamps what it samples next with the new version: those samples
            # are the trainer's next version all the same.
            if engine.weights_version != before:
                self.worker.synced()

    def resume(self) -> None:
        self.worker.resume()

    def destroy(self) -> None:
        pass


def engine_async_grpo(engine: Engine, model, reward_funcs, args, train_dataset,
                      processing_class, groups_in_flight: int | None = None,
                      importance_ratio: str = "untruncated", **kwargs):
    """An AsyncGRPOTrainer whose rollouts and weight syncs are the engine's (this module's
    docstring); `groups_in_flight` defaults to TRL's max_inflight_tasks generations (its own
    default: max(max_staleness, 1) steps' samples, a step per_device_train_batch_size x
    gradient_accumulation_steps x the processes). That is a step's count with `token_budget <= 0` (TRL's
    fixed-count batches), and the worker then keeps max_staleness steps' samples ahead of the
    trainer at most; `token_budget` None is the engine's max_model_len, as TRL's is the
    server's, and under a token budget a micro-batch takes what fits, whatever the batch size.
    `importance_ratio`: EngineRolloutWorker's."""
    if kwargs.get("tools") or kwargs.get("environment_factory"):
        raise ValueError("tools / environment_factory: the engine's async worker rolls out "
                         "single turns; use trainer_hooks.trl.RolloutGRPOTrainer for tools")
    if args.repetition_penalty != 1.0:
        raise ValueError(f"repetition_penalty: the engine has none; got "
                         f"{args.repetition_penalty}, set it to 1.0")
    if engine.config.stale_groups == "drop":
        raise ValueError("stale_groups='drop': the worker pairs each group with its dataset row "
                         "when the group comes back, and a dropped group never does; use "
                         "'restart' (the default) or 'keep' (TRL then drops what is too old)")
    # The engine restarts what TRL would drop (a new config: the caller's object stays).
    config = dataclasses.replace(engine.config, max_staleness=args.max_staleness)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k or 0, min_p=args.min_p or 0.0,
                            max_tokens=completion_limit(args, engine))
    # A step's samples over every process (TRL's samples_per_step): the worker, on the main
    # process only, feeds them all through accelerate's dispatcher.
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * \
        args.world_size
    if groups_in_flight is None:
        # TRL sets its default in the trainer's constructor, after the worker is built.
        inflight = (max(config.max_staleness, 1) * per_step if args.max_inflight_tasks < 0
                    else as_int("max_inflight_tasks", args.max_inflight_tasks, 1))
        groups_in_flight = -(-inflight // args.num_generations)
    token_budget = config.max_model_len if args.token_budget is None else args.token_budget
    pending = None  # under a token budget a step's count is known only once it is packed
    if token_budget <= 0:
        # TRL takes the next step's samples before this step's sync (accelerate's prefetch):
        # what is queued behind max_staleness steps' is taken past max_staleness, dropped.
        pending = max(config.max_staleness * per_step, args.num_generations)  # a group at least
    worker = EngineRolloutWorker(engine, train_dataset,
                                 reward_funcs if isinstance(reward_funcs, list)
                                 else [reward_funcs], processing_class, args.num_generations,
                                 params, groups_in_flight, args.queue_maxsize,
                                 args.chat_template_kwargs, importance_ratio, pending)
    trainer = engine_trainer_class()(
        model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
        processing_class=processing_class, rollout_worker=worker,
        weight_transfer=EngineWeightTransfer(worker), **kwargs)
    # Only now, nothing left to refuse the call: a refused or failed one changes neither.
    engine.config = config
    args.token_budget = token_budget  # TRL would ask the vLLM server for its max_model_len
    return trainer


# TRL's file name and fields: a checkpoint of either worker resumes with either.
ROLLOUT_STATE = "rollout_state.json"


@functools.cache
def engine_trainer_class() -> type:
    """AsyncGRPOTrainer that saves and restores where the engine's worker draws its prompts,
    and starts it at every train() (built on first use: trl.experimental is imported only by
    who asks for it). TRL writes ROLLOUT_STATE into a checkpoint and reads it back for its own
    worker only: a run resumed with the engine's drew from row 0 again, training the first
    prompts twice, and counted its epochs from 0. Its train-begin callback (cold sync, worker
    start) fires once per trainer, while every train() stops the worker when it ends: a second
    train() found no thread ("rollout thread is not running")."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_grpo_trainer import _TrainBeginCallback

    class EngineAsyncGRPOTrainer(AsyncGRPOTrainer):
        def _save_checkpoint(self, model, trial):
            worker = self.rollout_worker
            if self.accelerator.is_main_process and isinstance(worker, EngineRolloutWorker):
                folder = os.path.join(self._get_output_dir(trial=trial),
                                      f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
                os.makedirs(folder, exist_ok=True)
                state = {"prompt_index": worker.resume_position(self._trained_groups),
                         "model_version": self.model_version}
                with open(os.path.join(folder, ROLLOUT_STATE), "w") as f:
                    json.dump(state, f)
            super()._save_checkpoint(model, trial)

        def _inner_training_loop(self, *args, **kwargs):
            # Every process: the cold sync it runs is a collective. (Its once-only guard keeps
            # TRL's NCCL group from being made twice; the engine's transfer makes none.)
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, _TrainBeginCallback):
                    callback._fired = False
            worker = self.rollout_worker  # the main process's; None on the others
            if isinstance(worker, EngineRolloutWorker):
                # Reset first: an earlier train() call's position is not this one's.
                worker.dataset_start = self._groups_before_resume = 0
                state = _rollout_state(kwargs.get("resume_from_checkpoint"))
                if state is not None:
                    worker.dataset_start = self._groups_before_resume = state["prompt_index"]
                    self.model_version = state.get("model_version", 0)  # TRL's default
                    worker.update_model_version(self.model_version)
            return super()._inner_training_loop(*args, **kwargs)

    return EngineAsyncGRPOTrainer


def _rollout_state(checkpoint: str | None) -> dict | None:
    """A checkpoint's ROLLOUT_STATE; None without a checkpoint, or one saved without it (by an
    older version: the run then draws from row 0, as TRL's worker does, with a warning)."""
    if checkpoint is None:
        return None
    path = os.path.join(checkpoint, ROLLOUT_STATE)
    if not os.path.isfile(path):
        warnings.warn(f"resume_from_checkpoint: no {ROLLOUT_STATE} in {checkpoint}; the "
                      f"engine's worker draws from row 0", RuntimeWarning, stacklevel=3)
        return None
    with open(path) as f:
        return json.load(f)
