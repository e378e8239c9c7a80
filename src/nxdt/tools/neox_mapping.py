"""GPT-NeoX config keys -> nxdt keys: the tables and rules behind `nxdt import-config neox`.

`NeoxMapper(merged, origin, ...)` reads a merged NeoX config (top-level keys with '-' turned into
'_', as NeoX does) and fills an `Output`: nxdt values by dotted key, a comment per key, and the
NeoX keys it did not map, each with a category:

    not mapped    a training setting nxdt has no equivalent for: the run differs from NeoX's there
    approximated  a training setting mapped to the closest nxdt one, which is not exactly NeoX's
    inert         no effect in nxdt (launcher, logging, fused kernels, DeepSpeed tuning)
    unknown       not a GPT-NeoX key this importer knows (a typo, or a newer NeoX key)

The model itself is never approximated: a NeoX setting that would make nxdt build another model
(Mamba / RWKV / gMLP / sparse layers, a norm, position embedding or activation nxdt
lacks, biases nxdt cannot place as NeoX does) refuses the import, every such key in one error
(`refused`), and nothing is written. The NeoX keys the importer knows are NeoX's own argument
list (megatron/neox_arguments, tests/neox_arguments.json checks every one is classified).

The tables (NeoX's defaults, inert and unmapped keys) are in `neox_keys`; the optimizer, schedule,
precision, data and checkpoint keys in `neox_training_keys`.

A key absent from the NeoX files takes NeoX's default (`NEOX_DEFAULTS`, from NeoX's
megatron/neox_arguments/neox_args.py), written out explicitly where nxdt's default differs.
This module imports only the standard library and torch-free nxdt.config modules.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from nxdt.config.errors import ConfigError, ConfigErrors
from nxdt.tools.neox_keys import (ARCHITECTURE_OFF, ATTENTION_TYPES_OK, DEEPSPEED_TUNING, GPT2_VOCAB, INERT, NEOX_20B_VOCAB,
                                  NEOX_DEFAULTS, NORMS, NOT_ATTENTION, NOT_MAPPED, NOT_MAPPED_OFF, POS_EMB, SPARSE_ATTENTION,
                                  ZERO_INERT)
from nxdt.tools.neox_moe import MoEKeys
from nxdt.tools.neox_training_keys import TrainingKeys



class Output:
    """The nxdt config being written: values and comments by dotted key, and the listed NeoX keys."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.comments: dict[str, str] = {}
        self.listed: list[tuple[str, str, str, str]] = []  # (category, neox key, value shown, why)
        self.notices: list[str] = []  # one line each, printed once by the command

    def set(self, key: str, value: Any, comment: str | None = None) -> None:
        node = self.values
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
        if comment:
            self.comments[key] = comment

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.values
        for p in key.split("."):
            if not isinstance(node, dict) or p not in node:
                return default
            node = node[p]
        return node

    def add(self, category: str, key: str, value: Any, why: str) -> None:
        self.listed.append((category, key, _short(value), why))


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class NeoxMapper(TrainingKeys, MoEKeys):
    """Maps a merged NeoX config (`merged`: keys with '_') into `self.out`.

    `origin[key]` = (file, the key as spelled there) for messages; `num_gpus` / `num_nodes` /
    `vocab_size`: the command line's values (None: from the config or NeoX's rule)."""

    def __init__(self, merged: dict[str, Any], origin: dict[str, tuple[str, str]], *, num_gpus: int | None = None,
                 num_nodes: int | None = None, vocab_size: int | None = None) -> None:
        self.cfg = merged
        self.origin = origin
        self.used: set[str] = set()
        self.out = Output()
        self.cli_gpus, self.cli_nodes, self.cli_vocab = num_gpus, num_nodes, vocab_size
        self.refused: list[str] = []  # the model settings nxdt cannot build, reported together
        self.defaulted: list[str] = []  # training settings the files leave out (a model-only file)

    # ------------------------------------------------------------------ reading values
    def spelled(self, key: str) -> str:
        return self.origin.get(key, (None, key.replace("_", "-")))[1]

    def _where(self, key: str) -> str:
        file = self.origin.get(key, (None, key))[0]
        return f" (in {file})" if file else ""

    def has(self, key: str) -> bool:
        """Whether the files set `key` (null counts as unset: NeoX's default). Marks it as read."""
        if key in self.cfg:
            self.used.add(key)
        return self.cfg.get(key) is not None

    def c(self, key: str, extra: str = "") -> str:
        """A comment naming the NeoX key a value comes from, or saying it is NeoX's default."""
        return (self.spelled(key) if self.has(key) else f"NeoX's default {key.replace('_', '-')}") + extra

    def raw(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        value = self.cfg.get(key)
        return NEOX_DEFAULTS.get(key, default) if value is None else value

    def bad(self, key: str, want: str, value: Any) -> ConfigError:
        return ConfigError(f"neox key '{self.spelled(key)}'{self._where(key)}: expected {want}, got {value!r}")

    def number(self, key: str, default: Any = None, *, value: Any = None, integer: bool = False) -> Any:
        v = self.raw(key, default) if value is None else value
        if v is None:
            return None
        if isinstance(v, str):  # PyYAML (and so NeoX) reads 1e-4 as a string
            try:
                v = float(v.strip())
            except ValueError:
                raise self.bad(key, "an integer" if integer else "a number", v) from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.bad(key, "an integer" if integer else "a number", v)
        if integer:
            if float(v) != int(v):
                raise self.bad(key, "an integer", v)
            return int(v)
        return float(v)

    def integer(self, key: str, default: Any = None, *, value: Any = None) -> Any:
        return self.number(key, default, value=value, integer=True)

    def flag(self, key: str, default: Any = None) -> Any:
        v = self.raw(key, default)
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        raise self.bad(key, "true or false", v)

    def text(self, key: str, default: Any = None) -> Any:
        v = self.raw(key, default)
        if v is None or isinstance(v, str):
            return v
        raise self.bad(key, "a string", v)

    def section(self, key: str) -> dict:
        v = self.raw(key)
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise self.bad(key, "a mapping", v)
        return v

    def required(self, key: str) -> Any:
        if self.cfg.get(key) is None:
            raise ConfigError(f"neox config: '{key.replace('_', '-')}' is required (NeoX needs it too): set it in "
                              f"one of the files")
        return self.integer(key)

    def refuse(self, key: str, why: str, value: Any = None) -> None:
        """A model setting nxdt cannot build: collected, and the import refused at the end of `run`."""
        self.used.add(key)
        shown = _short(self.cfg.get(key) if value is None else value)
        self.refused.append(f"neox key '{self.spelled(key)}'{self._where(key)} = {shown}: {why}")

    def list_key(self, category: str, key: str, why: str) -> None:
        self.used.add(key)
        self.out.add(category, self.spelled(key), self.cfg.get(key), why)

    # ------------------------------------------------------------------ the mapping
    def run(self) -> Output:
        self.parallel_and_batch()
        self.model()
        self.raise_refused()  # the model's problems first, all of them, before any training key's
        self.optimizer_and_schedule()
        self.precision()
        self.data()
        self.checkpoints_and_eval()
        self.leftovers()
        self.raise_refused()
        if self.defaulted:
            self.out.notices.append("the NeoX files set no " + ", ".join(self.defaulted) + " (a model-only file, "
                                    "as NeoX's llama2 / mistral / codellama configs are): the output takes nxdt's "
                                    "defaults for them; add NeoX's training file (e.g. llama/train_config.yml) "
                                    "to take NeoX's")
        return self.out

    def raise_refused(self) -> None:
        if self.refused:
            raise ConfigErrors(f"nxdt cannot build the model these NeoX files describe ({len(self.refused)} "
                               f"setting(s)); nothing written:", self.refused)

    def parallel_and_batch(self) -> None:
        o = self.out
        tp = max(1, self.integer("model_parallel_size"))
        pp = max(1, self.integer("pipe_parallel_size"))
        self.tp, self.pp = tp, pp
        yaml_gpus = self.integer("num_gpus") if self.has("num_gpus") else None
        yaml_nodes = self.integer("num_nodes") if self.has("num_nodes") else None
        gpus = self.cli_gpus or (yaml_gpus if yaml_gpus and yaml_gpus > 0 else None)
        nodes = self.cli_nodes or (yaml_nodes if yaml_nodes and yaml_nodes > 0 else None) or 1
        how = "--num-gpus" if self.cli_gpus else "num_gpus in the NeoX files" if gpus else None
        if gpus is None:
            gpus = tp * pp
            how = "default: tp x pp, one node, so data parallel 1; pass --num-gpus / --num-nodes for yours"
        world = gpus * nodes
        if world % (tp * pp):
            raise ConfigError(f"{world} GPUs ({nodes} nodes x {gpus}) are not divisible by model-parallel-size ({tp}) "
                              f"x pipe-parallel-size ({pp}); pass --num-gpus / --num-nodes")
        dp = world // (tp * pp)
        self.dp = dp
        o.set("trainer.devices", gpus, f"GPUs per node ({how})")
        o.set("trainer.num_nodes", nodes, f"world {world} = tp {tp} x pp {pp} x data parallel {dp}")
        o.set("distributed_strategy.tensor_model_parallel_size", tp, "model-parallel-size")
        o.set("distributed_strategy.pipeline_model_parallel_size", pp, "pipe-parallel-size (0 and 1: no pipeline)")
        if self.flag("sequence_parallel"):
            o.set("distributed_strategy.sequence_parallel", True, "sequence_parallel")
        self.zero()

        # DeepSpeed's batch arithmetic (NeoXArgs.calculate_batch_parameters / check_batch_parameters)
        train = self.integer("train_batch_size") if self.has("train_batch_size") else None
        micro = self.integer("train_micro_batch_size_per_gpu") if self.has("train_micro_batch_size_per_gpu") else None
        acc = self.integer("gradient_accumulation_steps")
        if train is not None and micro is not None:
            pass
        elif train is not None:
            micro = train // dp // acc
        elif micro is not None:
            train = micro * acc * dp
        else:  # a model-only file: nxdt's default micro-batch (data.micro_batch_size: 1)
            micro, train = 1, acc * dp
            self.defaulted.append("train_micro_batch_size_per_gpu / train_batch_size")
        if micro < 1 or train != micro * acc * dp:
            raise ConfigError(f"neox config: train_batch_size ({train}) != train_micro_batch_size_per_gpu ({micro}) x "
                              f"gradient_accumulation_steps ({acc}) x data-parallel size ({dp}) (NeoX's check); "
                              f"pass --num-gpus / --num-nodes for the GPUs it was written for")
        o.set("data.micro_batch_size", micro, "train_micro_batch_size_per_gpu")
        o.set("data.global_batch_size", train,
              f"micro {micro} x gradient_accumulation_steps {acc} x data parallel {dp}")
        if self.has("gas"):
            gas = self.cfg["gas"]
            note = "" if gas == acc else f"; NeoX used gradient_accumulation_steps = {acc}"
            self.list_key("inert", "gas", INERT["gas"] + note)

    def zero(self) -> None:
        o = self.out
        z = self.section("zero_optimization")
        stage = z.get("stage", 0)
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
            o.add("not mapped", "zero_optimization.stage", stage, "only stages 0-3 map (0 = data parallel, "
                   "1 = distributed_strategy.zero1, 2 = sharding_strategy grad-shard, 3 = FSDP)")
            stage = 0
        if stage == 1:
            o.set("distributed_strategy.zero1", True, "ZeRO stage 1: optimizer state sharded over data parallel")
        elif stage == 2:
            o.set("distributed_strategy.sharding_strategy", "grad-shard",
                  "ZeRO stage 2: FSDP that keeps parameters gathered between forward and backward")
        elif stage == 3:
            o.set("distributed_strategy.sharding_strategy", "FSDP",
                  "ZeRO stage 3: parameters, gradients and state sharded")
        for key, value in z.items():
            key = str(key)
            if key == "stage":
                continue
            name = f"zero_optimization.{key}"
            if key in ("cpu_offload", "offload_optimizer", "offload_param"):
                on = bool(value.get("device", "none") != "none") if isinstance(value, dict) else bool(value)
                if on and stage >= 2:
                    o.set("distributed_strategy.cpu_offload", True, f"{name}")
                elif on:
                    o.add("not mapped", name, value, "nxdt offloads only with FSDP (ZeRO stage 2 or 3)")
            elif key in ZERO_INERT:
                o.add("inert", name, value, DEEPSPEED_TUNING)
            else:
                o.add("unknown", name, value, "not a ZeRO key import-config knows")

    # ------------------------------------------------------------------ model
    def model(self) -> None:
        o = self.out
        layers, hidden, heads = (self.required(k) for k in ("num_layers", "hidden_size", "num_attention_heads"))
        seq = self.required("seq_length")
        o.set("model_source", "megatron")
        o.set("seed", self.integer("seed"), self.c("seed"))
        o.set("model.encoder_seq_length", seq, "seq-length")
        maxpos = self.integer("max_position_embeddings") if self.has("max_position_embeddings") else None
        o.set("model.max_position_embeddings", maxpos or seq, "max-position-embeddings" if maxpos else "= seq-length")
        o.set("model.num_layers", layers, "num-layers")
        o.set("model.hidden_size", hidden, "hidden-size")
        o.set("model.ffn_hidden_size", self.ffn(hidden), self.ffn_note)
        o.set("model.num_attention_heads", heads, "num-attention-heads")
        if self.has("num_kv_heads"):
            o.set("model.num_kv_heads", self.integer("num_kv_heads"), "num-kv-heads")
        self.vocab()
        self.norm_and_positions()
        self.block()
        self.init()
        o.set("model.hidden_dropout", self.number("hidden_dropout"), self.c("hidden_dropout"))
        o.set("model.attention_dropout", self.number("attention_dropout"), self.c("attention_dropout"))
        o.set("model.apply_query_key_layer_scaling", self.flag("apply_query_key_layer_scaling"),
              self.c("apply_query_key_layer_scaling"))
        o.set("model.use_cpu_initialization", self.flag("use_cpu_initialization"), self.c("use_cpu_initialization"))
        if self.has("sliding_window_width"):
            o.set("model.sliding_window_size", self.integer("sliding_window_width"), "sliding-window-width")
        if self.flag("checkpoint_activations"):
            o.set("model.activations_checkpoint_granularity", "full", "checkpoint-activations: whole layers recomputed")
            o.set("model.checkpoint_num_layers", max(1, self.integer("checkpoint_num_layers")), "checkpoint-num-layers")
        else:
            o.set("model.activations_checkpoint_granularity", None, "checkpoint-activations false")
            if self.has("checkpoint_num_layers"):
                self.list_key("inert", "checkpoint_num_layers", "checkpoint-activations is off")
        self.attention_config()
        self.architecture_switches()

    def ffn(self, hidden: int) -> int:
        """NeoX's ParallelMLP size (megatron/model/transformer.py): intermediate_size, else
        expansion_factor x h, else 4h; gated activations take 2/3 of it, split in two halves."""
        act = self.text("activation")
        size = self.integer("intermediate_size") if self.has("intermediate_size") else None
        ef = self.number("expansion_factor") if self.has("expansion_factor") else None
        base = size or (int(ef * hidden) if ef else 4 * hidden)
        m = max(1, self.integer("mlp_multiple_of"))
        self.ffn_note = ("intermediate-size" if size else "expansion-factor x hidden-size" if ef else "4 x hidden-size"
                         ) + (f", multiple of {m}" if m > 1 else "")
        if act == "swiglu":
            full, half = int(base * 2 / 3), int(base * 2 / 3) // 2
            full, half = 2 * m * -(-full // (2 * m)), m * -(-half // m)
            self.ffn_note += ": swiglu uses 2/3 of it, in two halves (gate, up)"
            if full != 2 * half:
                self.refuse("intermediate_size" if size else "hidden_size",
                            f"NeoX's gated MLP (megatron/model/transformer.py ParallelMLP) gets a gate+up projection "
                            f"of {full} rows ({full // 2} each) and a down projection of {half} inputs, which do "
                            f"not fit: no model to import (set mlp-multiple-of, or an intermediate-size whose 2/3 "
                            f"is even)", value=base)
            return half
        return 2 * m * -(-base // (2 * m))

    def vocab(self) -> None:
        o = self.out
        div = self.integer("make_vocab_size_divisible_by")
        o.set("model.make_vocab_size_divisible_by", div, self.c("make_vocab_size_divisible_by", " (NeoX pads to a "
              "multiple of this x model-parallel-size, as nxdt does)"))
        size, why = self.vocab_size()
        if size is None:
            o.set("model.vocab_size", None, why)
            return
        multiple = div * self.tp
        padded = -(-size // multiple) * multiple
        o.set("model.vocab_size", size, f"{why}; padded to {padded} rows (multiple of {div} x tp {self.tp})")

    def vocab_size(self) -> tuple[int | None, str]:
        kind = self.text("tokenizer_type")
        vocab_file = self.text("vocab_file") if self.has("vocab_file") else None
        if self.cli_vocab:
            return self.cli_vocab, "--vocab-size"
        if kind in ("HFTokenizer", "HFGPT2Tokenizer") and vocab_file and os.path.isfile(vocab_file):
            try:
                with open(vocab_file, encoding="utf-8") as f:
                    data = json.load(f)
                ids = set(data["model"]["vocab"].values()) | {t["id"] for t in data.get("added_tokens", [])}
                return len(ids), f"tokens in {vocab_file}"
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
        if kind == "HFTokenizer":
            return NEOX_20B_VOCAB, ("tokenizer-type HFTokenizer: assumed GPT-NeoX-20B's tokenizer "
                                    "(--vocab-size to change)")
        if kind in ("GPT2BPETokenizer", "HFGPT2Tokenizer"):
            return GPT2_VOCAB, f"tokenizer-type {kind}: GPT-2's vocabulary"
        return None, f"tokenizer-type {kind}: unknown size: set model.vocab_size (or pass --vocab-size)"

    def norm_and_positions(self) -> None:
        o = self.out
        norm = self.text("norm")
        if norm not in NORMS:
            self.refuse("norm", "nxdt builds layernorm and rmsnorm")
            norm = "layernorm"
        o.set("model.normalization", NORMS[norm], self.c("norm"))
        eps_key = "rms_norm_epsilon" if NORMS[norm] == "rmsnorm" else "layernorm_epsilon"
        o.set("model.layernorm_epsilon", self.number(eps_key), self.c(eps_key))
        other_eps = "layernorm_epsilon" if eps_key == "rms_norm_epsilon" else "rms_norm_epsilon"
        for key in (other_eps, "scalenorm_epsilon"):
            if self.has(key):
                self.list_key("inert", key, f"the model uses {norm}")
        if not self.flag("use_bias_in_norms") and NORMS[norm] == "layernorm" and self.text("norm") in NORMS:
            self.refuse("use_bias_in_norms", "NeoX's LayerNorms have no bias here; nxdt's LayerNorm has one",
                        value=False)
        pos = self.text("pos_emb")
        if pos not in POS_EMB:
            self.refuse("pos_emb", "nxdt builds rotary, learned and none (NeoX's sinusoidal, rpe and alibi are not built)")
            pos = "none"
        o.set("model.position_embedding_type", POS_EMB[pos], self.c("pos_emb"))
        if pos == "rotary":
            o.set("model.rotary_percentage", self.number("rotary_pct"), self.c("rotary_pct"))
            if self.has("rotary_emb_base"):
                o.set("model.rotary_emb_base", self.number("rotary_emb_base"), "rotary-emb-base")
        else:
            for key in ("rotary_pct", "rotary_emb_base"):
                if self.has(key):
                    self.list_key("inert", key, f"pos-emb is {pos}")
        tie = not self.flag("no_weight_tying")
        o.set("model.share_embeddings_and_output_weights", tie, "no-weight-tying " + str(not tie).lower())

    def block(self) -> None:
        o = self.out
        act = self.text("activation")
        if act not in ("gelu", "swiglu"):
            self.refuse("activation", "nxdt builds gelu and swiglu MLPs")
            act = "gelu"
        # NeoX's get_activation (megatron/model/activations.py): gelu is F.gelu (exact), but with
        # bias-gelu-fusion its fused bias_gelu, GELU's tanh approximation (onnx-safe: erf_gelu, exact)
        onnx_safe = str(self.cfg.get("onnx_safe")).lower() == "true"
        if act == "gelu" and self.flag("bias_gelu_fusion", False) and not onnx_safe:
            o.set("model.activation", "gelu_tanh", self.c("activation", " with " + self.spelled("bias_gelu_fusion")
                                                          + ": NeoX's fused bias-GELU is GELU's tanh approximation"))
        else:
            o.set("model.activation", act, self.c("activation"))
        attn_bias, mlp_bias = self.flag("use_bias_in_attn_linear"), self.flag("use_bias_in_mlp")
        o.set("model.has_bias", attn_bias, "biases in the linear layers (NeoX's default)" if mlp_bias and attn_bias
              and not self.has("use_bias_in_attn_linear") else "use-bias-in-attn-linear")
        if attn_bias != mlp_bias:  # NeoX's Llama-style files: no attention biases, the MLP's by NeoX's default
            o.set("model.mlp_bias", mlp_bias, "use-bias-in-mlp" if self.has("use_bias_in_mlp")
                  else "NeoX's default use-bias-in-mlp (true): its MLP has biases")
        if self.flag("gpt_j_residual"):
            tied = self.flag("gpt_j_tied")
            o.set("model.transformer_block_type", "gpt_j", "gpt-j-residual: x + attn(ln1(x)) + mlp(ln2(x))")
            o.set("model.gpt_j_tied", tied,
                  "gpt-j-tied " + ("true: one norm" if tied else "false: two norms (NeoX's default)"))
        else:
            o.set("model.transformer_block_type", "pre_ln",
                  "gpt-j-residual false: x + attn(ln1(x)), then + mlp(ln2(.))")
            if self.has("gpt_j_tied"):
                self.list_key("inert", "gpt_j_tied", "gpt-j-residual is off")

    def init(self) -> None:
        o = self.out
        std = self.number("init_method_std")
        hidden, layers = self.out.get("model.hidden_size"), self.out.get("model.num_layers")
        method, out_method = self.text("init_method"), self.text("output_layer_init_method")
        if method == "small_init":
            std = math.sqrt(2 / (5 * hidden))
            o.set("model.init_method_std", std, "init_method small_init: sqrt(2 / (5 x hidden-size))")
        else:
            o.set("model.init_method_std", std, self.c("init_method_std"))
            if method != "normal":
                self.list_key("not mapped", "init_method", "nxdt initializes with normal(0, init_method_std)")
        if out_method in ("scaled_normal", "normal"):
            o.set("model.use_scaled_init_method", out_method == "scaled_normal",
                  f"output_layer_init_method {out_method}")
        else:
            o.set("model.use_scaled_init_method", True, "closest to output_layer_init_method " + out_method)
            exact = f" (wang_init: 2 / (num-layers x sqrt(hidden-size)) = {2 / (layers * math.sqrt(hidden)):.3g})" \
                if out_method == "wang_init" else ""
            self.list_key("approximated", "output_layer_init_method",
                          f"nxdt scales the output layers' std by 1/sqrt(2 x num-layers) = "
                          f"{std / math.sqrt(2 * layers):.3g}{exact}")

    def attention_config(self) -> None:
        """NeoX's per-layer types (megatron/utils.py expand_attention_types): [[types, n], ...] repeats
        `types` n times, or to fill every layer with n = "all"; a flat list of strings is already one per
        layer. Only global causal attention (flash or not: the same math) is built."""
        if not self.has("attention_config"):
            return
        spec, kinds, layers = self.raw("attention_config"), [], self.integer("num_layers")
        try:
            if all(isinstance(item, str) for item in spec):
                kinds = list(spec)
            for types, n in ([] if kinds else spec):
                if n == "all":
                    if layers % len(types):
                        raise ValueError
                    kinds = list(types) * (layers // len(types))
                    break
                kinds += list(types) * int(n)
        except (TypeError, ValueError, ZeroDivisionError):
            raise self.bad("attention_config", "[[[types], layers or \"all\"], ...]", spec) from None
        if len(kinds) != layers:
            raise self.bad("attention_config", f"types for num-layers ({layers}) layers", spec)
        found = dict.fromkeys(kinds)
        other = [k for k in found if k not in ATTENTION_TYPES_OK]
        if other:
            what = "; ".join(f"{k}: NeoX builds {NOT_ATTENTION.get(k) or SPARSE_ATTENTION.get(k) or 'an unknown type'}"
                             f" in {kinds.count(k)} of {layers} layers" for k in other)
            self.refuse("attention_config", f"{what}; nxdt builds transformer blocks with global causal attention "
                                            f"only (attention-config global or flash)")
        elif set(kinds) == {"flash"}:
            self.out.set("model.fusions.flash_attention", True, "attention-config: flash in every layer")
        elif "flash" in kinds:
            self.list_key("inert", "attention_config", "flash in some layers: the same attention; nxdt's SDPA picks "
                                                       "its kernels for every layer")
        if self.has("sparsity_config") and not set(kinds) & set(SPARSE_ATTENTION):
            self.list_key("inert", "sparsity_config", "no sparse attention layer in attention-config")

    def architecture_switches(self) -> None:
        """The NeoX model switches nxdt has no counterpart for: refused when they ask for something."""
        for key, (off, why) in ARCHITECTURE_OFF.items():
            if key not in self.cfg:
                continue
            value = self.cfg[key]
            self.used.add(key)
            if value is None or value == off or (key == "num_unique_layers" and value == self.cfg.get("num_layers")):
                self.list_key("inert", key, "off (NeoX's default)")
            else:
                self.refuse(key, why)
        self.moe()  # nxdt.tools.neox_moe

    def leftovers(self) -> None:
        for key in self.cfg:
            if key in self.used or key in ("num_gpus", "num_nodes"):
                continue
            value = self.cfg[key]
            if key in INERT:
                self.out.add("inert", self.spelled(key), value, INERT[key])
            elif key in NOT_MAPPED and key in NOT_MAPPED_OFF and value == NOT_MAPPED_OFF[key]:
                self.out.add("inert", self.spelled(key), value, "off (NeoX's default)")
            elif NOT_MAPPED.get(key):
                self.out.add("not mapped", self.spelled(key), value, NOT_MAPPED[key])
            elif key in NEOX_DEFAULTS:  # read only under some settings (e.g. init_method_std with small_init)
                self.out.add("inert", self.spelled(key), value, "not used with the other settings")
            else:
                self.out.add("unknown", self.spelled(key), value, "not a GPT-NeoX key import-config knows")
