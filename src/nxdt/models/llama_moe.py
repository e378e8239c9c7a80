"""LLaMA-MoE checkpoints (config.json `model_type: llama_moe`) as nxdt's native model: the model keys
from their config.json, their tensors in nxdt's names. What nxdt does not build is refused in one
line (ValueError) before anything is written.

From pjlab-sys4nlp/llama-moe at b17aff43: smoe/models/llama_moe/configuration_llama_moe.py
(LlamaMoEConfig) and modeling_llama_moe.py (LlamaMoEDecoderLayer: transformers' Llama with
`mlp = LinearGLUMoELayer(bias=False)` in every layer), smoe/modules/moe/moe_layers.py,
moe_gates.py (get_gate_network, TopKBalancedNoisyGate), moe_calculators.py (UniversalCalculator),
moe_experts.py (LinearGLUExperts). Their parameter names, per layer i and expert e:

    mlp.gate.gate_network.weight                 [E, H]   gate_network linear
    mlp.gate.gate_network.0.weight / .2.weight   [E, H] / [E, E]   gate_network mlp (Linear, Tanh, Linear)
    mlp.gate.weight_noise.weight                 [E, H]   gate_add_noise
    mlp.calculator.experts.weight_gate.e / weight_up.e   [size_e, H]
    mlp.calculator.experts.weight_down.e                  [H, size_e]

become nxdt's `mlp.gate.weight`, `mlp.gate.weight_out`, `mlp.gate.weight_noise` and the stacked
`mlp.experts.gate_up_proj` [E, 2F, H] (gate rows, then up rows) and `mlp.experts.down_proj` [E, H, F].
Attention, norms, embeddings and head keep transformers' Llama names, as nxdt's.
"""

from __future__ import annotations

import re
from typing import Any

import torch

_GATES = {"TopKBalancedNoisyGate": "top_k_balanced_noisy"}


def _no(what: str) -> ValueError:
    return ValueError(f"{what}: not supported yet")


def _expert_width(hf: dict[str, Any]) -> int:
    """Each expert's width: intermediate_size / num_experts (LinearGLUExperts' even split); unequal
    size_experts are refused."""
    experts, ffn = int(hf["num_experts"]), int(hf["intermediate_size"])
    if ffn % experts:
        raise ValueError(f"intermediate_size {ffn} is not divisible by num_experts {experts} (LLaMA-MoE asserts it)")
    width = ffn // experts
    for i, sizes in enumerate(hf.get("size_experts") or []):
        if list(sizes) != [width] * experts:
            raise _no(f"size_experts of layer {i} = {list(sizes)} (unequal experts; nxdt's are {width} wide each)")
    return width


def _checks(hf: dict[str, Any]) -> None:
    """The LLaMA-MoE settings nxdt does not build, refused (first one found)."""
    plain = {"hidden_act": "silu", "attention_bias": False, "rope_scaling": None, "gate_use_softmax": True,
             "calculator_type": "UniversalCalculator", "multiply_gate_scores": True, "add_weight_norm": False}
    for key, want in plain.items():
        if hf.get(key, want) != want:
            raise _no(f"{key}={hf[key]!r} (nxdt builds {key}={want!r})")
    if hf.get("gate_type", "TopKBalancedNoisyGate") not in _GATES:
        raise _no(f"gate_type={hf['gate_type']!r} (nxdt converts TopKBalancedNoisyGate checkpoints; its "
                  f"switch_balanced gate weighs by the softmax probability where SwitchBalancedGate weighs by the logit)")
    if hf.get("gate_network", "mlp").lower() not in ("linear", "mlp"):
        raise ValueError(f"gate_network={hf['gate_network']!r}: LLaMA-MoE has linear and mlp")


def llama_moe_model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """nxdt's `model:` keys (model_source megatron) of a LLaMA-MoE config.json."""
    _checks(hf)
    scale = hf.get("score_scale_factor", 1.0)
    if isinstance(scale, list):
        if len(set(scale)) != 1:
            raise _no(f"score_scale_factor per layer {scale}")
        scale = scale[0]
    heads = int(hf["num_attention_heads"])
    balance = hf.get("gate_use_balance", True)
    return {
        "num_layers": int(hf["num_hidden_layers"]), "hidden_size": int(hf["hidden_size"]),
        "ffn_hidden_size": int(hf["intermediate_size"]), "num_attention_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads), "vocab_size": int(hf["vocab_size"]),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
        "normalization": "rmsnorm", "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(hf.get("rope_theta", 10000.0)), "activation": "swiglu", "has_bias": False,
        "position_embedding_type": "rope", "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "moe": {
            "num_experts": int(hf["num_experts"]), "top_k": int(hf.get("num_selects", 4)), "frequency": 1,
            "ffn_hidden_size": _expert_width(hf), "gate_type": _GATES[hf.get("gate_type", "TopKBalancedNoisyGate")],
            "gate_network": hf.get("gate_network", "mlp").lower(), "gate_add_noise": bool(hf.get("gate_add_noise", True)),
            "gate_noise_epsilon": float(hf.get("gate_noise_epsilon", 1e-2)),
            "gate_balance_loss_weight": float(hf.get("gate_balance_loss_weight", 1e-2)) if balance else 0.0,
            "moe_calculator_score_scale_factor": float(scale),
        },
    }


