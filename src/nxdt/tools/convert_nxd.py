"""`nxdt convert nxd-to-nxdt`: a checkpoint NxDT wrote (NxD's trainer layout) → an nxdt checkpoint.

    nxdt convert nxd-to-nxdt --input NXDT_CKPT --output CKPT --config NXDT_YAML [KEY=VALUE ...]
    (alias: nxdt-legacy-to-nxdt)

NXDT_CKPT: the tag folder (`...--step=5-consumed_samples=160.0.ckpt`), its `model/` folder, or the
checkpoint dir (its newest completed tag). NXDT_YAML: the YAML the run trained with, composed and
schema-checked by nxdt's own config loading: it gives the architecture (model.model_config's config.json with the
YAML's overrides; with model_source megatron the YAML's model keys), tp, pp, ep and
`distributed_strategy.kv_replicator`; KEY=VALUE overrides it as on the training command line (NxDT's YAMLs
name `model.model_config: /home/ubuntu/config.json`). Read, both formats (torch.save and xser): NxDT's
HF-style Llama and Mixtral (nxdt.checkpoint.nxd_legacy) and its megatron-style Llama / Mistral / Mixtral / GPT,
NxD's MoE layer with its per-ep-rank files (nxdt.checkpoint.nxd_legacy_megatron); their shapes are
checked against nxdt's model of the YAML, built on the meta device.

The output is an nxdt checkpoint under transformers' names (megatron-style: the native model's, the
same, with NxDT's padded vocabulary). Where NxDT saved Adam's state (`optim/`: ZeRO-1 shards per dp
rank, or a plain optimizer per tp/pp rank; nxdt.checkpoint.nxd_legacy_optim; both model sources,
dense and MoE, with expert parallelism NxD's NeuronEPZero1Optimizer shards), it carries exp_avg, exp_avg_sq and the step, merged like the weights, and NxDT's step and
consumed_samples (from the tag's name): `exp_manager.resume_from_checkpoint=CKPT` continues the
run there (lr, betas, eps and weight decay from the YAML, lr at its schedule's step). Without
`optim/` files it is weights-only (a line says so): start from it with `exp_manager.resume_from_checkpoint=CKPT
model.weight_init_only=true`. Either exports with `nxdt convert nxdt-to-hf`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from nxdt.checkpoint.checkpointer import save_weights
from nxdt.checkpoint.nxd_legacy import NxdLayout, merge, scan
from nxdt.checkpoint.nxd_legacy_optim import check_ep_layout, check_masters, merge_optimizer, optim_files
from nxdt.checkpoint.state import reseed_state
from nxdt.config.errors import ConfigError
from nxdt.config.load import compose
from nxdt.config.validate import validate
from nxdt.models.builder import llama_args_from_cfg, moe_args_from_cfg
from nxdt.models.hf import HF_OVERRIDES, build_hf_model, load_config_dict
from nxdt.models.hf_export import hf_config_dict
from nxdt.models.llama import NxdtLlamaForCausalLM

COMMAND = "nxd-to-nxdt"
ALIASES = ("nxdt-legacy-to-nxdt",)
LLAMA_TYPES = ("llama", "mistral", "mixtral")
MEGATRON_MODEL = {"normalization": ("rmsnorm", "layernorm"), "activation": ("swiglu", "gelu"),
                  "position_embedding_type": ("rope", "learned_absolute"),
                  "transformer_block_type": ("pre_ln",)}  # NxDT's megatron Llama / Mistral / Mixtral and GPT


def read_yaml(path: Path, overrides: list[str] | None = None):
    """The typed config of an NxDT YAML, composed and schema-checked by nxdt's loader; not the run's
    cross-checks (batch sizes, devices, files): only the model and its layout are read."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    argv = ["--config-path", str(path.resolve().parent), "--config-name", path.stem, *(overrides or [])]
    return validate(compose(argv), check_supported=False)


