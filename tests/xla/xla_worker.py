"""Run by tests/xla/test_xla.py in a fresh process per preset (the XLA env vars are read once, at
import): set the preset's env vars, THEN import torch / torch_xla, train a tiny Llama on the XLA
device for a few steps, optionally save and reload an xser checkpoint; print one JSON line."""

from __future__ import annotations

import json
import os
import sys


def main(ptype: str, steps: int, ckpt_dir: str | None) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from nxdt.config.env import apply_env
    from nxdt.spec import load_config

    overrides = [f"precision.type={ptype}"]
    if ptype == "fp16":
        overrides = ["precision.type=fp32", "precision.fp16.enabled=true"]
    cfg = load_config(["--config-name", "tiny_llama_cpu", *MODEL, "trainer.accelerator=xla", "model.optim.lr=3e-3",
                       *overrides], world_size=1, check_paths=False, quiet=True)
    env_before = dict(os.environ)
    apply_env(cfg)  # before torch / torch_xla are imported
    assert "torch" not in sys.modules and "torch_xla" not in sys.modules
    set_vars = {k: os.environ[k] for k in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "NEURON_RT_STOCHASTIC_ROUNDING_EN",
                                           "NEURON_CC_FLAGS") if k in os.environ and k not in env_before}

    import torch

    from nxdt.models import build_model, logits_of
    from nxdt import device as xla
    from nxdt.training.builder import build_harness
    from nxdt.training.loss import masked_token_loss
    from nxdt.optim.optimizers import build_optimizer
    from nxdt.training.step import microbatch_forward_backward, train_step

    device = xla.xla_device()
    h = build_harness(cfg, 256, on_xla=True, device=device)
    model, prec, opt = h.model, h.precision, h.optimizer
    fwd_bwd = microbatch_forward_backward(model, prec, 2, device_type="xla")  # two micro-batches: accumulation
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (4, 4, 17), generator=g)
    for t in range(1, 17):
        data[..., t] = (data[..., t - 1] * 3 + 1) % 256

    def loss_fn(m, mb):
        inputs, labels = mb
        return masked_token_loss(logits_of(m(input_ids=inputs)), labels, torch.ones_like(labels, dtype=torch.float32))

    losses: list[float] = []
    loss_mask = torch.ones(4, 16, device=device)
    for step in range(steps):
        b = data[step % len(data)].to(device)
        batch = {"input_ids": b[:, :-1], "labels": b[:, 1:], "loss_mask": loss_mask}
        m = train_step(model, opt, None, prec, fwd_bwd, batch, step=step, clip=1.0)
        xla.in_step_closure(lambda v: losses.append(float(v)), m.loss)  # logged after the graph ran
        xla.mark_step()
    out = {"ptype": ptype, "losses": losses, "env": set_vars, "param_dtype": str(next(model.parameters()).dtype),
           "device": str(device)}
    if ckpt_dir:
        path = os.path.join(ckpt_dir, "model.xser")
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "precision": prec.state_dict()}
        xla.save_xser(state, path)
        loaded = xla.load_xser(path)
        fresh = build_model(cfg, 256)
        fresh.load_state_dict(loaded["model"])
        fresh = fresh.to(device)
        same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(model.state_dict().values(),
                                                                fresh.state_dict().values()))
        opt2 = build_optimizer(fresh, cfg.model.optim)
        opt2.load_state_dict(loaded["optimizer"])
        b = data[0].to(device)
        with torch.no_grad():
            l1 = loss_fn(model, (b[:, :-1], b[:, 1:]))
            l2 = loss_fn(fresh, (b[:, :-1], b[:, 1:]))
        out.update(ckpt_equal=same, ckpt_files=sorted(os.listdir(ckpt_dir)), loss_before=float(l1),
                   loss_after_load=float(l2), opt_state_len=len(opt2.state_dict()["state"]))
    print("RESULT " + json.dumps(out), flush=True)


MODEL = ["model.num_layers=1", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
         "model.num_kv_heads=2", "model.max_position_embeddings=64", "model.encoder_seq_length=16",
         "data.seq_length=16", "trainer.devices=1", "model.optim.sched.warmup_steps=5"]

if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
