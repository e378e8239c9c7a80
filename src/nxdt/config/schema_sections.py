"""Sections of the schema kept out of `nxdt.config.schema` for its size: the model's `model.moe`
(mixture of experts) and `model.mla` (multi-head latent attention); the fine-tuning sections
`model_alignment_strategy` (sft, peft, dpo, orpo, grpo) and NxDT's `data.alignment_strategy`. Conventions as in `nxdt.config.schema`, which re-exports these
classes. Standard library only."""

from dataclasses import dataclass
from typing import List, Literal, Optional, Union

from nxdt.config.ranges import doc

TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass
class MoEConfig:
    num_experts: int = doc(0, "experts per MoE layer; 0 = dense model", ge=0)
    frequency: int = doc(1, "layer i is an MoE layer when i % frequency == 0 (1 = every layer)", ge=1)
    layers: Optional[List[int]] = doc(
        None, "the MoE layers by index (0-based), the others keep the dense MLP: Qwen3-MoE's layers "
              "(i + 1) % decoder_sparse_step == 0 not in mlp_only_layers; null = by frequency")
    ffn_hidden_size: Optional[int] = doc(
        None, "each expert's width (Megatron's moe_ffn_hidden_size, transformers' moe_intermediate_size); "
              "null = model.ffn_hidden_size (Mixtral), which the dense layers keep", ge=1)
    dropout: float = doc(0.0, "dropout in the MoE layer", ge=0, lt=1)
    capacity_factor: Optional[float] = doc(None, "expert capacity factor; null = no token dropping (0 with dropless)", ge=0)
    dropless: bool = doc(False, "dropless (blockwise) expert computation")
    routing_algorithm: Literal["top_k", "sinkhorn", "neox_sinkhorn"] = doc(
        "top_k", "router: top_k | sinkhorn (Megatron's, top-1) | neox_sinkhorn (GPT-NeoX's SinkhornRouter: "
                 "sigmoid scores at top_k 1, softmax above; top-k of the scores outside training)")
    router_activation: Literal["softmax", "sigmoid"] = doc("softmax", "router score activation")
    sinkhorn_iterations: int = doc(30, "sinkhorn routing iterations", ge=1)
    sinkhorn_tol: Optional[float] = doc(None, "sinkhorn tolerance (optional; NxDT writes None)", gt=0)
    top_k: int = doc(2, "experts per token", ge=1)
    output_router_logits: bool = doc(False, "return router logits (for the aux loss)")
    router_aux_loss_coef: float = doc(0.02, "load-balancing aux loss coefficient (Mixtral style)", ge=0)
    normalize_top_k_affinities: bool = doc(True, "renormalize the top-k router weights to sum to 1")
    num_selects: Optional[int] = doc(None, "LLaMA-MoE name for top_k (overrides it when set)", ge=1)
    gate_balance_loss_weight: float = doc(
        0.0, "LLaMA-MoE gates' balance loss weight w: noisy top-k w*(CV^2(importance)+CV^2(load)), "
             "switch w*E*sum(mean prob x token share); 0 = statistics only", ge=0)
    moe_calculator_score_scale_factor: float = doc(1.0, "routed expert outputs x this: LLaMA-MoE's total/selected, "
                                                 "DeepSeek-V3's routed_scaling_factor (Megatron moe_router_topk_scaling_factor)", gt=0)
    gate_type: Literal["mixtral", "top_k_balanced_noisy", "switch_balanced", "TopKBalancedNoisyGate",
                       "SwitchBalancedGate"] = doc(
        "mixtral", "mixtral (routing_algorithm, router_activation, router_aux_loss_coef) | LLaMA-MoE's "
                   "top_k_balanced_noisy (noisy top-k, softmax over the k) | switch_balanced (top-1); "
                   "LLaMA-MoE's class names are accepted")
    gate_add_noise: bool = doc(True, "LLaMA-MoE gates, training only: learned Gaussian noise (noisy top-k), "
                                     "Gumbel noise (switch)")
    gate_noise_epsilon: float = doc(1e-2, "noisy top-k: noise std = softplus(x W_noise) + this", ge=0)
    num_shared_experts: int = doc(0, "experts every token goes through, one MLP of this x moe.ffn_hidden_size "
                                     "(transformers' n_shared_experts; Megatron: moe_shared_expert_intermediate_size)", ge=0)
    num_groups: Optional[int] = doc(None, "group-limited routing: the experts in this many groups, a token picks "
                                          "within group_top_k of them (n_group; Megatron moe_router_num_groups)", ge=1)
    group_top_k: Optional[int] = doc(None, "groups a token may pick from (topk_group; Megatron moe_router_group_topk)", ge=1)
    load_balancing: Optional[Literal["aux_loss", "loss_free", "none"]] = doc(
        None, "aux_loss (the gate's balance loss, as output_router_logits / gate_balance_loss_weight say) | loss_free "
              "(DeepSeek-V3: a per-expert selection bias, mlp.gate.e_score_correction_bias, moved after each step "
              "towards balance; Megatron moe_router_enable_expert_bias) | none; null = aux_loss")
    bias_update_rate: float = doc(1e-3, "loss_free: each step a bias moves by this x sign(mean load - load) "
                                        "(Megatron moe_router_bias_update_rate)", gt=0)
    gate_network: Literal["linear", "mlp"] = doc(
        "linear", "the router's network: linear (one [E, hidden] weight) | mlp (LLaMA-MoE's gate_network mlp, its "
                  "default: Linear(hidden, E) -> Tanh -> Linear(E, E), mlp.gate.weight and mlp.gate.weight_out)")
    expert_activation: Optional[Literal["swiglu", "gelu", "gelu_tanh", "silu"]] = doc(
        None, "the experts: swiglu (gate, up, down: Mixtral's) | gelu | gelu_tanh | silu (two matrices, up and "
              "down, with that activation: GPT-NeoX's dropless experts); null = model.activation. Experts have "
              "no biases")
    # LLaMA-MoE's layer beyond its gates (its config.json names; nxdt.models.moe_calculators), model_source megatron
    calculator_type: Literal["UniversalCalculator", "SwitchDropTokenCalculator"] = doc(
        "UniversalCalculator", "LLaMA-MoE's calculator: UniversalCalculator (every routed token; capacity_factor as "
                               "nxdt's) | SwitchDropTokenCalculator (top-1; capacity int(capacity_factor x tokens / "
                               "num_experts), the excess dropped at random by torch.randperm, in evaluation too)")
    drop_tokens: bool = doc(True, "SwitchDropTokenCalculator: drop the tokens over an expert's capacity")
    dropped_padding: Literal["zero", "input"] = doc(
        "zero", "SwitchDropTokenCalculator: a dropped token's output before weighting: zero | input (the token itself)")
    gate_use_softmax: bool = doc(True, "LLaMA-MoE gates: false = the weights (and the balance loss's scores) are the "
                                       "raw, noisy logits instead of their softmax")
    gate_use_balance: bool = doc(True, "LLaMA-MoE: false = no balance loss from the noisy top-k gate (the switch gate "
                                       "keeps its loss, as LLaMA-MoE's ignores the key)")
    multiply_gate_scores: bool = doc(True, "LLaMA-MoE: false = the selected experts' outputs are summed unweighted "
                                           "(no score, no score scale factor)")
    add_weight_norm: bool = doc(False, "LLaMA-MoE: a learned scale on the weighted output, started at "
                                       "moe_calculator_score_scale_factor (one scalar for UniversalCalculator, in place "
                                       "of the factor; one per hidden unit after it for SwitchDropTokenCalculator)")
    switch_gate_weight: Literal["probability", "logit"] = doc(
        "probability", "switch gate's expert weight: probability (Switch Transformer) | logit (LLaMA-MoE's "
                       "SwitchBalancedGate: the chosen noisy logit, Gumbel noise in evaluation too)")
    size_experts: Optional[List[List[int]]] = doc(
        None, "LLaMA-MoE's unequal experts: per layer, each expert's width (stored moe.ffn_hidden_size wide, the "
              "rest zero and kept zero); null = all moe.ffn_hidden_size wide")
    num_experts_residual: int = doc(0, "LLaMA-MoE's residual MoE: experts every token goes through beside the routed "
                                       "ones, weighted by a linear gate (mlp.residual_block); 0 = none", ge=0)
    residual_ffn_hidden_size: Optional[int] = doc(None, "each residual expert's width; null = moe.ffn_hidden_size",
                                                  ge=1)
    gate_use_softmax_residual: bool = doc(True, "residual block: weights softmax(x W^T) (false: the logits)")
    multiply_gate_scores_residual: bool = doc(True, "residual block: false = its experts' outputs summed unweighted")
    score_scale_factor_residual: float = doc(1.0, "residual block: its weighted outputs x this", gt=0)


