"""Run by tests/xla/test_xla_spmd.py: a tiny Llama trained for a few steps, in one process, either

    ref                 without SPMD: on one XLA device, then on the CPU (the one-process run)
    spmd LAYOUT ...     under torch-xla SPMD over all CPU_NUM_DEVICES devices, each layout in turn,
                        its shardings read from the run's parallel plan (nxdt.parallel.xla_spmd)
    preset PTYPE        fsdp4 under SPMD with precision.type PTYPE (its env vars set before torch)

and print one JSON line: per run the losses, and under SPMD the bytes one device holds of the
parameters and of the optimizer state (read from the shardings).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

STEPS = int(os.environ.get("NXDT_SPMD_STEPS", "10"))
MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
         "model.num_kv_heads=2", "model.max_position_embeddings=64", "model.encoder_seq_length=16",
         "data.seq_length=16", "data.micro_batch_size=1", "data.global_batch_size=8", "model.optim.lr=3e-3",
         "model.optim.sched.warmup_steps=5", "trainer.accelerator=xla"]
LAYOUTS = {  # name -> (devices, overrides)
    "dp4": (4, []),
    "fsdp4": (4, ["distributed_strategy.sharding_strategy=fsdp"]),
    "zero1_dp4": (4, ["distributed_strategy.zero1=true"]),
    "tp2_dp2": (4, ["distributed_strategy.tensor_model_parallel_size=2"]),
    "tp2_sp_fsdp2": (4, ["distributed_strategy.tensor_model_parallel_size=2", "distributed_strategy.sequence_parallel=true",
                         "distributed_strategy.sharding_strategy=fsdp"]),
}

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.router_aux_loss_coef=0.1",
       "model.moe.capacity_factor=1.5"]  # a tiny MoE Llama (nxdt.models.moe_xla on XLA), tokens dropped
LAYOUTS["moe_ep2"] = (4, [*MOE, "distributed_strategy.expert_model_parallel_size=2"])

VOCAB = 256


def config(devices: int, overrides: list[str], ptype: str = "fp32"):
    from nxdt.spec import load_config

    return load_config(["--config-name", "tiny_llama_cpu", *MODEL, f"trainer.devices={devices}",
                        f"precision.type={ptype}", *overrides], check_paths=False, quiet=True)


def data():
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4, 8, 17), generator=g)
    for t in range(1, 17):
        tokens[..., t] = (tokens[..., t - 1] * 3 + 1) % VOCAB
    return tokens


def train(cfg, device, parallelize=None, shard_batch=None, after_build=None, steps: int = STEPS, first: int = 0,
          harness=None) -> dict:
    """`steps` optimizer steps of 2 micro-batches of 4 sequences each (global batch 8)."""
    import torch

    from nxdt import device as dev
    from nxdt.training.builder import build_harness
    from nxdt.training.step import microbatch_forward_backward, train_step

    h = harness or build_harness(cfg, VOCAB, on_xla=device.type == "xla", device=device, parallelize=parallelize)
    if after_build is not None and harness is None:
        after_build(h)
    fwd_bwd = microbatch_forward_backward(h.model, h.precision, 2, device_type=device.type)
    tokens, losses = data(), []
    for step in range(first, first + steps):
        b = tokens[step % len(tokens)].to(device)
        batch = {"input_ids": b[:, :-1], "labels": b[:, 1:], "loss_mask": torch.ones(8, 16, device=device)}
        if shard_batch is not None:
            shard_batch(batch)
        m = train_step(h.model, h.optimizer, None, h.precision, fwd_bwd, batch, step=step, clip=1.0)
        if device.type == "xla":
            dev.in_step_closure(lambda v: losses.append(float(v)), m.loss)
            dev.mark_step()
        else:
            losses.append(float(m.loss))
    return {"losses": losses, "harness": h}


def reference() -> dict:
    import torch

    from nxdt import device as dev

    out = {}
    for name, overrides in (("", []), ("moe_", MOE)):
        cfg = config(1, overrides)
        out[name + "xla"] = train(cfg, dev.xla_device())["losses"]
        out[name + "cpu"] = train(cfg, torch.device("cpu"))["losses"]
    return out


def spmd(names: list[str], ptype: str = "fp32") -> dict:
    from nxdt import device as dev
    from nxdt.parallel import xla_spmd
    from nxdt.parallel.plan import make_plan
    from nxdt.planner import estimate
    from nxdt.spec import build_spec

    xla_spmd.use_spmd()
    out = {"devices": xla_spmd.device_count()}
    for name in names:
        devices, overrides = LAYOUTS[name]
        cfg = config(devices, overrides, ptype)
        spec = build_spec(cfg)
        mesh = xla_spmd.build_mesh(xla_spmd.mesh_shape(spec.layout))
        held = {}

        def parallelize(model):
            held["shardings"] = xla_spmd.spmd_shardings(model, make_plan(model, spec),
                                                        zero1=bool(cfg.distributed_strategy.zero1))
            return xla_spmd.shard_model(model, mesh, held["shardings"])

        def after_build(h):
            xla_spmd.shard_optimizer_state(h.optimizer, h.model, mesh, held["shardings"])

        run = train(cfg, dev.xla_device(), parallelize, lambda b: xla_spmd.shard_batch(b, mesh), after_build)
        h = run["harness"]
        out[name] = {"losses": run["losses"], "mesh": list(xla_spmd.mesh_shape(spec.layout)),
                     "param_bytes": xla_spmd.device_bytes(h.model.parameters()),
                     "state_bytes": xla_spmd.optimizer_state_bytes(h.optimizer),
                     "plan_params_per_device": estimate.plan(spec, vocab_size=VOCAB)["parameters_per_rank"],
                     "by_param": {n: xla_spmd.device_bytes([p]) for n, p in h.model.named_parameters()},
                     "whole": {n: p.numel() * p.element_size() for n, p in h.model.named_parameters()},
                     "param_shardings": {n: xla_spmd.sharding_of(p) for n, p in h.model.named_parameters()}}
    return out


def checkpoint(path: str) -> dict:
    """tp2 + sp x FSDP2 (the norm weights dp-sharded and tp-replicated): 3 steps, save (DCP, the SPMD
    planner), 3 more; a fresh model + optimizer loads the checkpoint and runs the same 3 steps; a plain
    CPU model loads the checkpoint's weights."""
    import torch
    import torch.distributed.checkpoint as dcp

    from nxdt import device as dev
    from nxdt.models import build_model
    from nxdt.parallel import xla_spmd
    from nxdt.parallel.plan import make_plan
    from nxdt.spec import build_spec

    xla_spmd.use_spmd()
    cfg = config(*LAYOUTS["tp2_sp_fsdp2"])
    spec = build_spec(cfg)
    mesh = xla_spmd.build_mesh(xla_spmd.mesh_shape(spec.layout))
    held = {}

    def parallelize(model):
        held["shardings"] = xla_spmd.spmd_shardings(model, make_plan(model, spec))
        return xla_spmd.shard_model(model, mesh, held["shardings"])

    def after_build(h):
        xla_spmd.shard_optimizer_state(h.optimizer, h.model, mesh, held["shardings"])

    def shard(b):
        return xla_spmd.shard_batch(b, mesh)

    first = train(cfg, dev.xla_device(), parallelize, shard, after_build, steps=3)
    h = first["harness"]
    xla_spmd.save_checkpoint({"model": h.model.state_dict(), "optimizer": h.optimizer.state_dict()}, path)
    saved = {k: v.cpu().clone() for k, v in h.model.state_dict().items()}
    shardings_saved = {n: xla_spmd.sharding_of(p) for n, p in h.model.named_parameters()}
    cont = train(cfg, dev.xla_device(), shard_batch=shard, steps=3, first=3, harness=h)["losses"]
    fresh = train(cfg, dev.xla_device(), parallelize, shard, after_build, steps=0)["harness"]
    with torch.no_grad():  # other weights: the load must overwrite all of them
        for p in fresh.model.parameters():
            p.mul_(0.5)
    dev.mark_step()
    xla_spmd.load_checkpoint(fresh.model, fresh.optimizer, path)
    dev.mark_step()
    loaded_equal = all(torch.equal(saved[k], v.cpu()) for k, v in fresh.model.state_dict().items())
    shardings_loaded = {n: xla_spmd.sharding_of(p) for n, p in fresh.model.named_parameters()}
    resumed = train(cfg, dev.xla_device(), shard_batch=shard, steps=3, first=3, harness=fresh)["losses"]
    cpu_model = build_model(cfg, VOCAB)
    cpu_state = {"model": cpu_model.state_dict()}
    dcp.load(cpu_state, checkpoint_id=path)  # the default planner: a CPU run of another layout
    cpu_gap = max(float((cpu_state["model"][k] - saved[k]).abs().max()) for k in saved)
    # and back: the CPU run (one process, another layout) saves its weights; the fsdp4 model loads them
    dcp.save({"model": cpu_model.state_dict()}, checkpoint_id=path + "-cpu", no_dist=True)
    back = train(cfg, dev.xla_device(), parallelize, shard, after_build, steps=0)["harness"]
    xla_spmd.load_checkpoint(back.model, None, path + "-cpu")
    dev.mark_step()
    back_gap = max(float((v.cpu() - saved[k]).abs().max()) for k, v in back.model.state_dict().items())
    back_kept = {n: xla_spmd.sharding_of(p) for n, p in back.model.named_parameters()} == shardings_saved
    return {"first": first["losses"], "continued": cont, "resumed": resumed, "loaded_equal": loaded_equal,
            "shardings_kept": shardings_saved == shardings_loaded, "cpu_gap": cpu_gap, "back_gap": back_gap,
            "back_shardings_kept": back_kept,
            "partial": sum("last_tile_dim_replicate" in s for s in shardings_saved.values())}


if __name__ == "__main__":
    mode, names = sys.argv[1], sys.argv[2:]
    if mode == "ckpt":
        result = checkpoint(names[0])
    elif mode == "preset":
        from nxdt.config.env import apply_env

        apply_env(config(4, [], names[0]))  # before torch / torch_xla are imported: they read the env vars
        assert "torch" not in sys.modules
        result = spmd(["fsdp4"], names[0])
    else:
        result = reference() if mode == "ref" else spmd(names)
    print("RESULT " + json.dumps(result), flush=True)
