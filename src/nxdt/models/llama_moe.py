"""LLaMA-MoE checkpoints (config.json `model_type: llama_moe`, or its residual variant
`llama_moe_residual`) as nxdt's native model: the model keys from their config.json, their tensors in
nxdt's names. What nxdt does not build is refused in one line (ValueError) before anything is written.

From pjlab-sys4nlp/llama-moe at b17aff43: smoe/models/llama_moe/configuration_llama_moe.py
(LlamaMoEConfig) and modeling_llama_moe.py (LlamaMoEDecoderLayer: transformers' Llama with
`mlp = LinearGLUMoELayer(bias=False)` in every layer), smoe/models/llama_moe_residual (the same with
`mlp = LinearGLUMoEResidualLayer`: `moe_layer` + `residual_block`), smoe/modules/moe/moe_layers.py,
moe_gates.py (get_gate_network, TopKBalancedNoisyGate, SwitchBalancedGate), moe_calculators.py
(UniversalCalculator, SwitchDropTokenCalculator), moe_experts.py (LinearGLUExperts). Their parameter
names, per layer i and expert e (residual variant: under `mlp.moe_layer.`):

    mlp.gate.gate_network.weight                 [E, H]   gate_network linear
    mlp.gate.gate_network.0.weight / .2.weight   [E, H] / [E, E]   gate_network mlp (Linear, Tanh, Linear)
    mlp.gate.weight_noise.weight                 [E, H]   gate_add_noise
    mlp.calculator.experts.weight_gate.e / weight_up.e   [size_e, H]
    mlp.calculator.experts.weight_down.e                  [H, size_e]
    mlp.calculator.mlp_norm.weight               [1] / [H]   add_weight_norm
    mlp.residual_block.gate.gate_network.weight, mlp.residual_block.calculator.experts.*   residual block

become nxdt's `mlp.gate.weight`, `mlp.gate.weight_out`, `mlp.gate.weight_noise`, the stacked
`mlp.experts.gate_up_proj` [E, 2F, H] (gate rows, then up rows) and `mlp.experts.down_proj` [E, H, F]
(each expert zero-padded to the widest, F), `mlp.weight_norm.weight` and `mlp.residual_block.*`
(nxdt.models.moe_calculators). Attention, norms, embeddings and head keep transformers' Llama names.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from nxdt.models.moe_calculators import CALCULATORS

_GATES = {"TopKBalancedNoisyGate": "top_k_balanced_noisy", "SwitchBalancedGate": "switch_balanced"}
MODEL_TYPES = ("llama_moe", "llama_moe_residual")


def _no(what: str) -> ValueError:
    return ValueError(f"{what}: not supported yet")


def _per_layer(hf: dict[str, Any], key: str, default: float) -> float:
    """A value LLaMA-MoE may give per layer (a list): one value for all layers, else refused."""
    value = hf.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise _no(f"{key} per layer {value}")
        value = value[0]
    return float(value)


def _moe_width(hf: dict[str, Any]) -> int:
    """The experts' total width: intermediate_size (llama_moe_residual: intermediate_size_moe)."""
    return int(hf["intermediate_size_moe"] if hf.get("model_type") == "llama_moe_residual" else hf["intermediate_size"])


def _expert_sizes(hf: dict[str, Any]) -> tuple[int, list[list[int]] | None]:
    """(stored expert width, size_experts per layer or None when all equal): LinearGLUExperts' even split
    of the MoE width, or its size_experts, which must sum to it (LLaMA-MoE asserts both)."""
    experts, ffn = int(hf["num_experts"]), _moe_width(hf)
    rows = hf.get("size_experts")
    if rows is None:
        if ffn % experts:
            raise ValueError(f"MoE width {ffn} is not divisible by num_experts {experts} (LLaMA-MoE asserts it)")
        return ffn // experts, None
    rows = [[int(s) for s in row] for row in rows]
    for i, row in enumerate(rows):
        if len(row) != experts or sum(row) != ffn or min(row) < 1:
            raise ValueError(f"size_experts of layer {i} = {row}: LLaMA-MoE needs {experts} widths summing to {ffn}")
    if len(rows) != int(hf["num_hidden_layers"]):
        raise ValueError(f"size_experts has {len(rows)} layers, the model {hf['num_hidden_layers']}")
    width = max(max(row) for row in rows)
    return width, None if all(row == [width] * experts for row in rows) else rows


