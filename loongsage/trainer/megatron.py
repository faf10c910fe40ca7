"""Megatron-Core backend: GPTModel (local layer spec), tensor, pipeline and data parallelism,
Megatron's schedules, DDP and optimizer, behind the same TrainBackend contract as FSDP2.

Ranks are laid out as Megatron does (tensor-parallel fastest, then data, then pipeline): rank r is
tensor-parallel rank r % tp of replica (r // tp) % dp in stage r // (tp * dp). Every rank of a
replica gets the replica's shard of the batch; results (logprobs, metrics) come from the last stage.
Every step runs through Megatron's forward-backward schedule (no pipelining when pp = 1, 1F1B
otherwise) with variable sequence lengths, since micro-batches are trimmed to their longest row.
Losses arrive divided by the global denominator (`calculate_per_token_loss`: nothing is averaged
again). Weights come from and go to HF folders through `megatron_convert`; for export the
tensor-parallel shards are gathered per stage and the stages' parts gathered on rank 0. On a machine
without CUDA `megatron_shim` redirects Megatron's CUDA assumptions.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoConfig

from loongsage.algo.config import LossConfig
from loongsage.models.hf_folder import write_hf_folder
from loongsage.trainer.batch import TrainBatch
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.megatron_convert import (
    Layout,
    apply_rules,
    build_gpt_model,
    export_rules,
    hf_to_megatron,
    transformer_engine_available,
)
from loongsage.trainer.step import MetricSums, lr_factor, micro_batch_loss, score_tokens, wants_entropy


def _hf_weights(model_path: str) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return {k: v.float() for k, v in out.items()}


class MegatronBackend:
    def __init__(self, cfg: TrainerConfig, model_path: str):
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from loongsage.trainer.megatron_shim import apply_cpu_shim

        self.cfg, self.model_path = cfg, str(model_path)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tp, self.pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
        on_cpu = not cfg.device.startswith("cuda")
        if on_cpu:
            apply_cpu_shim()
            if cfg.bf16:
                raise ValueError("trainer.bf16 with trainer.backend=megatron needs CUDA (Megatron's bf16 optimizer)")
        self.device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        ps.initialize_model_parallel(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp)
        self.tp_rank, self.tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        self.stage, self.last = ps.get_pipeline_model_parallel_rank(), ps.is_pipeline_last_stage()
        self.lead = self.tp_rank == 0 and ps.get_data_parallel_rank() == 0  # exports its stage
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        self.layout = Layout.from_hf(AutoConfig.from_pretrained(self.model_path))
        self.layout.check_parallel(self.tp, self.pp)
        hf = _hf_weights(self.model_path)
        self.meta = [(n, "float32", list(t.shape)) for n, t in hf.items() if not (self.layout.tied and n == "lm_head.weight")]
        self.te = not on_cpu and transformer_engine_available()  # TE layer spec on GPU, local spec otherwise
        self.rules = export_rules(self.layout, self.stage, self.pp, self.te)  # Megatron -> HF, per tensor group
        model = build_gpt_model(self.layout, self.tp, self.pp, self.stage, self.te).to(self.device)
        self._load_local(model, hf)
        self.model = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                        use_distributed_optimizer=False), model)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1], clip_grad=cfg.max_grad_norm, bf16=False, fp16=False,
            use_distributed_optimizer=False), [self.model])
        self.step_count = 0
        self.version = 0
        self._entropy = False  # whether the current schedule computes entropies

    def _load_local(self, model, hf: dict[str, torch.Tensor]) -> None:
        sd = hf_to_megatron(hf, self.layout, self.tp_rank, self.tp, self.stage, self.pp, self.te)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"Megatron weights of stage {self.stage}: missing {missing}, unexpected {unexpected}")

    # ---- forward ----------------------------------------------------------------------------
    def _schedule(self, batch: TrainBatch, forward_only: bool, on_scores) -> None:
        """Runs every micro-batch through Megatron's schedule; on the last stage `on_scores(idx, mb,
        scores)` turns each micro-batch's `TokenScores` into its loss."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        mbs = batch.micro_batches(self.cfg.micro_batch_size)

        def loss_func(idx, mb, ids, output):
            logits = gather_from_tensor_model_parallel_region(output)  # full vocabulary, grads split back
            scores = score_tokens(logits[:, :-1], ids[:, 1:], self._entropy, None if forward_only else mb.teacher_top_ids,
                                  mb.temperatures)
            value = on_scores(idx, mb, scores)
            return value, torch.tensor(1, dtype=torch.int), {}

        def forward_step(data_iterator, model):
            idx, mb = next(data_iterator)
            ids = mb.input_ids.to(self.device)
            b, s = ids.shape
            keys = mb.attention_mask.to(self.device).bool()
            # True = masked: causal, and no attention to padding keys.
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.device), 1)[None, None] | ~keys[:, None, None, :]
            positions = torch.arange(s, device=self.device)[None].expand(b, -1)
            return model(ids, positions, attention_mask=mask), partial(loss_func, idx, mb, ids)

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.model], num_microbatches=len(mbs),
            seq_length=batch.input_ids.shape[1], micro_batch_size=self.cfg.micro_batch_size, forward_only=forward_only)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, with_entropy: bool = False):
        """Filled on the last pipeline stage (zeros elsewhere; the trainer group reads the last)."""
        self.model.eval()
        shape = batch.loss_mask.shape
        lps, ents = torch.zeros(shape), (torch.zeros(shape) if with_entropy else None)

        def keep(idx, mb, scores):
            lp = scores.logprobs
            lps[idx, : lp.shape[1]] = lp.float().cpu()
            if with_entropy:
                ents[idx, : scores.entropy.shape[1]] = scores.entropy.float().cpu()
            return lp.sum() * 0.0

        self._entropy = with_entropy
        self._schedule(batch, forward_only=True, on_scores=keep)
        return lps, ents

    # ---- training ---------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, loss: str, loss_cfg: LossConfig | None, denominator: float,
                   last: bool = True) -> dict[str, float]:
        from megatron.core.distributed import finalize_model_grads

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        sums = MetricSums()

        def loss_of(idx, mb, scores):
            value, metrics = micro_batch_loss(scores, mb, loss, loss_cfg, denominator)
            sums.add(metrics, float(mb.loss_mask.sum()))
            return value

        self._entropy = wants_entropy(loss, loss_cfg)
        self._schedule(batch, forward_only=False, on_scores=loss_of)
        # DP all-reduce (summed: the losses are shares of the global one), plus the grads of replicated
        # params each tensor-parallel rank sees only in part (Qwen3's per-head q/k norms), plus tied
        # embeddings across pipeline stages.
        finalize_model_grads([self.model])
        lr = self._lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("Megatron optimizer step failed (non-finite gradients)")
        if last:
            self._end_step()
        out = sums.result()
        out.update({"train/grad_norm": float(grad_norm or 0.0), "train/lr": lr,
                    "train/tokens": float(batch.loss_mask.sum())})
        return out

    def skip_step(self) -> dict[str, float]:
        lr = self._lr()  # what this step would have used
        self._end_step()
        return {"train/lr": lr}

    def _lr(self) -> float:
        return self.cfg.lr * lr_factor(self.step_count, self.cfg)

    def _end_step(self) -> None:
        """The run step is over (trained or skipped): schedule and version advance."""
        self.step_count += 1
        self.version += 1

    # ---- weights ----------------------------------------------------------------------------
    def _local_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.module.state_dict().items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}

    def full_state_dict(self, names: list[str] | None = None) -> dict[str, torch.Tensor] | None:
        """HF-named full tensors on rank 0 (all of them, or just `names`: one bucket of a weight sync
        gathers only the shards that bucket needs): tensor-parallel shards gathered within each
        stage, then each stage's part gathered from its lead rank (a collective on all ranks, which
        must pass the same `names`)."""
        wanted = None if names is None else set(names)
        rules = [r for r in self.rules if wanted is None or wanted.intersection(r.outputs)]
        local = self._local_state()
        shards: list[dict[str, torch.Tensor]] = [dict() for _ in range(self.tp)]
        for name in sorted({s for r in rules for s in r.sources}):
            t = local[name].contiguous()
            parts = [t]
            if self.tp > 1:
                parts = [torch.empty_like(t) for _ in range(self.tp)]
                dist.all_gather(parts, t, group=self.tp_group)
            for r, p in enumerate(parts):
                shards[r][name] = p.cpu()
        part = None
        if self.lead:
            part = apply_rules(rules, shards, self.layout)
            if wanted is not None:  # a rule may build more than the bucket holds (q, k, v together)
                part = {n: t for n, t in part.items() if n in wanted}
        if self.pp > 1:
            parts = [None] * self.world if self.rank == 0 else None
            dist.gather_object(part, parts, dst=0)
            if self.rank != 0:
                return None
            full: dict[str, torch.Tensor] = {}
            for p in parts:
                full.update(p or {})
            return full
        return part if self.rank == 0 else None

    def weight_meta(self) -> list[tuple[str, str, list[int]]]:
        return list(self.meta)

    def save(self, path: str) -> None:
        """An HF folder (loadable by engines and transformers); each rank's optimizer state beside it."""
        sd = self.full_state_dict()
        out = Path(path)
        if self.rank == 0:
            write_hf_folder(out, sd, self.model_path, {"version": self.version, "step": self.step_count})
        dist.barrier()
        torch.save(self.optimizer.state_dict(), out / f"megatron_optimizer_rank{self.rank}.pt")
        dist.barrier()

    def load(self, path: str) -> None:
        self._load_local(self.model.module, _hf_weights(path))
        opt_file = Path(path) / f"megatron_optimizer_rank{self.rank}.pt"
        if opt_file.exists():
            self.optimizer.load_state_dict(torch.load(opt_file, weights_only=False))
        state_file = Path(path) / "trainer_state.pt"
        if state_file.exists():
            state = torch.load(state_file, weights_only=False)
            self.version, self.step_count = state["version"], state.get("step", state["version"])