@dataclass
class MLAConfig:
    kv_lora_rank: Optional[int] = doc(
        None, "multi-head latent attention (DeepSeek-V2/V3) with a key/value latent this wide (transformers' and "
              "Megatron's kv_lora_rank); null = plain attention (q/k/v/o projections)", ge=1)
    q_lora_rank: Optional[int] = doc(
        None, "MLA: queries through a latent this wide (q_a_proj, q_a_layernorm, q_b_proj); null = one q_proj "
              "(DeepSeek-V2-Lite)", ge=1)
    qk_nope_head_dim: int = doc(128, "MLA: per-head query/key width without rotary (transformers' name; Megatron's "
                                     "qk_head_dim)", ge=1)
    qk_rope_head_dim: int = doc(64, "MLA: per-head query/key width with rotary, the key part shared by all heads "
                                    "(transformers' name; Megatron's qk_pos_emb_head_dim)", ge=2)
    v_head_dim: int = doc(128, "MLA: per-head value width (transformers' and Megatron's v_head_dim)", ge=1)
    rope_interleave: bool = doc(True, "MLA: the rotary dims stored as interleaved pairs (DeepSeek's checkpoints; "
                                      "transformers' rope_interleave)")


@dataclass
class SFTConfig:
    packing: bool = doc(False, "several examples per sequence, each attending only to itself (also data.packing)")
    prompt_template: Optional[str] = doc(
        None, "nxdt: the prompt as a template with '{input}', e.g. '### Question:\\n{input}\\n### Answer:\\n'")