def _residual_keys(hf: dict[str, Any], width: int) -> dict[str, Any]:
    """llama_moe_residual's residual block (LinearGLUMoEResidualLayer) as model.moe keys."""
    if hf.get("model_type") != "llama_moe_residual":
        return {}
    if hf.get("use_weighting", False):
        raise _no("use_weighting=True (LLaMA-MoE's own residual layer fails with it: it multiplies the residual "
                  "block's output object by a tensor)")
    n = int(hf.get("num_experts_residual", 2))
    if int(hf["intermediate_size"]) != _moe_width(hf) + int(hf.get("intermediate_size_residual", 0)):
        raise ValueError("intermediate_size != intermediate_size_moe + intermediate_size_residual (LLaMA-MoE asserts it)")
    rwidth = _moe_width(hf) // int(hf["num_experts"])  # the experts' mean width, its default
    if hf.get("size_experts") is not None and hf.get("size_experts_residual") is not None:  # its condition, as written
        rows = {tuple(int(s) for s in row) for row in hf["size_experts_residual"]}
        if len(rows) != 1 or len(set(next(iter(rows)))) != 1 or len(next(iter(rows))) != n:
            raise _no(f"size_experts_residual {hf['size_experts_residual']} (unequal residual experts)")
        rwidth = next(iter(rows))[0]
    return {"num_experts_residual": n, "residual_ffn_hidden_size": rwidth,
            "gate_use_softmax_residual": bool(hf.get("gate_use_softmax_residual", True)),
            "multiply_gate_scores_residual": bool(hf.get("multiply_gate_scores_residual", True)),
            "score_scale_factor_residual": _per_layer(hf, "score_scale_factor_residual", 1.0)}


def _checks(hf: dict[str, Any]) -> None:
    """The LLaMA-MoE settings nxdt does not build, refused (first one found)."""
    plain = {"hidden_act": "silu", "attention_bias": False, "rope_scaling": None}
    for key, want in plain.items():
        if hf.get(key, want) != want:
            raise _no(f"{key}={hf[key]!r} (nxdt builds {key}={want!r})")
    if hf.get("gate_type", "TopKBalancedNoisyGate") not in _GATES:
        raise _no(f"gate_type={hf['gate_type']!r} (nxdt builds {' and '.join(_GATES)})")
    if hf.get("calculator_type", "UniversalCalculator") not in CALCULATORS:
        raise _no(f"calculator_type={hf['calculator_type']!r} (nxdt builds {' and '.join(CALCULATORS)})")
    switch_gate = hf.get("gate_type", "TopKBalancedNoisyGate") == "SwitchBalancedGate"
    if switch_gate and hf.get("calculator_type", "UniversalCalculator") == "UniversalCalculator":
        raise _no("SwitchBalancedGate with UniversalCalculator: LLaMA-MoE's forward fails (the calculator reads "
                  "num_selects from the gate's 1-D expert indices); use SwitchDropTokenCalculator")
    if hf.get("calculator_type") == "SwitchDropTokenCalculator" and int(hf.get("num_selects", 4)) != 1:
        raise _no(f"SwitchDropTokenCalculator with num_selects {hf.get('num_selects', 4)}: LLaMA-MoE's forward fails "
                  f"(one score per token expected)")
    if hf.get("gate_network", "mlp").lower() not in ("linear", "mlp"):
        raise ValueError(f"gate_network={hf['gate_network']!r}: LLaMA-MoE has linear and mlp")


