"""Every interface a user or a backend implements, in one place.

These are `typing.Protocol`s: implement the methods, no base class needed. Where a config names a
component it also accepts `module:attr` (or a name registered with `loongsage.extensions.register`);
docs/extending.md shows each extension point with a working example. This module imports nothing
of LoongSage at run time, so every package may depend on it and on nothing above itself.

    component            config key                     built-ins                    contract
    ---------------------------------------------------------------------------------------------
    Task / Reward        task.name / task.reward        arithmetic calculator ...    TaskSpec, RewardFn
    DataFilter           rollout.filters                (dynamic_sampling)           DataFilter
    AdvantageEstimator   algo.advantage                 grpo dr_grpo rloo            AdvantageEstimator
    PolicyLoss           algo.loss.policy_loss          ppo                          PolicyLoss
    KL estimator         algo.loss.kl_estimator         k1 k2 k3                     KLEstimator
    WindowStrategy       rollout.window                 staleness windowed_fifo      WindowStrategy
    Rollout              agent.kind                     single_turn whitebox ...     Rollout (+ factory)
    Tool                 agent.tools                    calculator python            ToolFactory
    TrainBackend         trainer.backend                fsdp megatron                TrainBackend
    WeightTransport      transfer.implementations       cuda_ipc shm collective ...  WeightTransport
    InferenceClient      rollout.client                 SGLang-protocol HTTP         InferenceClient
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

# The data types these interfaces speak of, named here without importing them (this module sits
# below every package): where each is defined.
TaskRow = Any  # loongsage.tasks.base.TaskRow: prompt (text or messages), answer, tag, tools, meta
Group = Any  # loongsage.sample.Group: the samples of one prompt, their rewards, tag, failures
TrainBatch = Any  # loongsage.trainer.batch.TrainBatch: padded token tensors of a batch of samples
PolicyInputs = Any  # loongsage.algo.losses.PolicyInputs: [B, T] logprobs, advantages, mask, ...
LossConfig = Any  # loongsage.algo.config.LossConfig: the `algo.loss` section
WindowState = Any  # loongsage.window.WindowState: version, running and uncollected groups, k, B
RolloutSetup = Any  # loongsage.rollout.single_turn.RolloutSetup: router, tokenizer, task, sampling, agent
Tensor = Any  # Tensor
Device = Any  # Device


# ---- data and rewards ---------------------------------------------------------------------------
class RewardFn(Protocol):
    def __call__(self, response_text: str, row: TaskRow) -> float:
        """The reward of one response to `row` (the final answer of an agent episode), usually in
        [0, 1]. Must be fast and side-effect free: it runs in the controller for every sample."""


class TaskSpec(Protocol):
    """A data set generator and its verifier (see `loongsage/tasks/base.py` for the dataclass)."""
    name: str
    generate: Callable[..., list[TaskRow]]  # generate(n, seed, exclude=..., **params) -> rows
    reward: RewardFn
    demonstration: Callable[[TaskRow], list[dict]] | None  # expert turns for SFT bootstraps of agents


class DataFilter(Protocol):
    def __call__(self, group: Group) -> bool:
        """Whether a finished group is trained (False: discarded, its place in the window freed and
        counted in `samples/filtered_groups`). Runs when the trainer takes the group."""


# ---- algorithm ---------------------------------------------------------------------------------
class AdvantageEstimator(Protocol):
    def __call__(self, rewards: Tensor) -> Tensor:
        """[groups, n] rewards (n samples of one prompt per row) -> advantages of the same shape,
        one per sample, broadcast over its tokens."""


class PolicyLoss(Protocol):
    def __call__(self, inputs: PolicyInputs, cfg: LossConfig, denominator: float | None
                 ) -> tuple[Tensor, dict[str, float]]:
        """The micro-batch's share of the batch loss and its metrics (floats, reduced over micro-batches
        weighted by tokens). `inputs` holds [B, T] current/proximal/behaviour logprobs, advantages,
        mask (and entropy, reference logprobs when configured); divide sums by `denominator` (the
        global token or sequence count) so micro-batches and ranks add up to the full-batch loss.
        Runs inside the trainer ranks (Ray actors)."""


class KLEstimator(Protocol):
    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        """Per-token estimate of KL(pi || ref) from tokens sampled from pi ([B, T])."""


# ---- asynchrony ----------------------------------------------------------------------------------
class WindowStrategy(Protocol):
    """Which groups may start and which finished ones the trainer may take (`window.py`); the
    sample buffer holds the state and evicts anything stale whatever the strategy says."""

    def capacity(self, state: WindowState) -> int:
        """How many more groups may be admitted now (>= 0)."""

    def collectable(self, seq: int, state: WindowState) -> bool:
        """Whether the finished group number `seq` (admission order) may be taken now."""


# ---- rollouts and agents ---------------------------------------------------------------------------
class Rollout(Protocol):
    """How a prompt becomes a group of samples. Built by a factory `(RolloutSetup) -> Rollout`."""

    async def start(self) -> None:
        """Start what the rollout needs (e.g. the black-box gateway), before the first group."""

    async def stop(self) -> None:
        """Release it; no group runs afterwards."""

    async def group(self, row: TaskRow, n: int, gid: int, seed: int | None = None) -> Group:
        """n rollouts of `row` as one group (samples with exact token ids, behaviour logprobs, per-token
        versions, rewards). Route every model call with a session of the group (`g<gid>`, or
        `g<gid>-...`: `rollout.single_turn.group_session`) so that `cancel` can find it. `seed`
        (optional parameter): the prompt instance's sampling seed, so that a resumed run samples
        what the interrupted one would have."""

    async def cancel(self, gid: int) -> int:
        """Abort the group's requests in flight on the engines that hold them; returns how many."""

    async def evaluate(self, rows: list[TaskRow], temperature: float = 0.0) -> dict[str, float]:
        """Held-out metrics: at least `eval/accuracy` (and `eval/<tag>/accuracy` for tagged rows)."""


