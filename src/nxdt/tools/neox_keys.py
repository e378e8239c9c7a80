"""GPT-NeoX's defaults and the NeoX keys `nxdt import-config neox` lists instead of mapping
(inert in nxdt, or with no nxdt equivalent); the mapping itself is `neox_mapping`."""

from __future__ import annotations

from typing import Any

# NeoX's defaults (NeoXArgs*, DeepSpeed config defaults) for the keys mapped below.
NEOX_DEFAULTS: dict[str, Any] = {
    "pipe_parallel_size": 0, "model_parallel_size": 1, "sequence_parallel": False,
    "norm": "layernorm", "layernorm_epsilon": 1e-5, "rms_norm_epsilon": 1e-8,
    "pos_emb": "learned", "rotary_pct": 1.0, "no_weight_tying": False,
    "make_vocab_size_divisible_by": 128, "activation": "gelu", "mlp_multiple_of": 1,
    "init_method_std": 0.02, "init_method": "normal", "output_layer_init_method": "scaled_normal",
    "gpt_j_residual": False, "gpt_j_tied": False,
    "use_bias_in_attn_linear": True, "use_bias_in_mlp": True, "use_bias_in_norms": True,
    "apply_query_key_layer_scaling": False, "use_cpu_initialization": False,
    "hidden_dropout": 0.0, "attention_dropout": 0.0, "weight_decay": 0.1,
    "lr_decay_style": "linear", "min_lr": 0.0, "warmup": 0.01,
    "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "seed": 1234,
    "eval_iters": 100, "eval_interval": 1000, "split": "969, 30, 1", "num_workers": 2,
    "data_impl": "infer", "eod_mask_loss": False, "mmap_warmup": False,
    "checkpoint_activations": False, "checkpoint_num_layers": 1, "checkpoint_scale": "linear",
    "log_interval": 100, "tokenizer_type": "GPT2BPETokenizer",
    "moe_num_experts": 1, "moe_expert_interval": 1, "moe_top_k": 1, "moe_router_type": "sinkhorn",
}
ADAM_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}  # apex / DeepSpeed FusedAdam

# Tokenizer sizes before padding, for tokenizers that are not on this machine.
NEOX_20B_VOCAB = 50277  # GPT-NeoX-20B's tokenizer (20B_tokenizer.json), used by NeoX-20B and Pythia
GPT2_VOCAB = 50257

_LAUNCH = "launcher setting: torchrun / Slurm start nxdt (docs/launching.md)"
_LOG = "logging setting: nxdt logs to TensorBoard under the log dir (exp_manager)"
_FUSED = "fused-kernel switch: nxdt picks its kernels itself"
DEEPSPEED_TUNING = "DeepSpeed tuning: nxdt uses torch.distributed (no DeepSpeed engine)"
_DERIVED = "derived by NeoX at launch, not a setting"

