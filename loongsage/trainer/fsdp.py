"""Torch FSDP2 backend: `fully_shard` per decoder layer and at the root (one fp32 rank: the plain module),
gloo on CPU, NCCL on GPU.

The loss of a step is the sum over micro-batches and ranks of per-token terms divided by the
*global* denominator, so 1 rank and N ranks (and any micro-batch size) give the same update.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from loongsage.algo.config import LossConfig
from loongsage.models.hf_folder import write_hf_folder
from loongsage.trainer.batch import TrainBatch
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.shared_prefix import shared_prefix_scores
from loongsage.trainer.step import MetricSums, TokenScores, lr_factor, micro_batch_loss, score_tokens, wants_entropy


class FSDPBackend:
    def __init__(self, cfg: TrainerConfig, model_path: str):
        self.cfg = cfg
        self.model_path = str(model_path)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(cfg.device if cfg.device != "cuda" else f"cuda:{torch.cuda.current_device()}")
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        model.to(self.device)
        self.sharded = self.world > 1 or cfg.bf16
        if self.sharded:
            # One fp32 rank has nothing to shard, gather or cast: the hooks would only cost time
            # (~25% of a small model's step on one CPU thread); the rest of this class takes both.
            mesh = init_device_mesh(self.device.type, (self.world,))
            mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16
                  else MixedPrecisionPolicy())
            for layer in _decoder_layers(model):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(step, cfg))
        self.version = 0

    # ---- forward ----------------------------------------------------------------------------
    def _forward(self, mb: TrainBatch, with_entropy: bool, with_teacher: bool = False) -> TokenScores:
        # Shared prefixes call the model several times per micro-batch, a count that depends on the
        # rows: sharded ranks must make the same calls (FSDP collectives), so only the plain module.
        if self.cfg.shared_prefix and not self.sharded:
            scores = shared_prefix_scores(self.model, mb, self.device, with_entropy, with_teacher, self.cfg.shared_prefix)
            if scores is not None:
                return scores
        ids = mb.input_ids.to(self.device)
        out = self.model(input_ids=ids, attention_mask=mb.attention_mask.to(self.device), use_cache=False)
        return score_tokens(out.logits[:, :-1], ids[:, 1:], with_entropy, mb.teacher_top_ids if with_teacher else None,
                            mb.temperatures)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, with_entropy: bool = False):
        self.model.eval()
        shape = batch.loss_mask.shape
        lps, ents = torch.zeros(shape), (torch.zeros(shape) if with_entropy else None)
        for idx, mb in batch.micro_batches(self.cfg.micro_batch_size):
            scores = self._forward(mb, with_entropy)
            lp, ent = scores.logprobs, scores.entropy
            lps[idx, : lp.shape[1]] = lp.float().cpu()
            if with_entropy:
                ents[idx, : ent.shape[1]] = ent.float().cpu()
        return lps, ents

    # ---- training ---------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, loss: str, loss_cfg: LossConfig | None, denominator: float,
                   last: bool = True) -> dict[str, float]:
        self.model.train()
        sums = MetricSums()
        spared = positions = 0
        for _, mb in batch.micro_batches(self.cfg.micro_batch_size):
            scores = self._forward(mb, wants_entropy(loss, loss_cfg), with_teacher=True)
            value, metrics = micro_batch_loss(scores, mb, loss, loss_cfg, denominator)
            # FSDP averages gradients over ranks; the global denominator already normalises.
            (value * self.world).backward()
            sums.add(metrics, float(mb.loss_mask.sum()))
            spared += scores.spared_positions
            positions += int(mb.attention_mask.sum())
        grad_norm = 0.0
        if self.cfg.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self._end_step() if last else self.scheduler.get_last_lr()[0]
        out = sums.result()
        out.update({"train/grad_norm": grad_norm, "train/lr": lr, "train/tokens": float(batch.loss_mask.sum()),
                    "train/shared_prefix_frac": spared / max(positions, 1)})
        return out

    def skip_step(self) -> dict[str, float]:
        return {"train/lr": self._end_step()}

    def _end_step(self) -> float:
        """The run step is over (trained or skipped): schedule and version advance; returns the
        learning rate the step used."""
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.version += 1
        return lr

    # ---- weights ----------------------------------------------------------------------------
    def full_state_dict(self, names: list[str] | None = None) -> dict[str, torch.Tensor] | None:
        """Full tensors on rank 0 (a collective on all ranks, which must pass the same `names`). With
        `names` (one bucket of a weight sync) only those parameters are gathered, on the training
        device, so an export never holds more than a bucket beside the sharded model."""
        if names is not None:
            params = dict(self.model.named_parameters())
            out = {}
            for n in names:
                p = params[n].detach()
                full = p.full_tensor() if isinstance(p, DTensor) else p
                if self.rank == 0:
                    out[n] = full
            return out if self.rank == 0 else None
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        if self.tied:
            sd.pop("lm_head.weight", None)
        return sd

    def weight_meta(self) -> list[tuple[str, str, list[int]]]:
        out = []
        for name, p in self.model.named_parameters():
            if self.tied and name == "lm_head.weight":
                continue
            out.append((name, str(p.dtype).removeprefix("torch."), list(p.shape)))
        return out

    def save(self, path: str) -> None:
        """An HF folder (loadable by engines and transformers) plus the optimizer state."""
        sd = self.full_state_dict()
        osd = get_optimizer_state_dict(self.model, self.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            write_hf_folder(Path(path), sd, self.model_path, {"optimizer": osd, "scheduler": self.scheduler.state_dict(),
                                                              "version": self.version})
        dist.barrier()

    def load(self, path: str) -> None:
        sd = load_file(str(Path(path) / "model.safetensors"))
        if self.tied:
            sd.pop("lm_head.weight", None)  # the tied parameter is loaded through the embedding
        set_model_state_dict(self.model, sd, options=StateDictOptions(full_state_dict=True, strict=False))
        state_file = Path(path) / "trainer_state.pt"
        if state_file.exists():
            state = torch.load(state_file, weights_only=False)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
            self.scheduler.load_state_dict(state["scheduler"])
            self.version = state["version"]


def _decoder_layers(model) -> list[torch.nn.Module]:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers to shard")
    return list(layers)