@dataclass
class PeftConfig:
    lora_rank: int = doc(16, "LoRA rank r: adapters A (r x in) and B (out x r) per target linear", gt=0)
    lora_alpha: float = doc(32.0, "LoRA scaling numerator: the update is B A x * lora_alpha / lora_rank", gt=0)
    lora_dropout: float = doc(0.05, "dropout on the adapters' input (0 = none)", ge=0, lt=1)
    lora_bias: Literal["none", "all", "lora_only"] = doc(
        "none", "biases trained too: none | all (every bias) | lora_only (the biases of the targeted linears)")
    lora_verbose: bool = doc(True, "print trainable vs total parameters at start")
    target_modules: List[str] = doc(
        ["qkv_proj"], "linears that get adapters: NxDT's fused qkv_proj, gate_up_proj or the plain q_proj, "
                      "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")
    target_parameters: List[str] = doc(
        [], "MoE expert weights that get adapters, one per expert (peft's target_parameters): "
            "experts.gate_up_proj, experts.down_proj; needs lora_dropout 0 (as peft)")
    modules_to_save: Optional[Union[List[str], str]] = doc(
        None, "peft's modules_to_save: modules trained in full beside the adapters and saved with them (in the "
              "adapter-only checkpoint and PEFT's adapter file), each named as peft matches it: a module whose path "
              "ends with the name (embed_tokens, lm_head; norm is every norm); a list, or LLaMA-MoE's comma "
              "string 'embed_tokens,lm_head'")
    load_lora_from_ckpt: bool = doc(
        False, "with model.weight_init_only: also load the adapters from exp_manager.resume_from_checkpoint "
               "(else they start fresh)")
    save_lora_base: bool = doc(False, "checkpoints hold the frozen base weights too (default: adapters only)")
    merge_lora: bool = doc(
        False, "at the end of training also save the merged model (adapters folded into the base) as a "
               "weights checkpoint <checkpoint>-merged")
    save_lora_config_adapter: bool = doc(True, "write PEFT's adapter_config.json into every checkpoint")
    merge_sharded_lora: bool = doc(
        False, "NxDT: merge per-rank adapter files; nxdt's checkpoints are read whole at any layout (inert)")


@dataclass
class DPOConfig:
    kl_beta: float = doc(0.1, "DPO beta: strength of the implicit KL penalty towards the reference model", gt=0)
    loss_type: Literal["sigmoid", "hinge", "ipo"] = doc("sigmoid", "sigmoid (DPO), hinge (SLiC) or ipo (IPO)")
    max_dpo_prompt_length: Optional[int] = doc(
        None, "prompt tokens kept (truncation_mode says which); null = up to data.seq_length - 1", ge=1)
    max_prompt_length: Optional[int] = doc(
        None, "NxDT 2.23+'s name of max_dpo_prompt_length (either may be given; both: they must agree)", ge=1,
        alias="max_dpo_prompt_length")
    precompute_ref_log_probs: bool = doc(
        True, "reference log-probs computed once before training and checkpointed with the data state; "
              "false needs LoRA (the frozen base is the reference)")
    truncation_mode: Optional[Literal[TRUNCATION_MODES]] = doc(
        "keep_start", "over-long prompts keep their start or end; null = an over-long prompt is an error")


