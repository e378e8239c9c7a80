"""What nxdt's own optimizers (AdamWFP32OptState, Novograd, Lion, SM3) share: torch's step loop
(closure, every parameter with a dense gradient) and a resume that keeps fp32 state fp32.

Each optimizer writes only its per-parameter update, `update(p, group, state)`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer


class ParameterwiseOptimizer(Optimizer):
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} supports dense gradients only")
                self.update(p, group, self.state[p])
        return loss

    def update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """One parameter's step; `state` is `self.state[p]` (empty on the first step)."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts loaded floating-point state to the parameter's dtype (bf16 would round fp32
        # moments, masters and accumulators); put the fp32 tensors back from the state dict itself.
        saved = {pid: {k: v for k, v in st.items() if k != "step" and torch.is_tensor(v) and v.dtype == torch.float32}
                 for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        saved_ids = (pid for g in state_dict["param_groups"] for pid in g["params"])
        params = (p for g in self.param_groups for p in g["params"])
        for pid, p in zip(saved_ids, params):
            for key, value in saved.get(pid, {}).items():
                self.state[p][key] = value.to(device=p.device, copy=True)