def layout_of(cfg) -> tuple[NxdLayout, dict[str, Any]]:
    """The layout NxDT trained with and the model's config.json (with the YAML's overrides; {} for
    model_source megatron, whose architecture is the YAML's model keys)."""
    if cfg.model_source == "megatron":
        return megatron_layout_of(cfg), {}
    if not cfg.model.model_config:
        raise ConfigError("model.model_config: needed (the config.json of the model the checkpoint holds)")
    try:
        hf = load_config_dict(cfg.model.model_config, {k: getattr(cfg.model, k) for k in HF_OVERRIDES})
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.model_config: {err}") from None
    if hf.get("model_type") not in LLAMA_TYPES:
        raise ConfigError(f"model.model_config: model_type {hf.get('model_type')!r}; only Llama and Mixtral "
                          f"checkpoints ({', '.join(LLAMA_TYPES)}) are read")
    heads = int(hf["num_attention_heads"])
    ds = cfg.distributed_strategy
    lay = NxdLayout(
        num_layers=int(hf["num_hidden_layers"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads), vocab_size=int(hf["vocab_size"]),
        tp=ds.tensor_model_parallel_size, pp=ds.pipeline_model_parallel_size,
        kv_replicator=ds.kv_replicator or 1, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        ep=ds.expert_model_parallel_size)
    return lay, hf


def megatron_layout_of(cfg) -> NxdLayout:
    """The layout of NxDT's megatron-style model (model_source megatron) from the YAML's model keys."""
    m, ds = cfg.model, cfg.distributed_strategy
    other = {k: getattr(m, k) for k, v in MEGATRON_MODEL.items() if getattr(m, k) not in v}
    if other:
        raise ConfigError("model_source megatron: " + ", ".join(f"model.{k} {v!r}" for k, v in other.items())
                          + "; NxDT's megatron Llama / Mistral / Mixtral and GPT checkpoints are read ("
                          + ", ".join(f"{k} {' or '.join(v)}" for k, v in MEGATRON_MODEL.items()) + ")")
    if m.activation == "swiglu" and m.has_bias:
        raise ConfigError("model_source megatron: model.has_bias true with model.activation swiglu; NxDT's megatron "
                          "checkpoints with biases are read with gelu (megatron_gpt_config)")
    if ds.kv_replicator and ds.kv_replicator > 1:
        raise ConfigError(f"distributed_strategy.kv_replicator {ds.kv_replicator}: NxDT's megatron model does not "
                          "replicate K/V heads (num_kv_heads must split over tp)")
    try:
        args = llama_args_from_cfg(cfg, vocab_size=1)  # the architecture; the vocabulary is the checkpoint's
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None
    kv, tp = args.num_kv_heads or args.num_attention_heads, ds.tensor_model_parallel_size
    if args.num_attention_heads % tp or kv % tp:
        raise ConfigError(f"model: {args.num_attention_heads} heads, {kv} K/V heads do not split over tp {tp} "
                          "(NxDT's megatron model splits both)")
    return NxdLayout(num_layers=args.num_layers, hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
                     num_heads=args.num_attention_heads, num_kv_heads=args.num_kv_heads or args.num_attention_heads,
                     head_dim=args.head_dim, vocab_size=0, tp=ds.tensor_model_parallel_size,
                     pp=ds.pipeline_model_parallel_size, tie_word_embeddings=args.share_embeddings_and_output_weights,
                     style="megatron", ep=ds.expert_model_parallel_size, gated=m.activation == "swiglu")


def model_shapes(cfg, hf: dict[str, Any]):
    """The shapes of nxdt's model for the config, as a function of the merged tensors (megatron: the
    vocabulary is the checkpoint's, padded as NxDT padded it); None for a dense HF-style Llama
    (nxd_legacy.expected_shapes). Built on the meta device: nothing is allocated."""
    if cfg.model_source == "hf" and hf.get("model_type") != "mixtral":
        return None

    def shapes(tensors: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):
            if cfg.model_source == "megatron":
                rows = int(tensors["model.embed_tokens.weight"].shape[0]) if "model.embed_tokens.weight" in tensors else 1
                model = NxdtLlamaForCausalLM(llama_args_from_cfg(cfg, vocab_size=rows))
            else:
                model = build_hf_model(cfg.model.model_config, {k: getattr(cfg.model, k) for k in HF_OVERRIDES},
                                       moe_args_from_cfg(cfg.model.moe))
        return {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    return shapes


def _megatron_meta(cfg, tensors: dict[str, Any]) -> dict[str, Any]:
    """meta.json's hf_config of a converted megatron-style model (export, inference), where
    transformers can express it."""
    try:
        args = llama_args_from_cfg(cfg, vocab_size=int(tensors["model.embed_tokens.weight"].shape[0]))
        return {"hf_config": hf_config_dict(args)}
    except ValueError:
        return {}


def progress_of(tag_name: str) -> dict[str, float]:
    """step and consumed_samples from the tag's name (`<name>--step=S-consumed_samples=C.ckpt`), as
    NxDT's checkpoint callback names it; {} where the name does not say."""
    return {key: float(m.group(1)) for key in ("step", "consumed_samples")
            if (m := re.search(rf"(?:^|[-_]){key}=(\d+(?:\.\d+)?)", tag_name))}


def nxd_to_nxdt(input_path: Path, output: Path, config: Path | None, overrides: list[str] | None = None) -> list[str]:
    """Convert; returns the lines to print (what was read, what was not carried over). `overrides`:
    KEY=VALUE for the YAML, as on the training command line (e.g. model.model_config=...)."""
    if config is None:
        raise ConfigError("--config NXDT_YAML: needed (the YAML the NxDT run trained with: the model's "
                          "architecture, tp, pp and distributed_strategy.kv_replicator)")
    output = Path(output)
    if output.exists():
        raise ConfigError(f"--output {output} exists; choose a new path (nothing is overwritten)")
    cfg = read_yaml(config, overrides)
    lay, hf = layout_of(cfg)
    ckpt = scan(input_path)
    tensors, kv_order = merge(ckpt, lay, model_shapes(cfg, hf))
    progress = progress_of(ckpt.tag.name)
    optimizer, resume = None, {}
    moe = any(".mlp.experts." in k for k in tensors)
    lines = []
    files = optim_files(ckpt)
    if files is not None and ckpt.ep > 1:
        dp = len(next(iter(files.values())))
        if any(f.name.startswith("full_") for f in next(iter(files.values()))):
            raise ConfigError(f"{ckpt.tag / 'optim'}: joined over dp (NxD's convert_zero_checkpoints) with ep {ckpt.ep}: "
                              "the experts' expert-data-parallel shards cannot be told apart there; not read (give the "
                              "dp_rank_XX files, or remove optim/ for a weights-only conversion)")
        check_ep_layout(ckpt.ep, ckpt.tp, ckpt.tp * ckpt.pp * dp, cfg.trainer.lnc,
                        cfg.distributed_strategy.context_parallel_size, ckpt.tag / "optim")
    if files is not None:
        optimizer = merge_optimizer(ckpt, files, lay, bool(cfg.model.do_layer_norm_weight_decay),
                                    None if "/" in kv_order else kv_order, model_shapes(cfg, hf))
        check_masters(optimizer.masters, tensors, ckpt.tag / "optim")
        tensors.update(optimizer.masters)  # fp32 where NxD kept them (the model files' may be bf16)
        resume = _resume_meta(cfg, progress, optimizer.step)
    meta = {**({"hf_config": hf} if hf else _megatron_meta(cfg, tensors)), "source": str(ckpt.tag), **resume,
            "nxd_source": {"tp": ckpt.tp, "pp": ckpt.pp, "ep": ckpt.ep, "style": lay.style, "xser": ckpt.xser,
                           "kv_replicator": lay.kv_replicator,
                           "kv_replication": kv_order if lay.kv_replicator > 1 else None, **progress}}
    rank_state = {"rank": 0, "world_size": 1, "dp_rank": 0, "scalars": {}, "trainer": {},
                  "rng": reseed_state(cfg.seed, resume.get("step", 0))}
    save_weights(tensors, output, meta, files={"rank_00000.json": json.dumps(rank_state)} if resume else None,
                 optimizer_state=optimizer.state if optimizer else None)
    lines.insert(0, f"read {ckpt.tag}: " + ("megatron-style, " if lay.style == "megatron" else "")
                 + f"tp {ckpt.tp} x pp {ckpt.pp}" + (f" x ep {ckpt.ep}" if ckpt.ep > 1 else "")
                 + f", {'xser' if ckpt.xser else 'torch.save'}, {len(tensors)} tensors"
                 + (f", K/V replicated x{lay.kv_replicator} ({kv_order})" if lay.kv_replicator > 1 else "")
                 + (f", {sum(k.endswith('mlp.gate.weight') for k in tensors)} MoE layers" if moe else "")
                 + (", NxDT's " + ", ".join(f"{k} {v:g}" for k, v in progress.items()) if progress else ""))
    if lay.style == "megatron":
        lines.append(f"vocabulary: {tensors['model.embed_tokens.weight'].shape[0]} rows as NxDT padded it; a run "
                     "loading it pads the tokenizer's vocabulary to the same (model.make_vocab_size_divisible_by x tp)")
    if not ckpt.complete:
        lines.append(f"notice: {ckpt.tag} has no `done` marker (NxD writes it last): the save may not have finished")
    if files is None:
        lines.append(f"notice: no optimizer files in {ckpt.tag / 'optim'}: the output is weights-only (Adam's "
                     "moments start fresh)")
        lines.append(f"start training from it: exp_manager.resume_from_checkpoint={output} model.weight_init_only=true")
        return lines
    lines.append(f"optimizer: Adam's exp_avg and exp_avg_sq of {len(optimizer.state) // 3} parameters, step "
                 f"{optimizer.step:g} " + (f"(ZeRO-1 shards over dp {optimizer.dp}"
                                           + (f", the experts' over ep {ckpt.ep} x expert-data-parallel "
                                              f"{optimizer.dp // ckpt.ep}" if ckpt.ep > 1 else "") + ")"
                                           if optimizer.dp > 1 else
                                           "(one file per tp/pp rank)")
                 + (", the weights from its fp32 master copies" if optimizer.masters else "")
                 + f"; resumes at step {resume['step']}, consumed_samples {resume['consumed_samples']}"
                 + ("" if "consumed_samples" in progress else " (step x data.global_batch_size: the tag's name has none)"))
    lines.append(f"continue training from it: exp_manager.resume_from_checkpoint={output} (lr, betas, eps and weight "
                 "decay from the YAML, lr at its schedule's step)")
    return lines


def _resume_meta(cfg, progress: dict[str, float], adam_step: float) -> dict[str, object]:
    """meta.json's entries of a checkpoint that resumes NxDT's run (nxd_legacy_optim.converted_trainer_state)."""
    step = int(progress.get("step", adam_step))
    consumed = int(progress.get("consumed_samples", step * cfg.data.global_batch_size))
    return {"weights_only": False, "converted_from": "nxd", "step": step, "consumed_samples": consumed, "layout": {}}