def llama_moe_model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """nxdt's `model:` keys (model_source megatron) of a LLaMA-MoE config.json (llama_moe or llama_moe_residual)."""
    _checks(hf)
    heads = int(hf["num_attention_heads"])
    gate = _GATES[hf.get("gate_type", "TopKBalancedNoisyGate")]
    switch_calc = hf.get("calculator_type", "UniversalCalculator") == "SwitchDropTokenCalculator"
    width, sizes = _expert_sizes(hf)
    residual = hf.get("model_type") == "llama_moe_residual"
    moe = {
        "num_experts": int(hf["num_experts"]), "top_k": int(hf.get("num_selects", 4)), "frequency": 1,
        "ffn_hidden_size": width, "gate_type": gate,
        "gate_network": hf.get("gate_network", "mlp").lower(), "gate_add_noise": bool(hf.get("gate_add_noise", True)),
        "gate_noise_epsilon": float(hf.get("gate_noise_epsilon", 1e-2)),
        "gate_balance_loss_weight": float(hf.get("gate_balance_loss_weight", 1e-2)),
        "gate_use_balance": bool(hf.get("gate_use_balance", True)),
        "gate_use_softmax": bool(hf.get("gate_use_softmax", True)),
        "moe_calculator_score_scale_factor": _per_layer(hf, "score_scale_factor", 1.0),
        "calculator_type": hf.get("calculator_type", "UniversalCalculator"),
        "multiply_gate_scores": bool(hf.get("multiply_gate_scores", True)),
        "add_weight_norm": bool(hf.get("add_weight_norm", False)) and not residual,  # its residual layer ignores it
        "size_experts": sizes, **_residual_keys(hf, width),
    }
    if gate == "switch_balanced":
        moe["switch_gate_weight"] = "logit"  # SwitchBalancedGate weighs by the chosen noisy logit
    if switch_calc:
        moe.update(drop_tokens=bool(hf.get("drop_tokens", True)), dropped_padding=hf.get("dropped_padding", "zero"),
                   capacity_factor=float(hf.get("capacity_factor", 1.25)))
    return {
        "num_layers": int(hf["num_hidden_layers"]), "hidden_size": int(hf["hidden_size"]),
        "ffn_hidden_size": int(hf["intermediate_size"]), "num_attention_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads), "vocab_size": int(hf["vocab_size"]),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
        "normalization": "rmsnorm", "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(hf.get("rope_theta", 10000.0)), "activation": "swiglu", "has_bias": False,
        "position_embedding_type": "rope", "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "moe": moe,
    }


_MLP = re.compile(r"(model\.layers\.(\d+)\.mlp)\.(?:moe_layer\.)?(.+)")
_GATE_NAMES = {"gate.gate_network.weight": "gate.weight", "gate.gate_network.0.weight": "gate.weight",
               "gate.gate_network.2.weight": "gate.weight_out", "gate.weight_noise.weight": "gate.weight_noise",
               "calculator.mlp_norm.weight": "weight_norm.weight",
               "residual_block.gate.gate_network.weight": "residual_block.gate.weight"}
_EXPERT = re.compile(r"(residual_block\.)?calculator\.experts\.weight_(gate|up|down)\.(\d+)")