# Keys that have no effect in nxdt (key with '_' -> why).
INERT: dict[str, str] = {
    **dict.fromkeys(("distributed_backend", "launcher", "deepspeed_slurm", "deepspeed_mpi", "hostfile", "include",
                     "exclude", "master_port", "master_addr", "force_multi", "no_ssh_check", "comment",
                     "account", "deepspeed", "user_script", "local_rank", "rank", "world_size",
                     "autotuning_run", "use_shared_fs", "lazy_mpu_init", "onnx_safe"), _LAUNCH),
    **dict.fromkeys(("steps_per_print", "wall_clock_breakdown", "tensorboard_dir", "log_dir", "use_wandb",
                     "wandb_group", "wandb_run_name", "wandb_team", "wandb_project", "wandb_host",
                     "wandb_init_all_ranks", "git_hash", "use_comet", "comet_workspace", "comet_project",
                     "comet_experiment_name", "comet_tags", "comet_others", "log_grad_pct_zeros",
                     "log_optimizer_states", "log_gradient_noise_scale", "gradient_noise_scale_n_batches",
                     "gradient_noise_scale_cpu_offload", "memory_profiling", "memory_profiling_path",
                     "profile", "profile_step_start", "profile_step_stop", "peak_theoretical_tflops",
                     "dump_state", "flops_profiler", "comms_logger", "tensorboard", "wandb", "csv_monitor"),
                    _LOG),
    **dict.fromkeys(("scaled_upper_triang_masked_softmax_fusion", "scaled_masked_softmax_fusion",
                     "bias_gelu_fusion", "bias_dropout_fusion", "rope_fusion", "layernorm_fusion",
                     "rmsnorm_fusion", "use_flashattn_swiglu", "fused_kernels_build_path",
                     "attention_softmax_in_fp32", "fp16_lm_cross_entropy", "rotary_save_freqs_buffer"), _FUSED),
    "output_layer_parallelism": "how the output layer is split over tensor parallel: nxdt's is column-parallel too",
    "checkpoint_validation_with_forward_pass": "NeoX's check of a saved checkpoint; nxdt names a checkpoint "
                                               "complete only once written (docs/checkpoints.md)",
    **dict.fromkeys(("partition_activations", "synchronize_each_layer", "contiguous_checkpointing",
                     "checkpoint_in_cpu", "deepspeed_activation_checkpointing", "profile_backward",
                     "zero_allow_untested_optimizer", "fp32_allreduce", "prescale_gradients",
                     "gradient_predivide_factor", "communication_data_type", "sparse_gradients",
                     "activation_checkpointing", "data_types"), DEEPSPEED_TUNING),
    "pipe_partition_method": "nxdt splits layers evenly over pipeline stages, or at model.pipeline_cuts",
    **dict.fromkeys(("optimizer_type", "lr", "batch_size", "clip_grad", "dynamic_loss_scale", "is_pipe_parallel",
                     "padded_vocab_size", "iteration", "do_train", "do_valid", "do_test", "global_num_gpus",
                     "zero_stage", "zero_reduce_scatter", "zero_contiguous_gradients", "zero_reduce_bucket_size",
                     "zero_allgather_bucket_size", "config_files", "loss_scale", "loss_scale_window",
                     "hysteresis", "min_scale"), _DERIVED),
    "gas": "old NeoX's derived copy of gradient_accumulation_steps (a value set here was overwritten)",
    "short_seq_prob": "BERT-style data only", "exit_interval": "no nxdt equivalent needed: set trainer.max_steps",
    "text_gen_type": "text generation setting", "eval_tasks": "evaluation-harness setting",
    **dict.fromkeys(("te_columnparallel", "te_rowparallel", "te_layernorm_mlp", "te_mha", "te_fp8_format",
                     "te_fp8_wgrad", "te_fp8_amax_history_len", "te_fp8_amax_compute_algo", "te_fp8_margin",
                     "te_fp8_mha"), "Transformer Engine kernels and FP8 recipes: nxdt computes with PyTorch's "
                                    "kernels in the precision.type's dtype (no FP8)"),
    **dict.fromkeys(("mamba_selective_scan_fusion", "mamba_causal_conv_fusion", "mamba_inner_func_fusion",
                     "mamba_selective_fp32_params", "mamba_use_bias_in_conv", "mamba_use_bias_in_linears"),
                    "read only by Mamba layers (attention-config mamba, which nxdt refuses)"),
    "gmlp_attn_dim": "read only by gMLP / aMLP layers (attention-config gmlp / amlp, which nxdt refuses)",
    **dict.fromkeys(("dim_att", "head_size", "ffn_dim"), "read only by RWKV layers (attention-config rwkv, which "
                                                          "nxdt refuses)"),
    **dict.fromkeys(("temperature", "top_p", "top_k", "maximum_tokens", "prompt_end", "sample_input_file",
                     "sample_output_file", "num_samples", "recompute", "eval_results_prefix", "char_level_ppl",
                     "return_logits"), "NeoX's generate.py / eval setting: `nxdt generate` and `nxdt evaluate` "
                                       "take their own flags (docs/generate.md, docs/evaluate.md)"),
    **dict.fromkeys(("serve_model_weights", "weight_server_port", "online_dataserver_ips", "online_dataserver_ports"),
                    "NeoX's online-RL weight / data servers (train-impl reinforce)"),
    **dict.fromkeys(("dpo_beta", "dpo_fp32", "dpo_reference_free", "kto_beta", "kto_fp32", "kto_desirable_weight",
                     "kto_undesirable_weight", "kl_impl", "kl_div_beta", "reinforce_leave_one_out", "fp32_reinforce",
                     "allow_chopped"),
                    "read only with train-impl dpo / kto / reinforce or pack-impl pack_until_overflow (not mapped)"),
    **dict.fromkeys(("adlr_autoresume", "adlr_autoresume_interval"),
                    "NVIDIA ADLR's cluster autoresume: nxdt saves on SIGTERM / SIGUSR1 and a relaunch with "
                    "exp_manager.resume_if_exists=true continues (docs/fault-tolerance.md)"),
    **dict.fromkeys(("deepscale", "deepscale_config", "deepspeed_extra_args"), DEEPSPEED_TUNING),
    **dict.fromkeys(("mup_attn_temp", "mup_embedding_mult", "mup_init_scale", "mup_output_temp",
                     "mup_rp_embedding_mult", "mup_width_scale", "coord_check", "save_base_shapes",
                     "base_shapes_file"), "read only with use-mup (not mapped)"),
    "s3_chunk_size": "read only with s3-path (not mapped)",
    "use_checkpoint_lr_scheduler": "nxdt restores the schedule from the checkpoint it resumes",
}