@dataclass
class ORPOConfig:
    beta: float = doc(0.1, "ORPO lambda: weight of the odds-ratio term added to the chosen responses' SFT loss", ge=0)
    max_prompt_length: Optional[int] = doc(
        None, "prompt tokens kept (truncation_mode says which); null = up to data.seq_length - 1", ge=1)
    truncation_mode: Optional[Literal[TRUNCATION_MODES]] = doc(
        "keep_start", "over-long prompts keep their start or end; null = an over-long prompt is an error")


GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class GRPOConfig:
    """TRL's GRPOConfig names and meanings. data.global_batch_size and micro_batch_size count
    completions (as TRL's batch sizes do): a step samples global_batch_size / num_generations prompts."""
    num_generations: int = doc(8, "G: completions sampled per prompt (a group); divides data.global_batch_size", ge=1)
    max_completion_length: int = doc(256, "new tokens per completion at most (a completion without EOS by then "
                                          "is truncated)", ge=1)
    max_prompt_length: Optional[int] = doc(
        None, "prompt tokens kept (the last ones, as TRL); null = data.seq_length - max_completion_length", ge=1)
    temperature: float = doc(1.0, "sampling temperature; the log-probs are those of logits / temperature", gt=0)
    top_p: float = doc(1.0, "nucleus sampling: the smallest set of tokens with probability >= top_p", gt=0, le=1)
    top_k: int = doc(0, "sample among the k most likely tokens (0 = all)", ge=0)
    beta: float = doc(0.0, "KL coefficient towards the reference (0 = no reference model: none is kept)", ge=0)
    epsilon: float = doc(0.2, "clipping: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]", ge=0, lt=1)
    epsilon_high: Optional[float] = doc(None, "upper clipping bound (DAPO's clip-higher, e.g. 0.28); null = epsilon",
                                        ge=0)
    loss_type: Literal[GRPO_LOSS_TYPES] = doc(
        "dapo", "token loss normalization, as TRL: grpo (per-sequence mean), dr_grpo (/ max_completion_length), "
                "dapo (/ tokens of the global batch), bnpo (/ tokens of the micro-batch)")
    scale_rewards: Union[bool, Literal[SCALE_REWARDS]] = doc(
        "group", "advantages divided by the reward std of the group, of the batch, or not (none); true = group, "
                 "false = none")
    num_iterations: int = doc(1, "policy updates per batch of rollouts (mu), the old log-probs kept", ge=1)
    mask_truncated_completions: bool = doc(False, "completions without EOS count for no tokens of the loss")
    reward_funcs: List[str] = doc(
        [], "dotted paths of reward functions f(prompts, completions, **columns) -> list[float | None] (TRL's "
            "convention); nxdt ships nxdt.rl.rewards.{accuracy, format_reward, length_penalty, token_fraction}")
    reward_weights: Optional[List[float]] = doc(None, "one weight per reward function (null = all 1)")
    task: Optional[Literal["arithmetic"]] = doc(
        None, "nxdt's shipped verifiable prompts instead of data.train_dir: arithmetic = deterministic sums and "
              "products with their answer column")
    log_completions_every_n_steps: int = doc(
        0, "every N steps a few prompt / completion / reward rows to stdout and TensorBoard's text tab (0 = off)",
        ge=0)
    compile_decode: bool = doc(
        False, "rollouts decode with torch.compile over a static KV cache (the native model without tensor "
               "parallelism; else the eager decode); the first step compiles (seconds to a minute on a CPU), "
               "docs/performance.md says when it pays")


@dataclass
class AlignmentConfig:
    sft: Optional[SFTConfig] = doc(None, "supervised fine-tuning on {input, output} rows")
    peft: Optional[PeftConfig] = doc(None, "LoRA adapters on a frozen base (combines with sft, dpo, orpo)")
    dpo: Optional[DPOConfig] = doc(None, "direct preference optimization on {prompt, chosen, rejected} rows")
    orpo: Optional[ORPOConfig] = doc(None, "odds-ratio preference optimization (no reference model)")
    grpo: Optional[GRPOConfig] = doc(None, "online RL with group-relative advantages (TRL's GRPO): completions "
                                           "sampled in the trainer, scored by reward functions")


@dataclass
class DataAlignmentConfig:
    dpo: Optional[DPOConfig] = doc(None, "NxDT's DPO config puts model_alignment_strategy.dpo here")
    orpo: Optional[ORPOConfig] = doc(None, "accepted here too, like dpo")