RolloutFactory = Callable[[RolloutSetup], Rollout]


class Tool(Protocol):
    """An agent tool (`agentflow/tools.py: Tool`): an OpenAI function spec and its implementation."""
    spec: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    fn: Callable[..., str | Any]  # called with the call's arguments as keywords; may be async
    timeout_s: float


ToolFactory = Callable[[], Tool]


# ---- training ---------------------------------------------------------------------------------
class TrainBackend(Protocol):
    """One trainer rank's model and optimizer, built as `Backend(TrainerConfig, model_path)` inside a
    rank whose torch.distributed group is already initialised (`trainer/worker.py`)."""
    version: int  # optimizer steps taken
    device: Device

    def compute_logprobs(self, batch: TrainBatch, with_entropy: bool = False
                         ) -> tuple[Tensor, Tensor | None]:
        """Per-token logprobs [B, T] of the response tokens (and entropies), no gradient."""

    def train_step(self, batch: TrainBatch, loss: str, loss_cfg: LossConfig | None, denominator: float,
                   last: bool = True) -> dict[str, float]:
        """One optimizer step over this rank's shard (`loss`: "policy" or "sft"); returns metrics.
        `last`: the step's final optimizer step (of its mini-batches): version and LR schedule
        advance once per run step, after it."""

    def skip_step(self) -> dict[str, float]:
        """A step that trains nothing: the version and LR schedule advance as if it had, with no
        optimizer step (momentum alone would move the weights); returns metrics (`train/lr`)."""

    def weight_meta(self) -> list[tuple[str, str, list[int]]]:
        """(HF name, dtype, shape) of every exported tensor, in export order."""

    def full_state_dict(self, names: list[str] | None = None) -> dict[str, Tensor] | None:
        """The full HF-named tensors `names` (all when None) on rank 0, None elsewhere: a collective,
        every rank calls it with the same names."""

    def save(self, path: str) -> None:
        """Model, optimizer and schedule state to `path` (a collective)."""

    def load(self, path: str) -> None:
        """What `save` wrote (a collective)."""