# Known NeoX keys nxdt cannot express (key with '_' -> why), listed when present.
NOT_MAPPED: dict[str, str] = {
    "train_epochs": "nxdt trains by steps: set trainer.max_steps",
    "extra_save_iters": "nxdt saves every exp_manager.checkpoint_callback_params.every_n_train_steps",
    "no_save_optim": "nxdt checkpoints always hold the optimizer state",
    "no_load_optim": "use exp_manager.resume_from_checkpoint with model.weight_init_only: true",
    "no_save_rng": "nxdt checkpoints always hold the generator states",
    "no_load_rng": "nxdt restores the generator states it saved",
    "finetune": "use exp_manager.resume_from_checkpoint with model.weight_init_only: true",
    "weight_by_num_documents": "nxdt blends by the weights given",
    "weighted_sampler_alpha": "nxdt blends by the weights given",
    "pack_impl": "nxdt packs documents into samples (NeoX's 'packed')",
    "dataset_impl": "nxdt's megatron data module is NeoX's 'gpt2' dataset",
    "train_impl": "nxdt pre-trains with the causal LM loss (DPO/KTO: model_alignment_strategy)",
    "use_mup": "nxdt has no muP", "use_bnb_optimizer": "nxdt has no bitsandbytes optimizers",
    "param_sharing_style": "read only with num-unique-layers (refused)",
    "sparsity_config": "read only by sparse attention layers (refused)",
    "rpe_num_buckets": "read only with pos-emb rpe (refused)",
    "rpe_max_distance": "read only with pos-emb rpe (refused)",
    "override_lr_scheduler": "nxdt restores the schedule from the checkpoint it resumes; to change it, start from "
                             "the weights (exp_manager.resume_from_checkpoint with model.weight_init_only: true)",
    "curriculum_learning": "nxdt has no sequence-length curriculum",
    "curriculum_seqlen": "nxdt has no sequence-length curriculum",
    "amp": "use precision.type (docs/precision.md)", "train_label_data_paths": "nxdt trains on next-token labels",
    "valid_label_data_paths": "nxdt trains on next-token labels",
    "test_label_data_paths": "nxdt trains on next-token labels",
    "z_loss": "nxdt has no z-loss", "elasticity": "nxdt has no elastic batch sizes",
    "checkpoint_scale": "only linear checkpoint spacing (every_n_train_steps)",
    "s3_path": "nxdt saves checkpoints to the file system",
}

# NOT_MAPPED keys at these values ask for nothing (NeoX's defaults): listed as inert, not as not mapped
NOT_MAPPED_OFF: dict[str, Any] = {
    "no_save_optim": False, "no_load_optim": False, "no_save_rng": False, "no_load_rng": False, "finetune": False,
    "weight_by_num_documents": False, "weighted_sampler_alpha": 1.0, "pack_impl": "packed", "dataset_impl": "gpt2",
    "train_impl": "normal", "use_mup": False, "use_bnb_optimizer": False, "param_sharing_style": "grouped",
    "rpe_num_buckets": 32, "rpe_max_distance": 128, "curriculum_learning": None, "curriculum_seqlen": 0,
    "z_loss": 0.0, "checkpoint_scale": "linear", "override_lr_scheduler": False,
}

# Architecture keys: any value but the first (NeoX's "off") builds a model nxdt cannot build, so the import
# is refused (one line each, all at once) rather than writing another model.
ARCHITECTURE_OFF: dict[str, tuple[Any, str]] = {
    "use_qk_layernorm": (False, "NeoX normalizes queries and keys per head; nxdt's blocks have no query/key norm"),
    "num_unique_layers": (None, "NeoX shares parameters between layers; nxdt builds num-layers distinct layers"),
    "opt_pos_emb_offset": (0, "OPT's offset of the learned positions; nxdt's positions start at 0"),
    "soft_prompt_tuning": (None, "a learned soft prompt; nxdt builds none"),
}
# attention-config layer types that are not global causal attention, and what NeoX builds for them
NOT_ATTENTION = {"mamba": "Mamba (selective state-space) layers", "rwkv": "RWKV layers", "gmlp": "gMLP blocks",
                 "amlp": "aMLP blocks (gMLP with a small attention)"}
SPARSE_ATTENTION = {"local": "local (windowed) attention", "sparse_fixed": "DeepSpeed's fixed sparse attention",
                    "sparse_variable": "DeepSpeed's variable sparse attention", "bigbird": "BigBird sparse attention",
                    "bslongformer": "Longformer-style block-sparse attention"}

ZERO_INERT = ("allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
              "reduce_bucket_size", "contiguous_gradients", "round_robin_gradients", "stage3_max_live_parameters",
              "stage3_max_reuse_distance", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
              "sub_group_size", "elastic_checkpoint", "load_from_fp32_weights", "ignore_unused_parameters",
              "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")
ATTENTION_TYPES_OK = ("global", "flash")
NORMS = {"layernorm": "layernorm", "te_layernorm": "layernorm", "rmsnorm": "rmsnorm", "te_rmsnorm": "rmsnorm"}
POS_EMB = {"rotary": "rope", "learned": "learned_absolute", "none": "none"}
