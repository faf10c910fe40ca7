"""Megatron-Core backend on CPU (gloo): exact HF <-> Megatron conversion, logprobs equal to the FSDP2
backend's at TP=1, TP=2, PP=2, DP=2 and TP=2 x PP=2, and training steps that match FSDP2's."""
from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from loongsage.algo.losses import LossConfig
from loongsage.models.factory import TinyModelSpec, build_tiny_model
from loongsage.sample import Sample
from loongsage.trainer.batch import collate
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.group import TrainerGroup
from loongsage.trainer.megatron_convert import Layout, hf_to_megatron, megatron_to_hf

pytest.importorskip("megatron.core")


@pytest.mark.parametrize("arch,kv,tied", [("qwen3", 2, True), ("qwen2", 2, False), ("llama", 4, False)])
def test_hf_megatron_round_trip_is_exact(tmp_path, arch, kv, tied):
    from transformers import AutoConfig

    path = build_tiny_model(tmp_path / arch, TinyModelSpec(arch=arch, num_kv_heads=kv, tie_word_embeddings=tied, seed=3))
    hf = load_file(str(path / "model.safetensors"))
    lay = Layout.from_hf(AutoConfig.from_pretrained(path))
    assert lay.qk_norm == (arch == "qwen3") and lay.qkv_bias == (arch == "qwen2")
    for tp in (1, 2):
        shards = [hf_to_megatron(hf, lay, r, tp) for r in range(tp)]
        if tp == 2:  # really split: each rank holds half of the query groups and of the MLP
            assert shards[0]["decoder.layers.0.mlp.linear_fc1.weight"].shape[0] == lay.ffn
            assert not torch.equal(shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"],
                                   shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"])
        back = megatron_to_hf(shards, lay)
        expected = {k: v for k, v in hf.items() if not (tied and k == "lm_head.weight")}
        assert back.keys() == expected.keys()
        assert all(torch.equal(back[k], expected[k]) for k in expected), tp
    stages = [hf_to_megatron(hf, lay, 0, 1, stage, 2) for stage in (0, 1)]  # two pipeline stages
    assert "embedding.word_embeddings.weight" not in stages[1] and "decoder.final_layernorm.weight" not in stages[0]
    assert ("output_layer.weight" in stages[1]) and not any(k.startswith("decoder.layers.1.") for s in stages for k in s)
    back = {}
    for stage, sd in enumerate(stages):
        back.update(megatron_to_hf([sd], lay, stage, 2))
    assert back.keys() == expected.keys() and all(torch.equal(back[k], expected[k]) for k in expected)


def test_unsupported_model_and_bad_tensor_parallel_size_are_named(tmp_path):
    from transformers import AutoConfig

    path = build_tiny_model(tmp_path / "m", TinyModelSpec(num_heads=4, num_kv_heads=2))
    lay = Layout.from_hf(AutoConfig.from_pretrained(path))
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide the model's num_key_value_heads"):
        lay.check_parallel(4)
    config = AutoConfig.from_pretrained(path)
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        Layout.from_hf(config)
    with pytest.raises(ValueError, match="need backend: megatron"):
        TrainerConfig(tensor_parallel_size=2, world_size=2)


def _batch(seed: int, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p = torch.randint(10, 100, (3 + i,), generator=g).tolist()
        r = torch.randint(10, 100, (2 + 2 * i,), generator=g).tolist()
        samples.append(Sample(p, r, [1] * len(r), torch.randn(len(r), generator=g).mul(0.1).sub(4.6).tolist(),
                              [0] * len(r), advantage=float(i % 3 - 1)))
    return collate(samples, 0)


def _run(group: TrainerGroup, steps: int):
    """Logprobs of a fixed batch, then `steps` policy steps on fresh batches, then logprobs again."""
    async def go():
        probe = _batch(100)
        before, _ = await group.compute_logprobs(probe)
        metrics = [await group.train_step(_batch(s), "policy", LossConfig(is_mode="tis")) for s in range(steps)]
        after, _ = await group.compute_logprobs(probe)
        return probe.loss_mask, before, metrics, after
    return asyncio.run(go())


def test_megatron_tp_pp_dp_layouts_match_fsdp_logprobs_and_training(ray_session, tiny_model):
    common = dict(lr=1e-2, micro_batch_size=4, max_grad_norm=0.5)
    runs = {}
    for name, cfg in {"fsdp": TrainerConfig(**common),
                      "megatron_tp1": TrainerConfig(backend="megatron", **common),
                      "megatron_tp2": TrainerConfig(backend="megatron", world_size=2, tensor_parallel_size=2, **common),
                      "megatron_pp2": TrainerConfig(backend="megatron", world_size=2, pipeline_parallel_size=2,
                                                    **common),
                      "megatron_dp2": TrainerConfig(backend="megatron", world_size=2, **common),
                      "megatron_tp2_pp2": TrainerConfig(backend="megatron", world_size=4, tensor_parallel_size=2,
                                                        pipeline_parallel_size=2, **common)}.items():
        group = TrainerGroup(cfg, tiny_model)
        try:
            runs[name] = _run(group, steps=3)
            runs[name] += (group.full_state_dict_on_rank0(),)
        finally:
            group.shutdown()
    mask, ref_before, ref_metrics, ref_after, ref_weights = runs["fsdp"]
    for name in [n for n in runs if n != "fsdp"]:
        _, before, metrics, after, weights = runs[name]
        assert ((before - ref_before) * mask).abs().max() < 1e-5, name  # same weights, same logprobs
        for m, r in zip(metrics, ref_metrics):
            assert m["loss/policy"] == pytest.approx(r["loss/policy"], abs=1e-5), name
            assert m["train/grad_norm"] == pytest.approx(r["train/grad_norm"], rel=1e-4), name
        assert ((after - ref_after) * mask).abs().max() < 1e-4, name  # three clipped Adam steps later
        assert ((after - before) * mask).abs().max() > 1e-2  # and training moved the policy
        assert weights.keys() == ref_weights.keys()
        diffs = torch.cat([(weights[k] - ref_weights[k]).abs().flatten() for k in weights])
        # Adam turns summation-order noise in near-zero gradients into a few percent of an lr step
        # (1e-2) on a handful of weights; the rest agree to ~1e-6
        assert diffs.max() < 5e-3 and diffs.mean() < 1e-5 and (diffs > 1e-4).float().mean() < 1e-3, (name, diffs.max(), diffs.mean())
