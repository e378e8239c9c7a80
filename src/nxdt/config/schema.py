"""The config schema: every key nxdt reads, its type, its default and one line of help.

One dataclass per YAML section. `nxdt.config.load` merges the user's YAML over
`defaults()` so every key below exists in the composed `cfg`; `nxdt.config.validate`
walks these classes to reject unknown keys, wrong types and values outside an
enumeration (`Literal[...]`). `nxdt.config.inert.describe()` prints the whole tree for `--help`.

Conventions:
- `doc(default, "help")` puts the help text in `field(metadata=...)`.
- `open=True` in the metadata marks a free-form mapping whose contents are not
  checked here (`model.optim` is checked by `nxdt.config.optim_keys`).
- `neuron=True` marks a key that only acts on Neuron/XLA (reported as inert elsewhere).
- `ge=`, `gt=`, `le=`, `lt=` (and `float_*`, `also=`) give a number's valid range
  (`nxdt.config.ranges`): validation refuses a value outside it, `--help` shows it. Every
  int and float key has one.
- Keys accepted but not built are in `nxdt.config.inert` (inert, or refused as not supported yet).
- A string default `"${...}"` is an OmegaConf interpolation, resolved after the merge.
- `internal=True` marks a field filled by nxdt, not a YAML key (`DataConfig.custom`).
- `alias="other_key"` marks another name of a key (a sibling, or a dotted key): NxDT's newer name of
  it (docs/migrating-from-nxdt.md lists it as an alias).

At run time the config is an `NxdtConfig` instance (`nxdt.config.typed.to_typed`, called by
validation): code reads typed attributes, and the defaults above are the only ones. Open
sections stay plain dicts by design, because their keys depend on another setting:
- `model.optim` (with `model.optim.sched`): keys depend on the optimizer / scheduler name
  (checked by `nxdt.config.optim_keys`);
- `model.rope_scaling`: keys depend on `rope_type` (transformers' format);
- `DataConfig.custom`: the keys a custom data module (`data.data_module`) adds under `data:`,
  which nxdt does not know; allowed only with `data.data_module` set, written back under
  `data:` when the config is saved.

This module imports only the standard library (and nxdt.config's sharding table, ranges and errors).
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional, Union

from nxdt.config.errors import ConfigError
from nxdt.config.ranges import doc  # noqa: F401  (re-exported: the schema's field helper)
from nxdt.config.ranges import hints, section_class, type_name, type_with_range  # noqa: F401  (re-exported)
from nxdt.config.schema_sections import (  # noqa: F401  (re-exported: sections of NxdtConfig)
    TRUNCATION_MODES, AlignmentConfig, DataAlignmentConfig, DPOConfig, MLAConfig, MoEConfig, ORPOConfig, PeftConfig,
    SFTConfig)


PRECISION_TYPES = (
    "fp32", "autocast", "mixed_precision", "mixed_precisionSR", "mixed_precision_SR", "bf16SR", "manual",
)
PIPELINE_SCHEDULES = (
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV",
)
GATE_ALIASES = {"TopKBalancedNoisyGate": "top_k_balanced_noisy", "SwitchBalancedGate": "switch_balanced"}
"""LLaMA-MoE's class names for `model.moe.gate_type` -> nxdt's names (validation normalises them)."""


LLAMA_MOE_NOT_BUILT = {
    "score_scale_factor": "nxdt's name is model.moe.moe_calculator_score_scale_factor",
    "use_weighting": "LLaMA-MoE's own residual layer fails with it (it multiplies the residual block's output "
                     "object by a tensor); nxdt adds the residual block's output (use_weighting false)",
    "size_experts_residual": "the residual experts are equal (model.moe.residual_ffn_hidden_size each)",
}
"""LLaMA-MoE's `model.moe`-level names nxdt does not build: refused as "not supported yet" with the reason,
not as unknown keys."""


def canonical_gate_type(name: str) -> str:
    return GATE_ALIASES.get(name, name)


RECOMPUTE_ALIASES = {"ActivationMultiplyMLP": "LlamaMLP"}
"""NxDT class names in `model.activations_checkpoint_recompute` that name a part of a module nxdt's
Llama (native or transformers') does not split out -> that module. NxDT's HF Llama computes the
MLP's act(gate) * up in an `ActivationMultiplyMLP`; recomputing the `LlamaMLP` that holds it frees
those activations too (and recomputes the MLP's projections as well)."""


def canonical_recompute_classes(names: list[str]) -> list[str]:
    """`names` with NxDT's spellings replaced (RECOMPUTE_ALIASES), each once, in order."""
    return list(dict.fromkeys(RECOMPUTE_ALIASES.get(str(n), str(n)) for n in names))


PRECISION_ALIASES = {"mixed_precision_SR": "mixed_precisionSR"}
"""Other spellings of a preset (`precision.type`) -> the preset."""


def normalize_precision(ptype: str) -> str:
    """`mixed_precision_SR` is accepted as another spelling of `mixed_precisionSR`."""
    return PRECISION_ALIASES.get(ptype, ptype)


# Every accepted spelling of `distributed_strategy.sharding_strategy` -> the way it is built
# (nxdt.spec.parallel.SHARDING_MODES says what each way builds). Documented spellings first (the
# schema's error message lists them in this order), then the lowercase / underscore ones that
# fms-fsdp and minimal_fsdp configs use.
SHARDING_SPELLINGS = {
    "FSDP": "shard", "HSDP": "hybrid", "full-shard": "shard", "hybrid-full-shard": "hybrid",
    "grad-shard": "grad-shard", "hybrid-grad-shard": "hybrid-grad-shard", "no-shard": "replicate",
    "DDP": "replicate", "fsdp": "shard", "hsdp": "hybrid", "ddp": "replicate", "full_shard": "shard",
    "hybrid_shard": "hybrid", "hybrid_full_shard": "hybrid", "grad_shard": "grad-shard",
    "hybrid_grad_shard": "hybrid-grad-shard", "no_shard": "replicate",
}
SHARDING_STRATEGIES = tuple(SHARDING_SPELLINGS)


def sharding_way(name: str | None, fsdp: bool = False) -> str:
    """The way a `sharding_strategy` spelling is built (case-insensitive; None: FSDP's 'shard' when
    fms-fsdp's `fsdp: true` is set, else 'replicate'); ConfigError on an unknown spelling."""
    if name is None:
        return "shard" if fsdp else "replicate"
    way = SHARDING_SPELLINGS.get(str(name))
    if way is None:
        way = {k.lower(): v for k, v in SHARDING_SPELLINGS.items()}.get(str(name).lower())
    if way is None:
        raise ConfigError(f"distributed_strategy.sharding_strategy: unknown strategy '{name}' "
                          f"(expected one of {list(SHARDING_SPELLINGS)})")
    return way

ZeroOne = Literal["0", "1"]


# --------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    devices: int = doc(1, "devices (processes) per node; devices x num_nodes must equal the world size", ge=1)
    num_nodes: int = doc(1, "number of nodes", ge=1)
    accelerator: Literal["auto", "cpu", "gpu", "cuda", "mps", "xla", "neuron", "tpu"] = doc(
        "auto", "Lightning accelerator; 'neuron': TorchNeuron's native device where torch_neuronx provides it, "
        "else torch-xla; 'xla'/'tpu': torch-xla (Neuron env vars are set)")
    max_epochs: int = doc(-1, "maximum epochs; -1 = run by max_steps; 0 = evaluate only, no training: loss and "
                              "perplexity on the validation and test splits of the weights of exp_manager."
                              "resume_from_checkpoint, else (resume_if_exists) the newest checkpoint of the run "
                              "(neither: refused); writes <checkpoint>.eval.json (docs/evaluate.md)", ge=0, also=(-1,))
    max_steps: int = doc(1000, "number of optimizer steps (global batches) to train; -1 (no step limit) only "
                               "beside trainer.max_tokens, whose budget ends the run", ge=1)
    max_tokens: Optional[int] = doc(
        None, "train this many tokens: sets max_steps = ceil(max_tokens / (global_batch_size x seq_length)) "
              "(LLaMA-MoE plans runs in tokens); null = max_steps as given", ge=1)
    log_every_n_steps: int = doc(1, "log metrics every N steps", ge=1)
    val_check_interval: Optional[Union[int, float]] = doc(
        None, "validate every N training steps (int) or fraction of an epoch (float); null = Lightning default",
        ge=1, float_gt=0, float_le=1)
    check_val_every_n_epoch: Optional[int] = doc(None, "validate every N epochs; null when validating by steps", ge=1)
    num_sanity_val_steps: int = doc(0, "validation batches run before training (0 = none)", ge=0, also=(-1,))
    limit_val_batches: Union[int, float] = doc(
        1, "validation batches per validation run (int) or fraction (float)", ge=0, float_ge=0, float_le=1)
    limit_test_batches: Union[int, float] = doc(
        1, "test batches (int) or fraction (float)", ge=0, float_ge=0, float_le=1)
    gradient_clip_val: Optional[float] = doc(1.0, "clip the global gradient norm to this value; null or 0 = off", ge=0)
    accumulate_grad_batches: int = doc(
        1, "must stay 1: accumulation is derived from data.global_batch_size / (micro_batch_size x dp)", ge=1)
    enable_progress_bar: bool = doc(True, "show Lightning's progress bar")
    enable_model_summary: bool = doc(True, "print Lightning's model summary at start")
    lnc: Optional[int] = doc(None, "Neuron logical NeuronCore configuration (trn2)", neuron=True, ge=1)
    sequential_move_factor: Optional[int] = doc(
        None, "Neuron: move the model to device in groups of this many ranks", neuron=True, ge=1)
    callbacks: List[Any] = doc(
        [], "extra Lightning callbacks: a list of {_target_: pkg.module.Class, <kwargs>} built with "
            "hydra.utils.instantiate, run after nxdt's own (docs/monitoring.md)")
    peak_tflops: Optional[float] = doc(
        None, "peak dense TFLOP/s of one device for MFU; null = the table (H100, H200, A100, trn1, trn2) by "
              "device and precision, or on CPU a measured matmul peak (docs/monitoring.md)", gt=0)


# --------------------------------------------------------------------------- exp_manager
@dataclass
class CheckpointCallbackParams:
    monitor: str = doc("step", "what orders checkpoints for save_top_k: step (newest), or a logged metric (val_loss, reduced_train_loss)")
    save_top_k: int = doc(1, "keep the k best checkpoints by monitor (plus always the newest); -1 = keep all", ge=-1)
    mode: Literal["min", "max"] = doc("max", "whether a larger or smaller monitor value is better")
    save_last: bool = doc(False, "also keep a copy named 'last'")
    filename: str = doc("${exp_manager.name}--{step}-{consumed_samples}",
                        "checkpoint directory name; {step}, {consumed_samples}, {epoch} and the monitored metric are filled in")
    model_parallel_size: Optional[int] = doc(
        "${multiply:${distributed_strategy.tensor_model_parallel_size},"
        "${distributed_strategy.pipeline_model_parallel_size}}",
        "tp x pp (informational, NxDT writes it)", ge=1)
    every_n_train_steps: Optional[int] = doc(None, "save every N training steps; null = only at the end", ge=0)
    use_master_weights_in_ckpt: bool = doc(False, "with save_bf16, also save the fp32 master weights (loaded into the model: exact resume)")


@dataclass
class SamplesConfig:
    """Text generated from the model while it trains (nxdt.observability.samples): logged to TensorBoard's
    text tab and the log, to watch what the model has learned. Off unless prompts are given."""
    prompts: List[str] = doc([], "prompts to continue (batched, left-padded); empty = no samples")
    every_n_train_steps: int = doc(0, "generate after every N optimizer steps (and after the last); 0 = only at the end", ge=0)
    max_new_tokens: int = doc(32, "tokens generated per prompt", ge=1)
    temperature: float = doc(0.0, "0 = greedy (the same prompt shows how the model changes); > 0 samples", ge=0)
    top_k: Optional[int] = doc(None, "with temperature > 0: sample among the k most likely tokens; null = all", ge=0)
    top_p: float = doc(1.0, "with temperature > 0: nucleus mass, in (0, 1]", gt=0, le=1)
    seed: int = doc(0, "sampling seed (the same draws at every interval)", ge=0)


@dataclass
class ProfilerConfig:
    """torch.profiler over a window of steps (fms-fsdp's use_profiler): traces land in
    <log_dir>/profiler/, viewable in TensorBoard's profiler plugin or Perfetto (ui.perfetto.dev)."""
    enabled: bool = doc(False, "profile a window of training steps (fms-fsdp: use_profiler)")
    wait: int = doc(1, "steps skipped before the profiler starts", ge=0)
    warmup: int = doc(1, "steps profiled but discarded (profiler warm-up)", ge=0)
    active: int = doc(3, "steps recorded into a trace", ge=1)
    repeat: int = doc(1, "windows of wait+warmup+active steps; 0 = until the end of training", ge=0)
    ranks: List[int] = doc([0], "global ranks that profile (each writes its own trace)", ge=0)
    record_shapes: bool = doc(False, "record operator input shapes")
    profile_memory: bool = doc(False, "record tensor allocations and frees")
    with_stack: bool = doc(False, "record Python call stacks (larger traces)")
    cuda_memory_snapshot: bool = doc(
        False, "CUDA: record the allocator's history over the active steps and write "
               "<log_dir>/profiler/memory_snapshot_rank<R>.pickle (pytorch.org/memory_viz); inert elsewhere")


@dataclass
class ExpManagerConfig:
    log_local_rank_0_only: bool = doc(True, "only local rank 0 writes logs")
    create_tensorboard_logger: bool = doc(True, "write TensorBoard event files under the log dir")
    create_csv_logger: bool = doc(False, "write every logged metric to <log_dir>/metrics.csv")
    create_wandb_logger: bool = doc(
        False, "log to Weights & Biases (pip install 'nxdt[wandb]'; WANDB_MODE=offline needs no network)")
    wandb_logger_kwargs: Dict[str, Any] = doc(
        {}, "Lightning WandbLogger arguments (project, name, ...); save_dir defaults to the log dir", open=True)
    create_mlflow_logger: bool = doc(False, "log to MLflow (pip install 'nxdt[mlflow]')")
    mlflow_logger_kwargs: Dict[str, Any] = doc(
        {}, "Lightning MLFlowLogger arguments (experiment_name, tracking_uri, ...); tracking_uri defaults to "
            "file:<log_dir>/mlruns", open=True)
    profiler: ProfilerConfig = doc(ProfilerConfig, "torch.profiler traces of a window of steps (docs/monitoring.md)")
    explicit_log_dir: Optional[str] = doc(None, "log dir to use as is (overrides exp_dir/name/version)")
    exp_dir: Optional[str] = doc(None, "root of experiment dirs; null = ./nxdt_experiments")
    name: Optional[str] = doc("${name}", "experiment name (sub-folder of exp_dir)")
    version: Optional[str] = doc(None, "version sub-folder; null = a timestamp (none when resume_if_exists)")
    resume_if_exists: bool = doc(False, "resume from the newest complete checkpoint in the log dir")
    resume_ignore_no_checkpoint: bool = doc(False, "with resume_if_exists: start fresh (with a notice) if none")
    create_checkpoint_callback: bool = doc(True, "save checkpoints under <log_dir>/checkpoints")
    checkpoint_callback_params: CheckpointCallbackParams = doc(CheckpointCallbackParams, "checkpoint callback")
    log_parameter_norm: bool = doc(False, "log the global parameter norm")
    log_gradient_norm: bool = doc(False, "log the global gradient norm (before clipping)")
    enable_recovery_time_instrumentation: bool = doc(False, "log detailed timings of checkpoint recovery")
    save_xser: bool = doc(False, "save with torch-xla serialization (XLA only)", neuron=True)
    load_xser: bool = doc(False, "load with torch-xla serialization (XLA only)", neuron=True)
    save_bf16: bool = doc(False, "save the model weights in bf16 (half the bytes; see use_master_weights_in_ckpt)")
    async_checkpointing: bool = doc(False, "continue training while a checkpoint is being written")
    resume_from_checkpoint: Optional[str] = doc(None, "checkpoint directory to load at start")
    ckpt_ptl_version: Optional[str] = doc(None, "Lightning version recorded in (or expected of) checkpoints")
    samples: SamplesConfig = doc(SamplesConfig, "text generated during training (prompts, interval), to TensorBoard and the log")
    # ---- fault tolerance (docs/fault-tolerance.md)
    preemption_signals: List[str] = doc(
        ["SIGTERM", "SIGUSR1"], "signals that mean 'preempted': finish the step, save a checkpoint, exit 0 "
                                "(Slurm: --signal=USR1@120); [] = the signal's default action")
    requeue_on_preemption: bool = doc(True, "in a Slurm batch job, rank 0 runs 'scontrol requeue' after the preemption save")
    on_checkpoint_error: Literal["stop", "continue"] = doc(
        "stop", "a save that fails (disk full, a rank's write error): stop the run with one line, or log it and "
                "keep training (the last complete checkpoint stays the resume point either way)")
    run_lock: bool = doc(True, "hold <log_dir>/nxdt.lock while the run lives: a second launch into the log dir exits 2")
    run_lock_lease: int = doc(600, "seconds without a heartbeat after which a lock held from another host counts as stale", ge=10)


# --------------------------------------------------------------------------- distributed_strategy
@dataclass
class DistributedStrategyConfig:
    tensor_model_parallel_size: int = doc(1, "tensor-parallel degree (tp)", ge=1)
    pipeline_model_parallel_size: int = doc(1, "pipeline-parallel degree (pp)", ge=1)
    virtual_pipeline_model_parallel_size: Optional[int] = doc(1, "interleaved stages per pp rank; null = 1", ge=1)
    context_parallel_size: int = doc(1, "context-parallel degree (cp, ring attention)", ge=1)
    expert_model_parallel_size: int = doc(1, "expert-parallel degree (within data parallel)", ge=1)
    token_shuffle_group_size: int = doc(1, "MoE token shuffling group size (NxDT)", ge=1)
    zero1: bool = doc(False, "shard optimizer state across data-parallel ranks (ZeRO-1)")
    sequence_parallel: bool = doc(False, "shard activations along the sequence in tp regions (needs tp > 1)")
    kv_replicator: Optional[int] = doc(None, "replicate K/V heads this many times when tp > num_kv_heads", ge=1)
    schedule: Optional[Literal[PIPELINE_SCHEDULES]] = doc(None, "pipeline schedule; null = 1F1B (Interleaved1F1B if vpp > 1)")
    fsdp: bool = doc(False, "wrap the model with FSDP (see sharding_strategy)")
    sharding_strategy: Optional[Literal[SHARDING_STRATEGIES]] = doc(
        None, "FSDP | HSDP | grad-shard | no-shard/DDP (fms-fsdp, minimal_fsdp names); null = DDP")
    hsdp_replicate_size: Optional[int] = doc(
        None, "HSDP: data-parallel replicas (shards = dp / this); null = trainer.num_nodes (shard within a node)", ge=1)
    cpu_offload: bool = doc(False, "offload parameters and optimizer state to CPU")
    low_cpu_fsdp: bool = doc(False, "fms-fsdp: build the model on the meta device, materialize per shard")
    meta_init: bool = doc(False, "minimal_fsdp: same as low_cpu_fsdp")


# --------------------------------------------------------------------------- data
@dataclass
class DynamicSelectionConfig:
    reference_losses: Optional[Union[List[float], Dict[str, float], str]] = doc(
        None, "per-domain reference loss: a list in blend order, a {domain: loss} mapping (domain = the "
              "dataset's path or its last folder/file name), a JSON/YAML file holding either, or "
              "llama2_7b_slimpajama (LLaMA-MoE's: Llama-2-7B's SlimPajama losses by domain)")
    update_interval: int = doc(100, "steps between two weight updates (each evaluates every domain)", ge=1)
    eval_batches: int = doc(1, "held-out global batches per domain at each update (from the domain's "
                               "validation range of data.splits_string)", ge=1)
    eta: float = doc(1.0, "step size: weights <- weights x exp(eta x (loss - reference)), normalized (the _paper "
                          "rule: max(loss - reference, 0))", gt=0)
    smoothing: float = doc(1e-4, "then mixed with uniform: (1 - c) x weights + c / domains (Sheared-LLaMA's c)",
                           ge=0, lt=1)


@dataclass
class TokenizerConfig:
    library: Literal["huggingface", "megatron", "sentencepiece"] = doc("huggingface", "tokenizer library")
    type: Optional[str] = doc(None, "huggingface: tokenizer directory; megatron: class name (e.g. GPT2BPETokenizer)")
    model: Optional[str] = doc(None, "sentencepiece model file")
    vocab_file: Optional[str] = doc(None, "vocabulary file (megatron GPT2BPETokenizer)")
    merge_file: Optional[str] = doc(None, "BPE merges file (megatron GPT2BPETokenizer)")
    delimiter: Optional[str] = doc(None, "tabular tokenizer delimiter (unused)")
    sentencepiece_legacy: bool = doc(False, "sentencepiece legacy mode (allows added special tokens)")
    use_fast: bool = doc(True, "huggingface: load the fast (Rust) tokenizer")


@dataclass
class DataConfig:
    micro_batch_size: int = doc(1, "samples per forward/backward on one data-parallel rank", ge=1)
    global_batch_size: int = doc(1, "samples per optimizer step over all ranks; accumulation = gbs / (mbs x dp)", ge=1)
    seq_length: Optional[int] = doc("${model.encoder_seq_length}", "tokens per training sample", ge=1)
    data_prefix: Optional[Union[List[Any], Dict[str, Any], str]] = doc(
        None, "megatron: [w1, path1, w2, path2, ...] (paths without .bin/.idx), a path, or {train, validation, test}")
    index_mapping_dir: Optional[str] = doc(None, "where index mappings are cached; null = next to the data")
    data_impl: Literal["mmap"] = doc("mmap", "indexed dataset implementation")
    splits_string: str = doc("980,10,10", "train,validation,test proportions by document ranges")
    skip_warmup: bool = doc(True, "skip warming up the memory map")
    num_workers: int = doc(1, "DataLoader worker processes", ge=0)
    dataloader_type: Literal["single", "cyclic"] = doc("single", "single: sequential; cyclic: reshuffled per epoch")
    reset_position_ids: bool = doc(False, "restart position ids after each end-of-document token")
    reset_attention_mask: bool = doc(False, "block attention across end-of-document tokens")
    eod_mask_loss: bool = doc(False, "no loss on end-of-document tokens")
    validation_drop_last: bool = doc(True, "drop the last partial validation batch")
    no_seqlen_plus_one_input_tokens: bool = doc(False, "read seq_length tokens (not seq_length+1), mask the last")
    pad_samples_to_global_batch_size: bool = doc(False, "pad the last partial batch to the global batch size")
    train_dir: Optional[str] = doc(None, "hf / SFT: training data (datasets.save_to_disk dir, jsonl or arrow)")
    val_dir: Optional[str] = doc(None, "hf / SFT: validation data")
    test_dir: Optional[str] = doc(None, "hf / SFT: test data")
    dev_choose_samples: Optional[int] = doc(None, "hf / SFT: use only the first N samples", ge=1)
    use_sft_style_data_module: bool = doc(False, "NxDT: use the HF/SFT-style data module with a megatron model")
    packing: bool = doc(False, "SFT: pack several examples into one sequence")
    alignment_strategy: Optional["DataAlignmentConfig"] = doc(
        None, "NxDT's DPO configs: data.alignment_strategy.dpo (same keys as model_alignment_strategy.dpo)")
    tokenizer: TokenizerConfig = doc(TokenizerConfig, "tokenizer")
    data_module: Optional[str] = doc(
        None, "custom LightningDataModule 'pkg.module.Class' taking (cfg, trainer); other data keys are free")
    use_dummy_dataset: bool = doc(False, "fms-fsdp: random tokens instead of data (performance runs)")
    datasets: Optional[List[str]] = doc(None, "fms-fsdp: dataset sub-folders to blend (or its comma string 'a,b')")
    weights: Optional[List[float]] = doc(None, "fms-fsdp: blend weight of each entry of datasets (or '7725,500')")
    logical_shards: Optional[int] = doc(None, "fms-fsdp: logical shards (resumable across rank counts)", ge=1)
    data_path: Optional[str] = doc(None, "fms-fsdp: the folder data.datasets entries are relative to")
    col_name: str = doc("tokens", "fms-fsdp: the token-id column of arrow / parquet shards")
    sep_token: Optional[int] = doc(None, "fms-fsdp: appended to every shard document; null = the tokenizer's eod", ge=0)
    bos_token: Optional[int] = doc(None, "fms-fsdp: put before every shard document; null = none", ge=0)
    eos_token: Optional[int] = doc(None, "fms-fsdp's name of sep_token (both given: they must agree)", ge=0, alias="sep_token")
    bol_token: Optional[int] = doc(None, "fms-fsdp: token starting every training sample (line); null = none", ge=0)
    eol_token: Optional[int] = doc(None, "fms-fsdp: token ending every training sample (line); null = none", ge=0)
    strip_tokens: List[int] = doc([], "fms-fsdp: ids dropped from a document's first / last position (or '5,6')")
    file_type: Literal["arrow", "hf_parquet", "auto"] = doc("arrow", "fms-fsdp: arrow = token-id shards; hf_parquet = "
        ".parquet raw text (data.col_name) tokenized when opened; auto = .arrow 'tokens' ids + .parquet text")
    dynamic_data_selection: Literal["none", "sheared_llama", "sheared_llama_paper"] = doc(
        "none", "LLaMA-MoE: move the blend's weights by each domain's held-out loss against its reference "
                "(Sheared-LLaMA's dynamic batch loading): sheared_llama = LLaMA-MoE's rule (the signed "
                "difference), sheared_llama_paper = the paper's (only the excess above the reference); "
                "none = static weights")
    dynamic_selection: DynamicSelectionConfig = doc(DynamicSelectionConfig, "dynamic_data_selection's settings")
    prob_map: Optional[Literal["llama", "sheared_llama", "uniform"]] = doc(
        None, "LLaMA-MoE's blend presets: the weights of the datasets by SlimPajama domain (each dataset named "
              "after its domain: en_cc, en_c4, github, en_wikipedia, en_book, en_arxiv, en_stack); llama = LLaMA's "
              "portions, sheared_llama = Sheared-LLaMA's, uniform; null = data.weights / data_prefix's")
    custom: Dict[str, Any] = doc(
        {}, "not a YAML key: the data.* keys nxdt does not know, read by the custom data.data_module", internal=True)


# --------------------------------------------------------------------------- model
@dataclass
class FusionsConfig:
    softmax: bool = doc(True, "fused softmax (Neuron: NEURON_FUSE_SOFTMAX=1)")
    flash_attention: bool = doc(False, "NxDT: flash attention (its NKI kernel on Neuron)")
    ring_attention: bool = doc(False, "ring attention over the context-parallel group")
    torch_compile: bool = doc(
        False, "torch.compile each decoder block (under tensor parallel: its attention and MLP) and the loss, "
               "after tensor parallel and activation checkpointing, before FSDP (torchtitan's order; fms-fsdp's "
               "use_torch_compile, also model.use_torch_compile); the first step pays the compile time (printed); "
               "inert on XLA, which compiles the whole graph anyway")
    cross_entropy_chunk_size: Optional[int] = doc(
        None, "run the output layer and the cross entropy this many tokens at a time: the [batch, seq, vocab] "
              "logits never exist whole; a plain head computes each chunk's gradients in forward (fused, "
              "no recomputation), a tensor-parallel or LoRA head recomputes the chunk in backward; only the "
              "tokens the loss scores are projected (prompts and padding skip the output layer; DPO too); "
              "null = all at once", ge=1)


@dataclass
class ModelConfig:
    # architecture (null = from model_config for hf; required or derived for megatron)
    model_config: Optional[str] = doc(None, "hf: path to a transformers config.json (see ${nxdt_conf:...})")
    encoder_seq_length: int = doc(2048, "training sequence length", ge=1)
    max_position_embeddings: Optional[int] = doc(None, "positions; null = encoder_seq_length (megatron) / config.json (hf)", ge=1)
    num_layers: Optional[int] = doc(None, "transformer layers (hf: overrides config.json)", ge=1)
    hidden_size: Optional[int] = doc(None, "hidden size (hf: overrides config.json)", ge=1)
    ffn_hidden_size: Optional[int] = doc(None, "MLP intermediate size", ge=1)
    num_attention_heads: Optional[int] = doc(None, "query heads", ge=1)
    num_kv_heads: Optional[int] = doc(None, "key/value heads (GQA); null = num_attention_heads", ge=1)
    kv_channels: Optional[int] = doc(None, "head dimension (transformers' head_dim); null = hidden_size / num_attention_heads", ge=1)
    qk_layernorm: bool = doc(False, "a norm (model.normalization) over each head's queries and keys before rotary: "
                                    "Qwen3's self_attn.q_norm / k_norm (Megatron's qk_layernorm)")
    vocab_size: Optional[int] = doc(None, "vocabulary size; null = from the tokenizer (padded, see make_vocab_size_divisible_by)", ge=1)
    make_vocab_size_divisible_by: int = doc(8, "pad the vocabulary to a multiple of this x tp", ge=1)
    init_method_std: float = doc(0.02, "std of the normal weight init", ge=0)
    use_scaled_init_method: bool = doc(True, "scale output-layer init by 1/sqrt(2 x num_layers)")
    hidden_dropout: float = doc(0.0, "dropout on hidden states", ge=0, lt=1)
    attention_dropout: float = doc(0.0, "dropout on attention probabilities", ge=0, lt=1)
    ffn_dropout: float = doc(0.0, "dropout in the MLP", ge=0, lt=1)
    apply_query_key_layer_scaling: bool = doc(False, "scale Q.K^T by 1/layer_number (numerically neutral in fp32)")
    normalization: Literal["rmsnorm", "layernorm"] = doc("rmsnorm", "normalization layer")
    layernorm_epsilon: float = doc(1e-5, "normalization epsilon", gt=0)
    do_layer_norm_weight_decay: bool = doc(False, "apply weight decay to norm weights too")
    persist_layer_norm: bool = doc(True, "NeMo fused layer-norm kernel (inert)")
    share_embeddings_and_output_weights: bool = doc(False, "tie input embedding and lm_head")
    position_embedding_type: Literal["rope", "learned_absolute", "none"] = doc(
        "rope", "position embedding: rope | learned_absolute (a table) | none (GPT-NeoX's pos-emb none)")
    rotary_percentage: float = doc(1.0, "fraction of each head dim that gets rotary embedding, in (0, 1] (Pythia: 0.25)", gt=0, le=1)
    rope_theta: Optional[float] = doc(None, "rotary base; null = 10000 (megatron) or the config.json value (hf)", gt=0)
    rotary_emb_base: Optional[float] = doc(None, "GPT-NeoX's name for rope_theta (give one of the two)", gt=0)
    rope_scaling: Optional[Dict[str, Any]] = doc(None, "rotary scaling as in transformers (e.g. rope_type: llama3)", open=True)
    sliding_window_size: Optional[int] = doc(None, "sliding-window attention size; null = full causal", ge=1)
    activation: Literal["swiglu", "gelu", "gelu_tanh"] = doc(
        "swiglu", "MLP activation: swiglu | gelu (exact, erf) | gelu_tanh (GELU's tanh approximation: "
        "transformers' gelu_fast / gelu_new / gelu_pytorch_tanh, NeoX's bias-gelu-fusion)")
    transformer_block_type: Literal["pre_ln", "post_ln", "normformer", "gpt_j"] = doc(
        "pre_ln", "block layout: pre_ln (Llama) | post_ln | normformer | gpt_j (parallel residual, GPT-NeoX/Pythia)")
    gpt_j_tied: bool = doc(True, "gpt_j: attention and MLP share one input norm (GPT-J, NeMo); false: two "
                           "(GPT-NeoX / Pythia, transformers' use_parallel_residual)")
    has_bias: bool = doc(False, "biases in linear layers")
    mlp_bias: Optional[bool] = doc(None, "biases in the MLP's linear layers; null = model.has_bias (GPT-NeoX's "
                                         "use_bias_in_mlp, transformers' mlp_bias: Llama-style files of NeoX have "
                                         "them without attention biases)")
    # hf-specific
    qkv_linear: bool = doc(False, "NxDT GQAQKVLinear (one module for q, k, v)")
    fuse_qkv: bool = doc(False, "fuse q, k, v projections into one matmul")
    transpose_nki_inputs: bool = doc(False, "NKI flash-attention input layout (Neuron)", neuron=True)
    pipeline_cuts: Optional[List[str]] = doc(None, "pp x vpp - 1 layers that end a pipeline stage (NxD), e.g. [model.layers.15]; null = even split")
    # initialization / loading
    use_cpu_initialization: bool = doc(True, "initialize weights on CPU, then move to the device")
    use_torch_compile: bool = doc(False, "torch.compile each decoder block: fms-fsdp's name for "
                                         "model.fusions.torch_compile (either turns it on)")
    weight_init_only: bool = doc(False, "with resume_from_checkpoint: load weights only (fine-tuning start)")
    # activation checkpointing
    activations_checkpoint_granularity: Optional[Literal["selective", "full"]] = doc(
        None, "recompute activations: selective (attention core) | full (whole layers) | null")
    activations_checkpoint_recompute: Optional[List[str]] = doc(
        None, "selective: module class names to recompute, e.g. [CoreAttention, LlamaMLP]")
    activations_checkpoint_recompute_mlp: bool = doc(False, "selective: also recompute the MLP (NxDT)")
    checkpoint_num_layers: int = doc(1, "GPT-NeoX: layers per checkpointed chunk (full granularity)", ge=1)
    selective_checkpointing: Optional[float] = doc(
        None, "fms-fsdp: checkpoint this fraction of blocks, evenly spaced (0 < p <= 1)", gt=0, le=1)
    fusions: FusionsConfig = doc(FusionsConfig, "fused kernels")
    moe: MoEConfig = doc(MoEConfig, "mixture of experts")
    mla: MLAConfig = doc(MLAConfig, "multi-head latent attention (DeepSeek-V3), on with mla.kv_lora_rank")
    mtp_num_layers: int = doc(0, "multi-token prediction layers (Megatron's mtp_num_layers, transformers' "
                                 "num_nextn_predict_layers); > 0 is not supported yet", ge=0)
    optim: Dict[str, Any] = doc(
        {"name": "adamw", "lr": 3e-4, "weight_decay": 0.01, "betas": [0.9, 0.95],
         "sched": {"name": "CosineAnnealing", "warmup_steps": 0, "constant_steps": 0, "min_lr": 0.0}},
        "optimizer {name, lr, ...} and sched {name, ...} (NeMo names); replaced as a whole when given",
        open=True)


# --------------------------------------------------------------------------- precision
@dataclass
class Fp16Config:
    enabled: bool = doc(False, "GPT-NeoX/DeepSpeed fp16 training with loss scaling")
    loss_scale: float = doc(0.0, "static loss scale; 0 = dynamic", ge=0)
    initial_scale_power: int = doc(16, "dynamic: initial scale = 2**initial_scale_power", ge=0)
    loss_scale_window: int = doc(1000, "dynamic: steps without overflow before the scale grows", ge=1)
    hysteresis: int = doc(2, "dynamic: overflows tolerated before the scale shrinks", ge=1)
    min_loss_scale: float = doc(1.0, "dynamic: lower bound of the scale", gt=0)
    max_consecutive_skips: int = doc(50, "nxdt: stop the run after this many overflow-skipped steps in a row", ge=1)


@dataclass
class PrecisionConfig:
    type: Literal[PRECISION_TYPES] = doc("fp32", "precision preset (see docs: env vars and meaning per device)")
    master_weights: bool = doc(False, "manual: keep fp32 master weights")
    fp32_grad_acc: bool = doc(False, "manual: accumulate gradients in fp32")
    fp32_grads_cc: bool = doc(False, "manual: reduce gradients in fp32")
    # not neuron=True: under type manual they choose the dtype on every device (precision_settings)
    xla_use_bf16: ZeroOne = doc("0", "manual: '1' = bf16 training (XLA_USE_BF16 on Neuron)")
    xla_downcast_bf16: ZeroOne = doc("0", "manual: '1' = bf16 training (XLA_DOWNCAST_BF16 on Neuron)")
    neuron_rt_stochastic_rounding_en: ZeroOne = doc(
        "0", "manual: '1' = stochastic rounding to bf16 (NEURON_RT_STOCHASTIC_ROUNDING_EN on Neuron)")
    fp16: Fp16Config = doc(Fp16Config, "fp16 with loss scaling (GPT-NeoX)")
    grad_reduce_dtype: Literal["fp32", "bf16"] = doc("fp32", "FSDP's gradient-reduction dtype; bf16 = fms-fsdp's bfSixteen")
    parallel_layers_reduce_dtype: Optional[Literal["bf16", "fp32", "fp16"]] = doc(
        None, "NxDT 2.21+: dtype of the tensor/sequence-parallel all-reduces and reduce-scatters; nxdt reduces "
              "in the compute dtype (NxDT's default: fp32 under type fp32, else bf16)")
    on_nonfinite: Literal["stop", "skip"] = doc(
        "stop", "nxdt: a NaN/inf loss or gradient norm stops the run (stop) or skips the step (skip)")


# --------------------------------------------------------------------------- top level
@dataclass
class NxdtConfig:
    name: str = doc("nxdt", "run name")
    model_source: Literal["megatron", "hf"] = doc("megatron", "megatron: native model from model.*; hf: transformers config.json")
    seed: int = doc(1234, "random seed", ge=0, le=2**32 - 1)
    trainer: TrainerConfig = doc(TrainerConfig, "Lightning Trainer settings")
    exp_manager: ExpManagerConfig = doc(ExpManagerConfig, "logging, checkpoints, resume")
    distributed_strategy: DistributedStrategyConfig = doc(DistributedStrategyConfig, "parallel layout")
    data: DataConfig = doc(DataConfig, "dataset, batch sizes, tokenizer")
    model: ModelConfig = doc(ModelConfig, "architecture, optimizer, scheduler")
    precision: PrecisionConfig = doc(PrecisionConfig, "dtype preset")
    model_alignment_strategy: Optional[AlignmentConfig] = doc(
        None, "fine-tuning: sft, peft (LoRA), dpo, orpo; null = pre-training")
    compiler_flags: Optional[str] = doc(None, "Neuron compiler flags (appended to NEURON_CC_FLAGS)", neuron=True)
    compiler_cache_url: Optional[str] = doc(None, "NEURON_COMPILE_CACHE_URL", neuron=True)
    aync_exec_max_inflight_requests: Optional[int] = doc(
        None, "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS (NxDT's spelling of the key)", neuron=True, ge=0)
    bucket_size_collectives: Optional[int] = doc(None, "BUCKET_CAP_MB: collectives bucket size in MB", neuron=True, ge=1)
    neuron_rt_exec_timeout: Optional[int] = doc(None, "NEURON_RT_EXEC_TIMEOUT (seconds)", neuron=True, ge=1)
    neuron_experimental_compress_rg: bool = doc(False, "NEURON_EXPERIMENTAL_COMPRESS_RG", neuron=True)


# --------------------------------------------------------------------------- helpers
def defaults() -> dict:
    """The default config as a plain dict (interpolation strings unresolved; no internal fields)."""
    return _drop_internal(dataclasses.asdict(NxdtConfig()), NxdtConfig)


def is_internal(f: dataclasses.Field) -> bool:
    """A field nxdt fills itself (not a YAML key)."""
    return bool(f.metadata.get("internal"))


def _drop_internal(values: dict, cls: type) -> dict:
    for f in dataclasses.fields(cls):
        if is_internal(f):
            values.pop(f.name, None)
        elif (sub := section_class(hints(cls)[f.name])) is not None and isinstance(values.get(f.name), dict):
            _drop_internal(values[f.name], sub)
    return values


def iter_fields(cls: type = NxdtConfig, prefix: str = ""):
    """Yield (dotted_key, type_name, default, help, metadata) for every leaf key of the schema."""
    inst = cls()
    for f in dataclasses.fields(cls):
        if is_internal(f):
            continue
        key = f"{prefix}{f.name}"
        sub = section_class(hints(cls)[f.name])
        if sub is not None:
            yield from iter_fields(sub, key + ".")
            continue
        yield key, type_name(hints(cls)[f.name]), getattr(inst, f.name), f.metadata.get("help", ""), f.metadata
