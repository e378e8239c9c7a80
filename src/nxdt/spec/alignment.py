"""Fine-tuning strategies: which of SFT, LoRA, DPO, ORPO and GRPO a config asks for, read in one place.

The keys live in the schema (`SFTConfig`, `PeftConfig`, `DPOConfig`, `ORPOConfig`); NxDT spells
them in two places: `model_alignment_strategy.{sft, peft, dpo, orpo}` and, in its DPO config,
`data.alignment_strategy.dpo`. `alignment_of(cfg)` merges the two into one `Alignment`, which
validation checks (`check_alignment`) and the run reads (data module, LoRA, loss): a strategy is
on when its section is present.

    sft            {input, output} rows, the usual token loss on the output
    dpo / orpo     {prompt, chosen, rejected} rows, a preference loss; one of the two at most
    grpo           {prompt, ...} rows, completions sampled in the trainer and scored by reward
                   functions (online RL, TRL's GRPO); alone, or with peft
    peft           LoRA adapters on a frozen base; combines with any of the above, or with
                   pre-training data alone (continual pre-training with LoRA, LLaMA-MoE's lora.sh)

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from nxdt.config.errors import ConfigError
from nxdt.config.schema import DPOConfig, ORPOConfig, PeftConfig, SFTConfig
from nxdt.config.schema_sections import GRPOConfig


@dataclass(frozen=True)
class Alignment:
    sft: Optional[SFTConfig] = None
    peft: Optional[PeftConfig] = None
    dpo: Optional[DPOConfig] = None
    orpo: Optional[ORPOConfig] = None
    grpo: Optional[GRPOConfig] = None
    dpo_key: str = "model_alignment_strategy.dpo"  # where the DPO block was given (for messages)
    dpo_prompt_length: Optional[int] = None
    """DPO's max prompt length, from either of its names (max_prompt_length, NxDT 2.23+, or
    max_dpo_prompt_length); None: up to data.seq_length - 1."""
    dpo_prompt_length_key: str = "model_alignment_strategy.dpo.max_dpo_prompt_length"
    """The key that gave it (for messages)."""

    @property
    def preference(self) -> Optional[str]:
        """'dpo' | 'orpo' | None: the preference loss (and data) the run uses."""
        return "dpo" if self.dpo is not None else "orpo" if self.orpo is not None else None

    @property
    def lora(self) -> bool:
        return self.peft is not None


def alignment_of(cfg: Any) -> Alignment:
    """The strategies of a typed config (NxdtConfig), from both places NxDT puts them."""
    mas = cfg.model_alignment_strategy
    data_side = cfg.data.alignment_strategy
    found: dict[str, Any] = {}
    if mas is not None:
        found.update({f.name: getattr(mas, f.name) for f in dataclasses.fields(mas)})
    dpo_key = "model_alignment_strategy.dpo"
    if data_side is not None:
        for name in ("dpo", "orpo"):
            value = getattr(data_side, name)
            if value is None:
                continue
            if found.get(name) is not None and found[name] != value:
                raise ConfigError(f"data.alignment_strategy.{name} and model_alignment_strategy.{name} are both set "
                                  "and differ: give the block in one place")
            found[name] = value
            if name == "dpo":
                dpo_key = "data.alignment_strategy.dpo"
    dpo = found.get("dpo")
    length, length_key = _dpo_prompt_length(dpo, dpo_key) if dpo is not None else (None, "")
    peft = found.get("peft")
    if peft is not None:  # modules_to_save resolved once: a list of names (LLaMA-MoE's comma string split)
        peft = dataclasses.replace(peft, modules_to_save=modules_to_save_of(peft.modules_to_save))
    return Alignment(sft=found.get("sft"), peft=peft, dpo=dpo, orpo=found.get("orpo"),
                     grpo=found.get("grpo"),
                     dpo_key=dpo_key, dpo_prompt_length=length,
                     dpo_prompt_length_key=length_key or f"{dpo_key}.max_dpo_prompt_length")


def modules_to_save_of(value: Any) -> list[str]:
    """`model_alignment_strategy.peft.modules_to_save` as a list of names: null = none; a string is
    LLaMA-MoE's `--modules_to_save embed_tokens,lm_head` (its cpt_lora.py splits it on commas); each
    name once. ConfigError for an empty name or one with spaces."""
    if value is None:
        return []
    names = [str(n).strip() for n in (value.split(",") if isinstance(value, str) else value)]
    bad = next((n for n in names if not n or any(c.isspace() for c in n)), None)
    if bad is not None:
        raise ConfigError(f"model_alignment_strategy.peft.modules_to_save: {bad!r} in {value!r} is not a module name "
                          "(give module names, e.g. [embed_tokens, lm_head] or 'embed_tokens,lm_head')")
    return list(dict.fromkeys(names))


def _dpo_prompt_length(dpo: DPOConfig, key: str) -> tuple[Optional[int], str]:
    """(length, the key that gave it): NxDT 2.23 renamed max_dpo_prompt_length to max_prompt_length;
    both are read, and both given must agree."""
    old, new = dpo.max_dpo_prompt_length, dpo.max_prompt_length
    if old is not None and new is not None and old != new:
        raise ConfigError(f"{key}.max_prompt_length ({new}) and {key}.max_dpo_prompt_length ({old}) differ: they "
                          "are one setting (NxDT's new and old name); give one")
    if new is not None:
        return new, f"{key}.max_prompt_length"
    return old, f"{key}.max_dpo_prompt_length"


LORA_FUSED_NAMES = ("qkv_proj", "gate_up_proj")


def alignment_notices(al: Alignment) -> list[str]:
    """Keys accepted and inert here, reported once at start (`al`: the run spec's alignment)."""
    peft = al.peft
    if peft is not None and peft.merge_sharded_lora:
        return ["model_alignment_strategy.peft.merge_sharded_lora: inert here (nxdt's checkpoints are read whole "
                "at any layout; `nxdt convert nxdt-to-hf` writes one PEFT adapter)"]
    return []


def check_prompt_template(template: str | None) -> None:
    """model_alignment_strategy.sft.prompt_template: null, or a template with `{input}` in it."""
    if template is not None and "{input}" not in template:
        raise ConfigError("model_alignment_strategy.sft.prompt_template: must contain '{input}'")


def check_alignment(cfg: Any, al: Alignment) -> None:
    """One-line ConfigErrors for strategy combinations and values nxdt cannot run (`al`: the run
    spec's alignment, `alignment_of(cfg)`)."""
    ds = cfg.distributed_strategy
    if al.dpo is not None and al.orpo is not None:
        raise ConfigError(f"{al.dpo_key} and model_alignment_strategy.orpo are both set: pick one preference loss")
    if al.preference and al.sft is not None:
        raise ConfigError(f"model_alignment_strategy.sft and {al.preference} are both set: SFT reads "
                          "{input, output} rows, DPO/ORPO read {prompt, chosen, rejected} rows; pick one")
    if al.peft is not None:
        _check_peft(al.peft)
        _check_modules_to_save(cfg, al)
    if al.grpo is not None:
        check_grpo(cfg, al)
    if al.sft is not None:
        check_prompt_template(al.sft.prompt_template)
    if al.preference is None:
        return
    key = al.dpo_key if al.dpo is not None else "model_alignment_strategy.orpo"
    for what, size in (("pipeline_model_parallel_size", ds.pipeline_model_parallel_size),
                       ("context_parallel_size", ds.context_parallel_size)):
        if (size or 1) > 1:
            raise ConfigError(f"{key} with distributed_strategy.{what} > 1 is not supported yet (got {size})")
    seq = cfg.data.seq_length
    if al.dpo is not None:
        d = al.dpo
        if d.kl_beta <= 0:
            raise ConfigError(f"{key}.kl_beta: must be > 0, got {d.kl_beta}")
        if not d.precompute_ref_log_probs and al.peft is None:
            raise ConfigError(f"{key}.precompute_ref_log_probs: false is not supported yet without LoRA (it needs a "
                              "second model copy); set it true, or add model_alignment_strategy.peft (the frozen base "
                              "is then the reference)")
        _check_prompt_length(al.dpo_prompt_length_key, al.dpo_prompt_length, seq)
    else:
        o = al.orpo
        if o.beta < 0:
            raise ConfigError(f"{key}.beta: must be >= 0, got {o.beta}")
        _check_prompt_length(f"{key}.max_prompt_length", o.max_prompt_length, seq)


def _check_peft(peft: PeftConfig) -> None:
    key = "model_alignment_strategy.peft"
    if peft.lora_rank <= 0:
        raise ConfigError(f"{key}.lora_rank: must be > 0, got {peft.lora_rank}")
    if peft.lora_alpha <= 0:
        raise ConfigError(f"{key}.lora_alpha: must be > 0, got {peft.lora_alpha}")
    if not 0.0 <= peft.lora_dropout < 1.0:
        raise ConfigError(f"{key}.lora_dropout: must be in [0, 1), got {peft.lora_dropout}")
    if not peft.target_modules and not peft.target_parameters:
        raise ConfigError(f"{key}.target_modules: empty; name at least one linear (e.g. [qkv_proj]) or expert "
                          f"weight ({key}.target_parameters)")
    if peft.target_parameters and peft.lora_dropout:
        raise ConfigError(f"{key}.lora_dropout: must be 0 with target_parameters (peft's adapters on the expert "
                          f"weights take no dropout), got {peft.lora_dropout}")


def _check_modules_to_save(cfg: Any, al: Alignment) -> None:
    """modules_to_save train in place (peft trains a copy beside the frozen original): a run that needs
    the original as its reference (the base with the adapters off) cannot have them."""
    names = al.peft.modules_to_save
    if not names:
        return
    key = "model_alignment_strategy.peft.modules_to_save"
    if al.dpo is not None and not al.dpo.precompute_ref_log_probs:
        raise ConfigError(f"{key} with {al.dpo_key}.precompute_ref_log_probs false is not supported yet: the reference "
                          f"is the base with the adapters off, and nxdt trains {', '.join(names)} in place (peft keeps "
                          "the original beside its trained copy); set precompute_ref_log_probs true")
    if al.grpo is not None and al.grpo.beta > 0:
        raise ConfigError(f"{key} with {GRPO_KEY}.beta > 0 is not supported yet: the KL reference is the base with the "
                          f"adapters off, and nxdt trains {', '.join(names)} in place (peft keeps the original beside "
                          "its trained copy); set beta 0")


def _check_prompt_length(key: str, value: Optional[int], seq: Optional[int]) -> None:
    if value is None:
        return
    if value < 1:
        raise ConfigError(f"{key}: must be >= 1, got {value}")
    if seq is not None and value >= seq:
        raise ConfigError(f"{key} ({value}) must be below data.seq_length ({seq}): the response needs room")


GRPO_KEY = "model_alignment_strategy.grpo"


def scale_rewards_of(grpo: GRPOConfig) -> str:
    """'group' | 'batch' | 'none': TRL's bool spellings (true = group, false = none) normalised."""
    value = grpo.scale_rewards
    return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value


def check_grpo(cfg: Any, al: Alignment) -> None:
    """GRPO's combinations: the batch in groups of num_generations, room for prompt + completion, the
    layouts its rollouts run on, one method at a time, reward functions and their weights."""
    g, key, ds, data = al.grpo, GRPO_KEY, cfg.distributed_strategy, cfg.data
    others = [name for name in ("sft", "dpo", "orpo") if getattr(al, name) is not None]
    if others:
        raise ConfigError(f"{key} and model_alignment_strategy.{others[0]} are both set: pick one training method")
    for what, size, why in (
            ("pipeline_model_parallel_size", ds.pipeline_model_parallel_size,
             "nxdt's generator runs whole forward passes on every rank, not pipeline stages"),
            ("context_parallel_size", ds.context_parallel_size,
             "the generator's KV cache holds whole sequences, context parallelism slices them"),
            ("expert_model_parallel_size", ds.expert_model_parallel_size,
             "the rollouts' decode steps would need the expert all-to-all on every rank in step")):
        if (size or 1) > 1:
            raise ConfigError(f"{key} with distributed_strategy.{what} > 1 is not supported yet (got {size}): "
                              f"{why}; GRPO runs on data and tensor parallelism (DDP, ZeRO-1, FSDP, tp)")
    if not g.reward_funcs:
        raise ConfigError(f"{key}.reward_funcs: empty; name at least one reward function (e.g. "
                          "[nxdt.rl.rewards.accuracy])")
    if g.reward_weights is not None and len(g.reward_weights) != len(g.reward_funcs):
        raise ConfigError(f"{key}.reward_weights: {len(g.reward_weights)} weights for {len(g.reward_funcs)} "
                          "reward_funcs; give one per function")
    n = g.num_generations
    gbs = data.global_batch_size
    if gbs is not None and gbs % n:
        raise ConfigError(f"{key}.num_generations ({n}) does not divide data.global_batch_size ({gbs}): the batch "
                          "counts completions, num_generations per prompt")
    if n == 1 and scale_rewards_of(g) != "none":
        raise ConfigError(f"{key}.num_generations = 1 with scale_rewards={scale_rewards_of(g)!r}: a group of one has "
                          "no reward std (and no advantage); sample num_generations >= 2")
    if g.epsilon_high is not None and g.epsilon_high < g.epsilon:
        raise ConfigError(f"{key}.epsilon_high ({g.epsilon_high}) is below epsilon ({g.epsilon}): clip-higher "
                          "widens the upper bound only")
    if g.task is None and data.train_dir is None:
        raise ConfigError(f"{key}: no prompts; set data.train_dir (jsonl or HF folder rows with 'prompt') or "
                          f"{key}.task=arithmetic (nxdt's shipped task)")
    seq = data.seq_length
    if seq is not None:
        if g.max_completion_length >= seq:
            raise ConfigError(f"{key}.max_completion_length ({g.max_completion_length}) must be below "
                              f"data.seq_length ({seq}): the prompt needs room")
        if g.max_prompt_length is not None and g.max_prompt_length + g.max_completion_length > seq:
            raise ConfigError(f"{key}.max_prompt_length + max_completion_length ({g.max_prompt_length} + "
                              f"{g.max_completion_length}) exceed data.seq_length ({seq})")
