"""`nxdt moe-split`: a mixture of experts built from a dense Llama (LLaMA-MoE's expert construction).

    nxdt moe-split --input DENSE --output MOE_CKPT --num-experts E [--method random|clustering]
                   [--seed 0] [--top-k K] [--gate-type mixtral|top_k_balanced_noisy|switch_balanced]
                   [--score-scale S] [--router-init-std 0] [--no-verify]

DENSE is an nxdt checkpoint or a transformers Llama folder (safetensors), read as `nxdt convert`
reads them. Each layer's SwiGLU MLP (F intermediate neurons) becomes E experts of F/E neurons:
neuron j is the row j of gate_proj and up_proj and the column j of down_proj, and a dense MLP is
the sum over its neurons, so splitting the neurons into E disjoint sets splits the MLP into E
experts whose outputs add up to the dense output. `random`: a seeded permutation cut into E equal
parts (LLaMA-MoE's neuron-independent random split); `clustering`: balanced k-means over the
neurons' input weight vectors (gate and up rows side by side), k-means++ seeded, equal sizes.

The output is a weights-only nxdt checkpoint in transformers' Mixtral layout (`mlp.gate.weight`,
`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); everything else is copied. The router is
initialised to zero (LLaMA-MoE's `linear` gate network), or N(0, std) with --router-init-std.
The command prints the overrides that train it (`model.weight_init_only`) with --top-k experts
per token, the --gate-type gate and score scale --score-scale (default E, see below).

The check (on by default, before anything is written): with all E experts selected, a zero
router and score scale E, each MoE layer must reproduce its dense MLP (relative 1e-5). Why E:
nxdt's router gives each expert softmax(0) = 1/E (and renormalising E chosen scores that sum to
1 changes nothing), so the layer computes scale x (1/E) x sum_e expert_e(x) = scale/E x MLP(x).
docs/moe.md relates this to LLaMA-MoE's E/k.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nxdt.checkpoint.checkpointer import load_weights, save_weights
from nxdt.checkpoint.state import META
from nxdt.config.errors import ConfigError
from nxdt.models.moe import GATE_TYPES, LlamaMoE, MoEArgs
from nxdt.tools.hf_folder import copy_tokenizer, read_hf_folder, tokenizer_dir_for

METHODS = ("random", "clustering")
KMEANS_ITERATIONS = 30
CHECK_TOKENS = 16
CHECK_TOLERANCE = 1e-5  # relative to the largest dense output value (and at least absolute)
_MLP = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp)\.gate_proj\.weight$")


# --------------------------------------------------------------------------- reading the dense model
def read_dense(path: Path) -> tuple[dict[str, torch.Tensor], Path | None]:
    """(tensors keyed like the model's state dict, tokenizer folder or None) of an nxdt checkpoint
    (has meta.json) or a transformers folder (has config.json)."""
    if not path.is_dir():
        raise ConfigError(f"--input {path}: no such directory")
    if (path / META).is_file():
        return load_weights(path), tokenizer_dir_for(path)
    if (path / "config.json").is_file():
        return read_hf_folder(path)[1], path
    raise ConfigError(f"--input {path}: neither an nxdt checkpoint ({META}) nor a transformers folder (config.json)")


def mlp_layers(tensors: dict[str, Any], where: Path) -> list[tuple[int, str]]:
    """(layer index, 'model.layers.<i>.mlp') of every dense SwiGLU MLP, in layer order."""
    if any(".mlp.experts." in k for k in tensors):
        raise ConfigError(f"--input {where}: already a mixture of experts (has mlp.experts.* weights)")
    found = sorted((int(m["layer"]), m["prefix"]) for m in map(_MLP.match, tensors) if m)
    if not found:
        raise ConfigError(f"--input {where}: no SwiGLU MLP weights (layers.<i>.mlp.gate_proj.weight); "
                          "moe-split needs a dense Llama")
    for _, prefix in found:
        for name in ("gate_proj", "up_proj", "down_proj"):
            if f"{prefix}.{name}.bias" in tensors:
                raise ConfigError(f"--input {where}: {prefix}.{name}.bias: MLP biases cannot become experts "
                                  "(nxdt's experts have none, as in Mixtral)")
            if f"{prefix}.{name}.weight" not in tensors:
                raise ConfigError(f"--input {where}: {prefix}.{name}.weight is missing")
    return found


# --------------------------------------------------------------------------- splitting the neurons
def _generator(seed: int, layer: int, stream: int) -> torch.Generator:
    # one stream per (layer, purpose): a layer's split does not depend on the layers before it
    return torch.Generator().manual_seed((seed * 1_000_003 + layer) * 4 + stream)


def random_split(num_neurons: int, num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """[E, F/E] neuron indices: a seeded permutation cut into E equal parts (sorted within a part)."""
    perm = torch.randperm(num_neurons, generator=generator)
    return perm.view(num_experts, -1).sort(dim=1).values


def balanced_assign(dist: torch.Tensor, capacity: int) -> torch.Tensor:
    """Labels [N] for distances [N, E] with exactly `capacity` points per cluster (N = E x capacity).

    Rounds of proposals: every unplaced point proposes to its nearest cluster with room; a cluster
    keeps its closest proposers up to its room. Every round places someone or fills a cluster, so
    at most E + 1 rounds; ties go to the lower index (argmin, stable sort): deterministic."""
    num_experts = dist.shape[1]
    labels = torch.full((dist.shape[0],), -1, dtype=torch.long)
    room = torch.full((num_experts,), capacity, dtype=torch.long)
    while True:
        free = (labels < 0).nonzero().squeeze(1)
        if free.numel() == 0:
            return labels
        choice = dist[free].masked_fill((room == 0)[None, :], float("inf")).argmin(1)
        for e in (room > 0).nonzero().squeeze(1).tolist():
            proposers = free[choice == e]
            if proposers.numel():
                keep = proposers[torch.sort(dist[proposers, e], stable=True).indices[: int(room[e])]]
                labels[keep] = e
                room[e] -= keep.numel()


def _sq_dist(features: torch.Tensor, sq_norms: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    # |x|^2 - 2 x.c + |c|^2 as one matmul: torch.cdist is ~10x slower at these widths on CPU
    return (sq_norms[:, None] - 2 * features @ centres.t() + (centres * centres).sum(1)[None, :]).clamp_min(0)


def clustering_split(features: torch.Tensor, num_experts: int, generator: torch.Generator,
                     iterations: int = KMEANS_ITERATIONS) -> tuple[torch.Tensor, int]:
    """([E, F/E] neuron indices, k-means iterations run): balanced k-means over `features` [F, D]
    (one row per neuron), k-means++ initialisation drawn from `generator`."""
    n = features.shape[0]
    capacity = n // num_experts
    sq_norms = (features * features).sum(1)
    pick = int(torch.randint(n, (1,), generator=generator))
    picks = [pick]
    closest = _sq_dist(features, sq_norms, features[pick][None]).squeeze(1)
    for _ in range(1, num_experts):  # k-means++: the next centre with probability ~ squared distance
        weights = closest if float(closest.sum()) > 0 else torch.ones(n)
        pick = int(torch.multinomial(weights, 1, generator=generator))
        picks.append(pick)
        closest = torch.minimum(closest, _sq_dist(features, sq_norms, features[pick][None]).squeeze(1))
    centres = features[picks]
    labels = None
    for done in range(1, iterations + 1):
        new = balanced_assign(_sq_dist(features, sq_norms, centres), capacity)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        centres = F.one_hot(labels, num_experts).to(features.dtype).t() @ features / capacity  # cluster means
    groups = torch.stack([(labels == e).nonzero().squeeze(1) for e in range(num_experts)])
    return groups, done


def split_neurons(gate: torch.Tensor, up: torch.Tensor, num_experts: int, method: str,
                  generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """([E, F/E] neuron indices, a word on how) for one MLP's gate_proj / up_proj weights [F, H]."""
    if method == "random":
        return random_split(gate.shape[0], num_experts, generator), "random"
    groups, iterations = clustering_split(torch.cat([gate, up], dim=1).float(), num_experts, generator)
    return groups, f"k-means {iterations} it"


def expert_weights(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                   groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's expert tensors from a dense MLP: gate_up_proj [E, 2F', H] (expert e's gate rows,
    then its up rows) and down_proj [E, H, F'] (its columns of down_proj)."""
    gate_up = torch.cat([gate[groups], up[groups]], dim=1)
    return gate_up.contiguous(), down[:, groups].permute(1, 0, 2).contiguous()


# --------------------------------------------------------------------------- the exactness check
class SplitCheckError(RuntimeError):
    """The experts of a layer do not add up to its dense MLP (a bug, not bad input: exit 1)."""


def identity_score_scale(num_experts: int) -> float:
    """The score scale that makes an all-selected, zero-router MoE layer equal its dense MLP:
    nxdt's softmax router gives each of the E experts 1/E (renormalising the E chosen scores,
    which already sum to 1, keeps 1/E), so the layer is scale/E x the sum of the experts."""
    return float(num_experts)


def check_layer(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, gate_up: torch.Tensor,
                expert_down: torch.Tensor, score_scale: float | None = None, seed: int = 0) -> tuple[float, float]:
    """(max |MoE - dense|, max |dense|) over CHECK_TOKENS random inputs: nxdt's own MoE layer with
    every expert selected, a zero router and `score_scale` (default: identity_score_scale)
    against the dense SwiGLU MLP, both in fp32 from the same weights."""
    num_experts, hidden = gate_up.shape[0], gate_up.shape[2]
    scale = identity_score_scale(num_experts) if score_scale is None else score_scale
    layer = LlamaMoE(hidden, gate_up.shape[1] // 2, MoEArgs(num_experts=num_experts, top_k=num_experts,
                                                             score_scale=scale)).eval()
    x = torch.randn(CHECK_TOKENS, hidden, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for p in layer.parameters():
            p.zero_()  # the router (and whatever else the gate holds) at zero: the uniform gate
        layer.experts.gate_up_proj.copy_(gate_up.float())
        layer.experts.down_proj.copy_(expert_down.float())
        dense = F.linear(F.silu(F.linear(x, gate.float())) * F.linear(x, up.float()), down.float())
        moe = layer(x)
    return float((moe - dense).abs().max()), float(dense.abs().max())


# --------------------------------------------------------------------------- the whole model
def gate_shapes(hidden: int, expert_size: int, num_experts: int, top_k: int, gate_type: str) -> dict[str, tuple]:
    """{name under mlp.gate: shape} of the router nxdt builds for this gate (LLaMA-MoE's noisy
    top-k gate adds a noise weight): taken from the MoE layer itself, on the meta device."""
    with torch.device("meta"):
        layer = LlamaMoE(hidden, expert_size, MoEArgs(num_experts=num_experts, top_k=top_k, gate_type=gate_type))
    return {name: tuple(p.shape) for name, p in layer.gate.named_parameters()}


def split_model(tensors: dict[str, torch.Tensor], layers: list[tuple[int, str]], num_experts: int, method: str,
                seed: int, router_init_std: float, verify: bool, gate_params: dict[str, tuple] | None = None,
                log=print) -> dict[str, torch.Tensor]:
    """The MoE model's tensors (`tensors` is consumed: each dense MLP is dropped once split).
    `gate_params`: the router's parameters (gate_shapes; default: the plain `weight`); the router weight
    is zero or N(0, router_init_std), any other gate parameter zero (LLaMA-MoE zeroes its noise
    weight). Raises SplitCheckError when the check fails (nothing is written then)."""
    out = {}
    for n, (layer, prefix) in enumerate(layers, 1):
        t0 = time.perf_counter()
        gate, up, down = (tensors.pop(f"{prefix}.{name}.weight") for name in ("gate_proj", "up_proj", "down_proj"))
        groups, how = split_neurons(gate, up, num_experts, method, _generator(seed, layer, 0))
        gate_up, expert_down = expert_weights(gate, up, down, groups)
        for name, shape in (gate_params or {"weight": (num_experts, gate.shape[1])}).items():
            out[f"{prefix}.gate.{name}"] = torch.zeros(shape, dtype=gate.dtype)
        if router_init_std > 0:
            noise = torch.randn(num_experts, gate.shape[1], generator=_generator(seed, layer, 1))
            out[f"{prefix}.gate.weight"].copy_(noise * router_init_std)
        out.update({f"{prefix}.experts.gate_up_proj": gate_up, f"{prefix}.experts.down_proj": expert_down})
        note = ""
        if verify:
            err, size = check_layer(gate, up, down, gate_up, expert_down, seed=layer)
            if err > CHECK_TOLERANCE * max(1.0, size):
                raise SplitCheckError(f"{prefix}: the experts do not add up to the dense MLP (max difference "
                                      f"{err:.3g} for outputs up to {size:.3g}); nothing written")
            note = f", check {err:.1e}"
        log(f"layer {layer} ({n}/{len(layers)}): {gate.shape[0]} neurons -> {num_experts} x {groups.shape[1]} "
            f"({how}{note}) {time.perf_counter() - t0:.1f}s")
    out.update(tensors)
    return out


def train_overrides(output: Path, num_experts: int, top_k: int, expert_size: int, score_scale: float,
                    gate_type: str) -> list[str]:
    """The `key=value` overrides that train the split checkpoint over the dense model's config."""
    if gate_type == "mixtral":
        gate = ["model.moe.routing_algorithm=top_k", "model.moe.router_activation=softmax",
                "model.moe.normalize_top_k_affinities=true"]
    else:  # LLaMA-MoE's gates bring their own routing (the mixtral keys stay at their defaults)
        gate = [f"model.moe.gate_type={gate_type}", "model.moe.gate_add_noise=true"]
    return [f"model.ffn_hidden_size={expert_size}", f"model.moe.num_experts={num_experts}",
            f"model.moe.num_selects={top_k}", "model.moe.frequency=1", *gate,
            f"model.moe.moe_calculator_score_scale_factor={score_scale}",
            f"exp_manager.resume_from_checkpoint={output.resolve()}", "model.weight_init_only=true"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nxdt moe-split", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, type=Path, help="dense nxdt checkpoint or transformers Llama folder")
    parser.add_argument("--output", required=True, type=Path, help="new nxdt checkpoint (must not exist)")
    parser.add_argument("--num-experts", required=True, type=int,
                        help="E: experts per layer (must divide ffn_hidden_size)")
    parser.add_argument("--method", choices=METHODS, default="random", help="how neurons are grouped (default random)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the permutation / k-means++ (default 0)")
    parser.add_argument("--top-k", type=int, default=2,
                        help="experts per token in the printed overrides (default 2; E = the dense model exactly)")
    parser.add_argument("--router-init-std", type=float, default=0.0,
                        help="router weights ~ N(0, std); 0 (default) = zeros, LLaMA-MoE's linear gate")
    parser.add_argument("--gate-type", choices=GATE_TYPES, default="mixtral",
                        help="the gate to train with (default mixtral); top_k_balanced_noisy also gets its noise "
                             "weight, zero")
    parser.add_argument("--score-scale", type=float, default=None,
                        help="moe_calculator_score_scale_factor to print (default E: a uniform gate then reproduces "
                             "the dense MLP; LLaMA-MoE uses E/k, see docs/moe.md)")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="check every layer against its dense MLP before writing (default on)")
    args = parser.parse_args(argv)
    E = args.num_experts
    if E < 1:
        raise ConfigError(f"--num-experts: must be >= 1, got {E}")
    if not 1 <= args.top_k <= E:
        raise ConfigError(f"--top-k: must be between 1 and --num-experts ({E}), got {args.top_k}")
    if not 0 <= args.seed < 2**31:
        raise ConfigError(f"--seed: must be between 0 and 2**31 - 1, got {args.seed}")
    if args.router_init_std < 0:
        raise ConfigError(f"--router-init-std: must be >= 0, got {args.router_init_std}")
    if args.gate_type == "switch_balanced" and args.top_k != 1:
        raise ConfigError(f"--gate-type switch_balanced picks one expert per token: needs --top-k 1, got {args.top_k}")
    if args.score_scale is not None and args.score_scale <= 0:
        raise ConfigError(f"--score-scale: must be > 0, got {args.score_scale}")
    if args.output.exists():
        raise ConfigError(f"--output {args.output} exists; choose a new path (nothing is overwritten)")

    tensors, tokenizer = read_dense(args.input)
    layers = mlp_layers(tensors, args.input)
    ffn = tensors[f"{layers[0][1]}.gate_proj.weight"].shape[0]
    if ffn % E:
        raise ConfigError(f"--num-experts {E} does not divide the MLP width {ffn} (ffn_hidden_size of {args.input}): "
                          "experts must be equal")
    print(f"{args.input}: {len(layers)} MLP layers of {ffn} neurons -> {E} experts of {ffn // E} ({args.method}, "
          f"seed {args.seed})", flush=True)
    gate_params = gate_shapes(tensors[f"{layers[0][1]}.gate_proj.weight"].shape[1], ffn // E, E, args.top_k,
                              args.gate_type)
    try:
        moe = split_model(tensors, layers, E, args.method, args.seed, args.router_init_std, args.verify,
                          gate_params, log=lambda line: print(line, flush=True))
    except SplitCheckError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    scale = identity_score_scale(E) if args.score_scale is None else args.score_scale
    record = {"source": str(args.input), "num_experts": E, "expert_size": ffn // E, "method": args.method,
              "seed": args.seed, "router_init_std": args.router_init_std, "gate_type": args.gate_type,
              "score_scale_for_identity": identity_score_scale(E)}
    save_weights(moe, args.output, {"source": str(args.input), "moe_split": record})
    copy_tokenizer(tokenizer, args.output / "tokenizer")
    router = f"N(0, {args.router_init_std})" if args.router_init_std > 0 else "zero (LLaMA-MoE's linear gate)"
    print(f"wrote {args.output}: router weights {router}")
    print("train it over the dense model's config with:")
    overrides = train_overrides(args.output, E, args.top_k, ffn // E, scale, args.gate_type)
    print("  " + " ".join(shlex.quote(o) for o in overrides))
    return 0