# ---- weights to the engines -------------------------------------------------------------------
class WeightTransport(Protocol):
    """One route of TransferMesh (`transfer/`): its trainer-side sender, its engine-side routes and
    this controller-side part live in one module per route."""
    clients: list[InferenceClient]  # the receivers
    buckets: list[list[int]]  # which exported tensors travel together (indexes into weight_meta)

    async def setup(self) -> None:
        """Once, before the first version (e.g. join a collective group, map shared buffers)."""

    def begin(self, version: int) -> Any:
        """Submit the trainer side now (it is ordered before the trainer's next step, which then
        overlaps the transfer); returns what `deliver` needs."""

    async def deliver(self, version: int, begun: Any) -> dict[str, float]:
        """Feed the receivers; return `time/weight_sync_s` and `weight_sync/bytes`. Every receiver
        must report `version` afterwards (`transport.finish` checks it)."""

    async def aclose(self, gone: list[InferenceClient] = ()) -> None:
        """Release what setup made; `gone`: receivers that died (a mesh rebuilt around a restarted
        engine), whose shared resources are removed, not just let go."""


class InferenceClient(Protocol):
    """The SGLang protocol as seen from the controller (`rollout/client.py: EngineClient` over HTTP),
    built as `Client(base_url, api_key)`. Router, evaluation and the weight routes use only this."""
    base_url: str

    async def generate_raw(self, body: dict) -> Any:
        """POST /generate with an SGLang body; the decoded JSON answer."""

    def generate_stream(self, input_ids: list[int], sampling_params: dict | None = None, **kw
                        ) -> AsyncIterator[dict]:
        """POST /generate with stream=true; the decoded SSE chunks."""

    async def abort(self, rid: str | list[str] | None = None, abort_all: bool = False) -> dict:
        """POST /abort_request."""

    async def pause(self, mode: str = "abort") -> dict:
        """POST /pause_generation (abort | retract | in_place)."""

    async def resume(self) -> dict:
        """POST /continue_generation."""

    async def model_info(self) -> dict:
        """GET /model_info (includes weight_version)."""

    async def aclose(self) -> None:
        """Close the connection pool."""

    # The weight routes call these (SGLang's routes, and LoongSage's extensions on embedded engines):
    # update_weight_version (a step that trained nothing), update_weights_from_disk, update_weights_from_tensor,
    # init_weights_update_group,
    # update_weights_from_distributed, destroy_weights_update_group, map_weights, flip_weights,
    # share_weights, weights_checksum (see rollout/client.py for their arguments).


class WeightSource(Protocol):
    """What a trainer rank offers the weight routes' trainer sides (`trainer/worker.py`): the
    exported weights, gathered bucket by bucket (a collective: every rank takes part)."""
    rank: int
    address: str  # this rank's node address (collective stores bind it)
    model_path: str  # the source model folder (config and tokenizer files for disk exports)
    shm_prefix: str  # the run's /dev/shm prefix
    meta: list[tuple[str, str, list[int]]]  # (HF name, dtype, shape) of every exported tensor

    @property
    def device(self) -> Device: ...

    def export(self, buckets: list[list[str]]):
        """Yields (names, {name: full tensor} on rank 0 / None elsewhere) per bucket, each gathered
        alone, so an export never holds more than one bucket beside the sharded model."""

    def chunks(self, names: list[str] | None = None) -> list[list[str]]:
        """`names` (default: all) in export-sized buckets, in order."""


# ---- the engine side of the weight routes ----------------------------------------------------------
@runtime_checkable
class WeightHost(Protocol):
    """What an inference server offers its weight routes (`engine/weight_host.py` for the embedded
    engine). Methods marked (engine thread) must only be called inside `run`/`update`."""
    host: str  # the address the server binds (collective sockets bind it too)
    shm_prefix: str  # /dev/shm names weight handles may map

    @property
    def weight_version(self) -> int: ...

    def allowed_path(self, path: str) -> str:
        """`path` resolved, if weights may be loaded from it; else ValueError."""

    async def run(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread, between two steps."""

    async def update(self, load: Callable[[], int], version: int | None, flush_cache: bool = True,
                     abort_all: bool = False) -> int:
        """Apply a weight update: `load` (engine thread) returns the tensors it loaded; the prefix
        cache is dropped, and the version set when given."""

    def parameters(self) -> dict[str, Tensor]:
        """(engine thread) The served weights by HF name."""

    def load(self, named: list[tuple[str, Tensor]]) -> int:
        """(engine thread) Copy tensors into the served weights (cast to their dtype)."""

    def load_folder(self, path: str) -> int:
        """(engine thread) Load an HF folder's safetensors into the served weights."""

    @property
    def device(self) -> Device: ...