_MLP = re.compile(r"(model\.layers\.\d+\.mlp)\.(.+)")
_GATE_NAMES = {"gate.gate_network.weight": "gate.weight", "gate.gate_network.0.weight": "gate.weight",
               "gate.gate_network.2.weight": "gate.weight_out", "gate.weight_noise.weight": "gate.weight_noise"}
_EXPERT = re.compile(r"calculator\.experts\.weight_(gate|up|down)\.(\d+)")


def llama_moe_to_native(tensors: dict[str, torch.Tensor], hf: dict[str, Any]) -> dict[str, torch.Tensor]:
    """LLaMA-MoE's tensors in nxdt's names (module docstring); any other MoE tensor is refused."""
    experts_n, add_noise = int(hf["num_experts"]), bool(hf.get("gate_add_noise", True))
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _MLP.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        layer, local = m.groups()
        if local in _GATE_NAMES:
            if local != "gate.weight_noise.weight" or add_noise:
                out[f"{layer}.{_GATE_NAMES[local]}"] = t
            continue
        e = _EXPERT.fullmatch(local)
        if e is None:
            raise ValueError(f"tensor {name}: not a LLaMA-MoE tensor nxdt reads")
        experts.setdefault(layer, {}).setdefault(e.group(1), {})[int(e.group(2))] = t
    for layer, parts in experts.items():
        if any(sorted(parts.get(p, {})) != list(range(experts_n)) for p in ("gate", "up", "down")):
            raise ValueError(f"{layer}: expected weight_gate/up/down.0..{experts_n - 1} of its {experts_n} experts")
        out[f"{layer}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate"][i], parts["up"][i]]) for i in range(experts_n)])
        out[f"{layer}.experts.down_proj"] = torch.stack([parts["down"][i] for i in range(experts_n)])
    return out


# --------------------------------------------------------------------------- LLaMA-MoE's gates (moe.py's router calls them)


def cv_squared(x: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Squared coefficient of variation var(x) / (mean(x)^2 + eps), as LLaMA-MoE's cv_squared:
    torch's var, i.e. the unbiased (n - 1) variance, and eps in the denominator only; 0 for one
    expert (their guard: the unbiased variance of one value is nan)."""
    x = x.float()
    if x.numel() == 1:
        return x.new_zeros(())
    return x.var() / (x.mean() ** 2 + eps)


def noisy_top_k_gate(clean: torch.Tensor, top_k: int, noise_std: torch.Tensor | None = None,
                     z: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LLaMA-MoE's TopKBalancedNoisyGate (Shazeer et al. 2017) on gate logits [T, E] → (weights
    [T, k] fp32, experts [T, k], balance loss CV²(importance) + CV²(load), unweighted).

    noisy = clean + z x noise_std (z ~ N(0, 1) [T, E]; no noise when noise_std is None). The k
    best noisy logits are chosen and their weights are the softmax over those k logits only.
    importance_e = sum over tokens of e's weight (0 where not chosen). load_e, with noise, is the
    smooth count sum_t P(e in the top k of token t) = Phi((clean - threshold) / noise_std), the
    threshold being the best noisy logit among the other experts that still keeps e out: the
    (k+1)-th noisy logit when e is in the top k, the k-th when it is not; without noise (and when
    k = E) load_e is the number of tokens that chose e."""
    clean = clean.float()
    num_experts = clean.shape[-1]
    noisy = clean if noise_std is None else clean + z * noise_std
    top_vals, top_idx = noisy.topk(min(top_k + 1, num_experts), dim=-1)
    weights, experts = torch.softmax(top_vals[:, :top_k], dim=-1), top_idx[:, :top_k]
    importance = torch.zeros_like(clean).scatter(1, experts, weights).sum(0)
    if noise_std is not None and top_k < num_experts:
        threshold_in, threshold_out = top_vals[:, top_k:top_k + 1], top_vals[:, top_k - 1:top_k]
        # "is in the top k" compares the noisy logit, as the paper and its reference code do;
        # LLaMA-MoE's code compares the noise term alone (logits_noise), which we take for a slip
        is_in = noisy > threshold_in
        prob = torch.where(is_in, torch.special.ndtr((clean - threshold_in) / noise_std),  # ndtr: normal CDF
                           torch.special.ndtr((clean - threshold_out) / noise_std))
        load = prob.sum(0)
    else:
        load = torch.bincount(experts.reshape(-1), minlength=num_experts).float()
    return weights, experts, cv_squared(importance) + cv_squared(load)


def switch_gate(logits: torch.Tensor, gumbel: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LLaMA-MoE's SwitchBalancedGate (Switch Transformer) on logits [T, E] → (weights [T, 1] fp32,
    experts [T, 1], balance loss, unweighted): p = softmax(logits); the expert is the argmax of
    logits + gumbel (Gumbel(0, 1) noise, or none); loss = E x sum_e mean_t(p_e) x (tokens that
    chose e) / T, no gradient through the counts. The weight is the chosen expert's p (the Switch
    Transformer's), where LLaMA-MoE's code returns the chosen (noisy) logit itself."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    experts = (logits if gumbel is None else logits + gumbel).argmax(-1, keepdim=True)
    num_tokens, num_experts = logits.shape
    load = torch.bincount(experts.reshape(-1), minlength=num_experts).float() / num_tokens
    return probs.gather(-1, experts), experts, num_experts * torch.sum(probs.mean(0) * load)
