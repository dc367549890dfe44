"""Data-parallel LoRA fine-tuning of a patched model: 2 CPU processes on the gloo backend.

This file is also the worker. Launched by ``torchrun`` or ``accelerate launch`` it trains a few steps, either
with `accelerate` (DistributedDataParallel underneath) or with PyTorch's FSDP2 (``fully_shard``), and writes
what each rank saw to ``--out``; the tests check it. Each rank trains on its own half of every batch, so the
ranks agree only if gradients are averaged, and then they match one process training on the whole batch.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/training/test_distributed.py --out DIR
    accelerate launch --multi_gpu --num_processes 2 tests/training/test_distributed.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 3
PER_RANK = 2
LENGTH = 24
LR = 2e-2
OPTIONS = {"scale": "logn", "train_length": 8, "sink_logit": "learnable"}
WORLD = 2
ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"],
    "accelerate": [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        # --multi_gpu selects accelerate's torchrun launcher; without CUDA each process runs on CPU with gloo.
        "--multi_gpu",
        f"--num_processes={WORLD}",
        "--num_machines=1",
        "--mixed_precision=no",
        "--dynamo_backend=no",
    ],
}


def _launch(launcher: str, mode: str, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [*LAUNCHERS[launcher], __file__, "--mode", mode, "--out", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize(
    ("launcher", "mode"),
    [
        ("torchrun", "ddp"),
        pytest.param("accelerate", "ddp", marks=pytest.mark.slow),
        pytest.param("torchrun", "fsdp2", marks=pytest.mark.slow),
    ],
)
def test_data_parallel_lora_stays_in_sync(launcher, mode, tmp_path):
    reports = _launch(launcher, mode, tmp_path)
    for rank, report in enumerate(reports):
        assert report["world_size"] == WORLD and report["rank"] == rank and report["backend"] == "gloo"
        assert (
            report["wrapper"] == {"ddp": "DistributedDataParallel", "fsdp2": "FSDPPeftModelForCausalLM"}[mode]
        )
        # Trained: LoRA A and B on the 4 projections of 2 layers, and one sink logit vector per layer.
        assert report["num_trainable"] == 4 * 2 * 2 + 2
        assert report["patch_params"] == [
            f"base_model.model.model.layers.{i}.self_attn.hfa.modules_to_save.default.sink" for i in range(2)
        ]
        # Bitwise equal on every rank after every step: the gradients were averaged before the update.
        assert report["max_diff_across_ranks"] == [0.0] * STEPS
        assert report["moved_from_init"] > 1e-3 and report["sink_moved"] > 1e-4
    # Different data per rank (else agreement would be trivial), hence different local losses.
    assert reports[0]["losses"] != reports[1]["losses"]
    # The averaged gradient is the whole-batch gradient of one process (a sum would be twice as large),
    # and the parameters after the steps are that process's.
    assert reports[0]["grad_rel_diff_vs_single_process"] < 1e-5
    assert reports[0]["max_diff_vs_single_process"] < 1e-4
    assert reports[0]["reference_loss_drop"] > 0.05
    if mode == "fsdp2":  # sharded parameters, and the adapter saved from a full state dict on rank 0
        assert reports[0]["sink_is_sharded"] and reports[0]["adapter_max_diff_vs_single_process"] < 1e-4


# --- worker -------------------------------------------------------------------------------------------------


def _build():
    import torch
    from conftest import tiny_model
    from peft import get_peft_model

    import hf_attnscale as hfa

    model = hfa.patch(tiny_model("llama", seed=0), **OPTIONS)
    torch.manual_seed(1)  # the same LoRA initialisation on every rank
    return get_peft_model(model, hfa.lora_config(model, r=4, lora_alpha=8))


def _global_batch(step: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, 128, (WORLD * PER_RANK, 6), generator=gen).repeat(1, LENGTH // 6)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _full(tensor):
    """The whole tensor of a (possibly FSDP2-sharded) parameter or gradient."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _trainable(model) -> list:
    return [p for _, p in sorted(model.named_parameters()) if p.requires_grad]


def _flat(model, grads: bool = False):
    import torch

    return torch.cat([_full(p.grad if grads else p).detach().reshape(-1) for p in _trainable(model)])


def _single_process_reference(report: dict, first_grads, trained) -> object:
    """The same steps in one process on the whole batch; records how far the distributed run is from it."""
    import torch

    single = _build()
    optimizer = torch.optim.AdamW(_trainable(single), lr=LR)
    single.train()
    first_loss = None
    for step in range(STEPS):
        loss = single(**_global_batch(step)).loss
        loss.backward()
        if step == 0:
            first_loss, grads = loss.item(), _flat(single, grads=True)
            report["grad_rel_diff_vs_single_process"] = ((grads - first_grads).norm() / grads.norm()).item()
        optimizer.step()
        optimizer.zero_grad()
    report["max_diff_vs_single_process"] = (_flat(single) - trained).abs().max().item()
    with torch.no_grad():
        report["reference_loss_drop"] = first_loss - single(**_global_batch(0)).loss.item()
    return single


def worker(mode: str, out: Path) -> None:
    import torch
    import torch.distributed as dist

    import hf_attnscale as hfa

    torch.set_num_threads(1)
    if mode == "ddp":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build()
    init = _flat(model)
    sink_init = torch.cat([p.detach().clone() for _, p in hfa.trainable_parameters(model)])
    if mode == "ddp":
        optimizer = torch.optim.AdamW(_trainable(model), lr=LR)
        wrapped, optimizer = accelerator.prepare(model, optimizer)
        backward = accelerator.backward
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
        optimizer = torch.optim.AdamW(_trainable(model), lr=LR)  # after sharding: over the DTensor shards
        backward = torch.Tensor.backward

    losses, diffs = [], []
    wrapped.train()
    for step in range(STEPS):
        batch = {k: v[rank * PER_RANK : (rank + 1) * PER_RANK] for k, v in _global_batch(step).items()}
        loss = wrapped(**batch).loss
        backward(loss)
        if step == 0:  # after backward the gradients are already averaged over the ranks
            first_grads = _flat(model, grads=True)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        flat = _flat(model)
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        diffs.append(max((g - flat).abs().max().item() for g in gathered))

    trained = _flat(model)
    sinks = [p for _, p in hfa.trainable_parameters(model)]
    report = {
        "rank": rank,
        "world_size": world,
        "backend": dist.get_backend(),
        "wrapper": type(wrapped).__name__,
        "num_trainable": len(_trainable(model)),
        "patch_params": [n for n, _ in hfa.trainable_parameters(model)],
        "sink_is_sharded": all(hasattr(p, "full_tensor") for p in sinks),
        "losses": losses,
        "max_diff_across_ranks": diffs,
        "moved_from_init": (trained - init).abs().max().item(),
        "sink_moved": (torch.cat([_full(p).detach() for p in sinks]) - sink_init).abs().max().item(),
    }
    if mode == "fsdp2":  # FSDP2 checkpointing: gather a full state dict (collective), save on rank 0
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            model.save_pretrained(out / "adapter", state_dict=full)
    if rank == 0:
        single = _single_process_reference(report, first_grads, trained)
        if mode == "fsdp2":
            from conftest import tiny_model

            reloaded = hfa.load_adapter(tiny_model("llama", seed=0), out / "adapter")
            report["adapter_max_diff_vs_single_process"] = max(
                (a - b).abs().max().item()
                for (_, a), (_, b) in zip(
                    sorted(reloaded.state_dict().items()), sorted(single.state_dict().items()), strict=True
                )
            )
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))  # the shared factories (conftest.py), as pytest would find them
    worker(args.mode, args.out)
