"""Megatron-Core backend: GPTModel (local layer spec), tensor and data parallelism, Megatron's DDP
and optimizer, behind the same TrainBackend contract as FSDP2.

Ranks are laid out as Megatron does (tensor-parallel ranks adjacent): rank r is tensor-parallel rank
r % tp of data-parallel replica r // tp. The trainer group gives every rank of a replica the same
shard of the batch. Weights come from and go to HF folders through `megatron_convert`; the
tensor-parallel shards are gathered for export. On a machine without CUDA `megatron_shim` redirects
Megatron's CUDA assumptions (gloo collectives, FP32 optimizer, local spec).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoConfig

from loongsage.algo.losses import LossConfig
from loongsage.trainer.batch import TrainBatch
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.megatron_convert import Layout, build_gpt_model, hf_to_megatron, megatron_to_hf
from loongsage.trainer.step import MetricSums, lr_factor, micro_batch_loss, token_logprobs, wants_entropy, write_hf_folder


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
        self.tp = cfg.tensor_parallel_size
        on_cpu = not cfg.device.startswith("cuda")
        if on_cpu:
            apply_cpu_shim()
            if cfg.bf16:
                raise ValueError("trainer.bf16 with trainer.backend=megatron needs CUDA (Megatron's bf16 optimizer)")
        self.device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        ps.initialize_model_parallel(tensor_model_parallel_size=self.tp)
        self.tp_rank, self.dp = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.layout = Layout.from_hf(hf_config)
        self.layout.check_tp(self.tp)
        hf = _hf_weights(self.model_path)
        self.meta = [(n, "float32", list(t.shape)) for n, t in hf.items() if not (self.layout.tied and n == "lm_head.weight")]
        model = build_gpt_model(self.layout, self.tp).to(self.device)
        model.load_state_dict(hf_to_megatron(hf, self.layout, self.tp_rank, self.tp), strict=True)
        self.model = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                        use_distributed_optimizer=False), model)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1], clip_grad=cfg.max_grad_norm, bf16=False, fp16=False,
            use_distributed_optimizer=False), [self.model])
        self.step_count = 0
        self.version = 0

    # ---- forward ----------------------------------------------------------------------------
    def _forward(self, mb: TrainBatch, with_entropy: bool):
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        ids = mb.input_ids.to(self.device)
        b, s = ids.shape
        keys = mb.attention_mask.to(self.device).bool()
        # True = masked: causal, and no attention to padding keys (right-padded rows never need it).
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.device), 1)[None, None] | ~keys[:, None, None, :]
        positions = torch.arange(s, device=self.device)[None].expand(b, -1)
        logits = self.model(ids, positions, attention_mask=mask)  # [b, s, vocab / tp]
        logits = gather_from_tensor_model_parallel_region(logits)  # full vocabulary, grads split back
        return token_logprobs(logits[:, :-1], ids[:, 1:], with_entropy)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, with_entropy: bool = False):
        self.model.eval()
        shape = batch.loss_mask.shape
        lps, ents = torch.zeros(shape), (torch.zeros(shape) if with_entropy else None)
        for idx, mb in batch.micro_batches(self.cfg.micro_batch_size):
            lp, ent = self._forward(mb, with_entropy)
            lps[idx, : lp.shape[1]] = lp.float().cpu()
            if with_entropy:
                ents[idx, : ent.shape[1]] = ent.float().cpu()
        return lps, ents

    # ---- training ---------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, loss: str, loss_cfg: LossConfig | None, denominator: float) -> dict[str, float]:
        from megatron.core.distributed import finalize_model_grads

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        sums = MetricSums()
        for _, mb in batch.micro_batches(self.cfg.micro_batch_size):
            lp, ent = self._forward(mb, wants_entropy(loss, loss_cfg))
            value, metrics = micro_batch_loss(lp, ent, mb, loss, loss_cfg, denominator)
            # Megatron's DDP averages gradients over data-parallel replicas; the global denominator
            # already normalises, so undo the average.
            (value * self.dp).backward()
            sums.add(metrics, float(mb.loss_mask.sum()))
        # DP all-reduce, plus the grads of replicated params that each tensor-parallel rank sees only
        # in part (Qwen3's per-head q/k norms), plus tied embeddings across pipeline stages.
        finalize_model_grads([self.model])
        lr = self.cfg.lr * lr_factor(self.step_count, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("Megatron optimizer step failed (non-finite gradients)")
        self.step_count += 1
        self.version += 1
        out = sums.result()
        out.update({"train/grad_norm": float(grad_norm or 0.0), "train/lr": lr,
                    "train/tokens": float(batch.loss_mask.sum())})
        return out

    # ---- weights ----------------------------------------------------------------------------
    def _local_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.module.state_dict().items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Tensor-parallel shards gathered within each replica; HF names, full tensors on rank 0."""
        local = self._local_state()
        shards: list[dict[str, torch.Tensor]] = [dict() for _ in range(self.tp)]
        for name in sorted(local):
            t = local[name].contiguous()
            if self.tp > 1:
                parts = [torch.empty_like(t) for _ in range(self.tp)]
                dist.all_gather(parts, t, group=self.tp_group)
            else:
                parts = [t]
            for r, p in enumerate(parts):
                shards[r][name] = p.cpu()
        if self.rank != 0:
            return None
        return megatron_to_hf(shards, self.layout)

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
        hf = _hf_weights(path)
        self.model.module.load_state_dict(hf_to_megatron(hf, self.layout, self.tp_rank, self.tp), strict=True)
        opt_file = Path(path) / f"megatron_optimizer_rank{self.rank}.pt"
        if opt_file.exists():
            self.optimizer.load_state_dict(torch.load(opt_file, weights_only=False))
        state_file = Path(path) / "trainer_state.pt"
        if state_file.exists():
            state = torch.load(state_file, weights_only=False)
            self.version, self.step_count = state["version"], state.get("step", state["version"])