def _stack(parts: dict[str, dict[int, torch.Tensor]], n: int, width: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert gate / up [size, H] and down [H, size] → gate_up_proj [n, 2 width, H], down_proj [n, H, width],
    each expert zero-padded to `width`."""
    if any(sorted(parts.get(p, {})) != list(range(n)) for p in ("gate", "up", "down")):
        raise ValueError(f"{where}: expected weight_gate/up/down.0..{n - 1} of its {n} experts")

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(width - t.shape[0], t.shape[1])])

    gate_up = torch.stack([torch.cat([rows(parts["gate"][i]), rows(parts["up"][i])]) for i in range(n)])
    down = torch.stack([rows(parts["down"][i].t()).t() for i in range(n)])
    return gate_up, down


def llama_moe_to_native(tensors: dict[str, torch.Tensor], hf: dict[str, Any]) -> dict[str, torch.Tensor]:
    """LLaMA-MoE's tensors in nxdt's names (module docstring); any other MoE tensor is refused."""
    keys = llama_moe_model_keys(hf)["moe"]
    experts_n, add_noise = int(hf["num_experts"]), bool(hf.get("gate_add_noise", True))
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _MLP.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        layer, _, local = m.groups()
        if local in _GATE_NAMES:
            if local != "gate.weight_noise.weight" or add_noise:
                out[f"{layer}.{_GATE_NAMES[local]}"] = t
            continue
        e = _EXPERT.fullmatch(local)
        if e is None:
            raise ValueError(f"tensor {name}: not a LLaMA-MoE tensor nxdt reads")
        experts.setdefault((layer, e.group(1) or ""), {}).setdefault(e.group(2), {})[int(e.group(3))] = t
    for (layer, residual), parts in experts.items():
        if residual:
            out[f"{layer}.residual_block.gate_up_proj"], out[f"{layer}.residual_block.down_proj"] = _stack(
                parts, keys["num_experts_residual"], keys["residual_ffn_hidden_size"], f"{layer}.residual_block")
        else:
            out[f"{layer}.experts.gate_up_proj"], out[f"{layer}.experts.down_proj"] = _stack(
                parts, experts_n, keys["ffn_hidden_size"], layer)
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
                     z: torch.Tensor | None = None, use_softmax: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LLaMA-MoE's TopKBalancedNoisyGate (Shazeer et al. 2017) on gate logits [T, E] → (weights
    [T, k] fp32, experts [T, k], balance loss CV²(importance) + CV²(load), unweighted).

    noisy = clean + z x noise_std (z ~ N(0, 1) [T, E]; no noise when noise_std is None). The k
    best noisy logits are chosen and their weights are the softmax over those k logits only (the
    logits themselves with `use_softmax` false, LLaMA-MoE's gate_use_softmax).
    importance_e = sum over tokens of e's weight (0 where not chosen). load_e, with noise, is the
    smooth count sum_t P(e in the top k of token t) = Phi((clean - threshold) / noise_std), the
    threshold being the best noisy logit among the other experts that still keeps e out: the
    (k+1)-th noisy logit when e is in the top k, the k-th when it is not; without noise (and when
    k = E) load_e is the number of tokens whose weight for e is > 0 (LLaMA-MoE's count: with
    use_softmax false a negative logit is not counted)."""
    clean = clean.float()
    num_experts = clean.shape[-1]
    noisy = clean if noise_std is None else clean + z * noise_std
    top_vals, top_idx = noisy.topk(min(top_k + 1, num_experts), dim=-1)
    weights = torch.softmax(top_vals[:, :top_k], dim=-1) if use_softmax else top_vals[:, :top_k]
    experts = top_idx[:, :top_k]
    chosen = torch.zeros_like(clean).scatter(1, experts, weights)
    importance = chosen.sum(0)
    if noise_std is not None and top_k < num_experts:
        threshold_in, threshold_out = top_vals[:, top_k:top_k + 1], top_vals[:, top_k - 1:top_k]
        # "is in the top k" compares the noisy logit, as the paper and its reference code do;
        # LLaMA-MoE's code compares the noise term alone (logits_noise), which we take for a slip
        is_in = noisy > threshold_in
        prob = torch.where(is_in, torch.special.ndtr((clean - threshold_in) / noise_std),  # ndtr: normal CDF
                           torch.special.ndtr((clean - threshold_out) / noise_std))
        load = prob.sum(0)
    else:
        load = (chosen > 0).sum(0).float()
    return weights, experts, cv_squared(importance) + cv_squared(load)


def switch_gate(logits: torch.Tensor, gumbel: torch.Tensor | None = None, weight: str = "probability",
                use_softmax: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LLaMA-MoE's SwitchBalancedGate (Switch Transformer) on logits [T, E] → (weights [T, 1] fp32,
    experts [T, 1], balance loss, unweighted): p = softmax(logits) (the logits with `use_softmax`
    false); the expert is the argmax of logits + gumbel (Gumbel(0, 1) noise, or none); loss = E x
    sum_e mean_t(p_e) x (tokens that chose e) / T, no gradient through the counts. The weight is the
    chosen expert's p (`weight` 'probability': the Switch Transformer's) or, as LLaMA-MoE's code,
    the chosen noisy logit itself ('logit')."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1) if use_softmax else logits
    noisy = logits if gumbel is None else logits + gumbel
    experts = noisy.argmax(-1, keepdim=True)
    num_tokens, num_experts = logits.shape
    load = torch.bincount(experts.reshape(-1), minlength=num_experts).float() / num_tokens
    chosen = noisy.gather(-1, experts) if weight == "logit" else torch.softmax(logits, -1).gather(-1, experts)
    return chosen, experts, num_experts * torch.sum(probs.mean(0) * load)


def switch_route(logits: torch.Tensor, args: Any, training: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The switch gate of MoE layer arguments `args` (nxdt.models.moe.MoEArgs). Its Gumbel noise
    (gate_add_noise): by default in training only, from -log(Exp(1)); with switch_gate_weight
    'logit' (LLaMA-MoE's SwitchBalancedGate) as its code draws it, deepspeed's gumbel_rsample
    (torch's Gumbel(0, 1).rsample), in evaluation too."""
    opts = args.llama_moe
    weight = "probability" if opts is None else opts.switch_gate_weight
    gumbel = None
    if weight == "logit" and args.gate_add_noise:
        zero = torch.zeros((), device=logits.device)
        gumbel = torch.distributions.Gumbel(zero, zero + 1.0).rsample(logits.shape).to(logits).float()
    elif training and args.gate_add_noise:  # -log(Exp(1)) ~ Gumbel(0, 1)
        gumbel = -torch.empty_like(logits, dtype=torch.float32).exponential_().log()
    return switch_gate(logits, gumbel, weight, opts is None or opts.gate_use_softmax)
