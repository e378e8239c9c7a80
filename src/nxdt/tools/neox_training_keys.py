"""`nxdt import-config neox`, the training half: optimizer and LR schedule, precision (fp16 / bf16
blocks), data and tokenizer, checkpoints and evaluation. A mixin of `neox_mapping.NeoxMapper`,
whose helpers (`raw`, `number`, `flag`, `section`, `list_key`, `out`, ...) it uses."""

from __future__ import annotations

import math
import os
from typing import Any

from nxdt.config.optim_keys import NEEDS_DEEPSPEED, OPTIMIZERS
from nxdt.tools.neox_keys import ADAM_DEFAULTS


class TrainingKeys:
    # ------------------------------------------------------------------ optimizer and schedule
    def optimizer_and_schedule(self) -> None:
        o = self.out
        spec = self.section("optimizer")
        kind = str(spec.get("type", "adam"))
        params = spec.get("params") or {}
        if not isinstance(params, dict):
            raise self.bad("optimizer", "params to be a mapping", params)
        for key in spec:
            if key not in ("type", "params"):
                o.add("unknown", f"optimizer.{key}", spec[key], "NeoX's optimizer block has type and params")
        low = kind.lower().replace("-", "_")
        wd = self.number("weight_decay")
        spelling = low.replace("_", "")
        if low in ("adam", "adamw"):
            name, defaults = "adamw", ADAM_DEFAULTS
            note = f"NeoX '{kind}' = apex/DeepSpeed FusedAdam (decoupled weight decay: AdamW)"
        elif low == "lion":
            name, defaults, note = "lion", {"lr": 1e-4, "betas": [0.9, 0.99]}, "lion"
        elif low == "sm3":
            name, defaults, note, wd = "sm3", {"lr": 0.1}, "sm3 (NeoX passes it no weight decay)", None
        elif low == "sgd":
            name, defaults, note = "sgd", {"lr": 1e-3}, "NeoX's sgd is muP's MuSGD (nxdt has no muP): torch SGD"
        else:
            why = NEEDS_DEEPSPEED.get(spelling, f"nxdt has no {kind}; the output uses adamw with its lr")
            o.add("not mapped", "optimizer.type", kind, why)
            name, defaults, note = "adamw", ADAM_DEFAULTS, f"instead of {kind} (see the block at the end)"
            for key in [k for k in params if k not in ("lr", "betas", "eps")]:
                o.add("inert", f"optimizer.params.{key}", params[key], f"belongs to {kind}, which is not mapped")
            params = {k: v for k, v in params.items() if k in ("lr", "betas", "eps")}
        optim: dict[str, Any] = {"name": name}
        accepted = OPTIMIZERS[name]
        for key in ("lr", "betas", "eps"):
            if key in accepted and (key in params or key in defaults):
                optim[key] = params.get(key, defaults.get(key))
        for key, value in params.items():
            key = str(key)
            if key in optim or key == "weight_decay":
                continue
            if key in accepted:
                optim[key] = value
            else:
                clip = key == "max_grad_norm"
                o.add("inert" if clip else "not mapped", f"optimizer.params.{key}", value,
                      "gradient_clipping sets clipping" if clip else f"nxdt's {name} does not take it")
        if "weight_decay" in params and name != "sm3":
            o.add("inert", "optimizer.params.weight_decay", params["weight_decay"],
                   "NeoX passes weight-decay (the top-level key) to the optimizer")
        if wd is not None and "weight_decay" in accepted:
            optim["weight_decay"] = wd
        elif self.has("weight_decay"):
            self.list_key("inert", "weight_decay", f"{name} takes no weight decay in NeoX")
        optim["lr"] = self.number("lr", value=optim.get("lr", 1e-3)) if "lr" in optim else None
        if "betas" in optim:
            b = optim["betas"]
            if not isinstance(b, (list, tuple)) or len(b) != 2:
                raise self.bad("optimizer", "params.betas to be [beta1, beta2]", b)
            optim["betas"] = [self.number("optimizer", value=x) for x in b]
        if "eps" in optim:
            optim["eps"] = self.number("optimizer", value=optim["eps"])
        optim = {k: v for k, v in optim.items() if v is not None}
        optim["sched"] = self.schedule()
        o.set("model.optim", optim, note)

    def schedule(self) -> dict[str, Any] | None:
        o = self.out
        if self.cfg.get("train_iters") is None:  # a model-only file: nxdt's default step count
            self.defaulted.append("train-iters")
            iters = 1000
        else:
            iters = self.required("train_iters")
        o.set("trainer.max_epochs", -1)
        o.set("trainer.max_steps", iters, "train-iters")
        if self.has("lr_decay_iters"):
            decay, src = self.integer("lr_decay_iters"), "lr-decay-iters"
            if self.has("lr_decay_fraction"):
                self.list_key("inert", "lr_decay_fraction", "lr-decay-iters wins in NeoX")
        elif self.has("lr_decay_fraction"):
            decay, src = math.floor(iters * self.number("lr_decay_fraction")), "train-iters x lr-decay-fraction"
        else:
            decay, src = iters, "train-iters"
        decay = max(1, decay)
        warmup_frac = self.number("warmup")
        warmup = int(round(warmup_frac * decay))
        style = self.text("lr_decay_style")
        min_lr = self.number("min_lr")
        self.sched_note = f"lr-decay-style {style}, warmup {warmup_frac:g} x {decay} ({src})"
        sched: dict[str, Any]
        if style == "cosine":
            sched = {"name": "CosineAnnealing", "warmup_steps": warmup, "constant_steps": 0, "min_lr": min_lr}
        elif style == "linear" and min_lr == 0:
            sched = {"name": "LinearAnnealingWithWarmUp", "warmup_steps": warmup}
        elif style == "linear":
            sched = {"name": "WarmupAnnealing", "warmup_steps": warmup, "min_lr": min_lr}
            self.list_key("approximated", "lr_decay_style", f"NeoX decays linearly to 0 and clips at min-lr "
                          f"{min_lr:g}; nxdt's WarmupAnnealing decays linearly to min-lr")
        else:
            sched = {"name": "WarmupPolicy", "warmup_steps": warmup}
            if style != "constant":
                self.list_key("not mapped", "lr_decay_style", f"nxdt has no {style} decay after a warmup; "
                              "the output keeps the lr constant after the warmup")
            elif min_lr:
                self.list_key("inert", "min_lr", "a constant lr")
        if decay != iters:
            sched["max_steps"] = decay
        o.comments["model.optim.sched"] = self.sched_note
        return sched

    # ------------------------------------------------------------------ precision
    def precision(self) -> None:
        o = self.out
        fp16, bf16 = self.section("fp16"), self.section("bf16")
        kind = self.text("precision") if self.has("precision") else None
        if fp16.get("enabled") is True:
            kind = "fp16"
        elif bf16.get("enabled") is True:
            kind = "bfloat16"
        if kind == "fp16":
            o.set("precision.type", "mixed_precision", "fp32 master weights; fp16.enabled computes in fp16")
            o.set("precision.fp16.enabled", True, "fp16 with DeepSpeed's loss scaler")
            table = {"loss_scale": (0.0, float), "initial_scale_power": (16, int), "loss_scale_window": (1000, int),
                     "hysteresis": (2, int), "min_loss_scale": (1.0, float)}
            for key, (default, cast) in table.items():
                value = self.number("fp16", value=fp16.get(key, default), integer=cast is int)
                o.set(f"precision.fp16.{key}", value)
            for key, value in fp16.items():
                if key in ("fp16", "type", "enabled"):
                    if key != "enabled":
                        o.add("inert", f"fp16.{key}", value, "a DeepSpeed spelling of enabled")
                elif key not in table:
                    o.add("not mapped", f"fp16.{key}", value, "nxdt's scaler takes the keys of precision.fp16")
        elif kind == "bfloat16":
            o.set("precision.type", "mixed_precision", "bf16 compute, fp32 master weights (DeepSpeed bf16)")
            for key, value in bf16.items():
                if key != "enabled":
                    o.add("not mapped", f"bf16.{key}", value, "precision.type mixed_precision has no options")
        else:
            o.set("precision.type", "fp32", "no fp16 / bf16 block enabled")
            if kind not in (None, "fp32"):
                self.list_key("not mapped", "precision", "unknown precision; the output trains in fp32")
        for name, block in (("fp16", fp16), ("bf16", bf16)):
            if block and block.get("enabled") is not True and kind != ("fp16" if name == "fp16" else "bfloat16"):
                o.add("inert", name, block, "not enabled")

    # ------------------------------------------------------------------ data, tokenizer
    def data(self) -> None:
        o = self.out
        paths = {s: self.raw(f"{s}_data_paths") for s in ("train", "valid", "test")}
        if self.has("data_path"):
            o.set("data.data_prefix", [1.0, self.text("data_path")], "data-path (split by splits_string)")
            for s, p in paths.items():
                if p:
                    self.list_key("inert", f"{s}_data_paths", "data-path wins in NeoX")
        elif paths["train"]:
            blend = {}
            for split, name in (("train", "train"), ("valid", "validation"), ("test", "test")):
                p = paths[split]
                if not p:
                    continue
                if isinstance(p, str):
                    p = [p]
                w = self.raw(f"{split}_data_weights") or [1.0] * len(p)
                if not isinstance(w, list) or len(w) != len(p):
                    raise self.bad(f"{split}_data_weights", f"{len(p)} weights (one per path)", w)
                blend[name] = [x for pair in zip((self.number(f"{split}_data_weights", value=v) for v in w), p)
                               for x in pair]
            o.set("data.data_prefix", blend, "train/valid/test-data-paths with their weights")
        else:
            o.set("data.data_prefix", None, "no data-path in the NeoX files: set data.data_prefix")
        for split in ("train", "valid", "test"):
            self.used.add(f"{split}_data_weights")
        o.set("data.splits_string", str(self.raw("split")), self.c("split"))
        impl = self.text("data_impl")
        if impl not in ("mmap", "infer"):
            self.list_key("not mapped", "data_impl", "nxdt reads mmap indexed datasets")
        o.set("data.data_impl", "mmap", "data-impl " + impl)
        o.set("data.num_workers", self.integer("num_workers"), self.c("num_workers"))
        o.set("data.skip_warmup", not self.flag("mmap_warmup"), "mmap-warmup " + str(self.flag("mmap_warmup")).lower())
        o.set("data.eod_mask_loss", self.flag("eod_mask_loss"), self.c("eod_mask_loss"))
        self.tokenizer()

    def tokenizer(self) -> None:
        o = self.out
        kind = self.text("tokenizer_type")
        vocab = self.text("vocab_file") if self.has("vocab_file") else None
        merge = self.text("merge_file") if self.has("merge_file") else None
        if kind == "GPT2BPETokenizer":
            o.set("data.tokenizer.library", "megatron", "tokenizer-type GPT2BPETokenizer")
            o.set("data.tokenizer.type", "GPT2BPETokenizer")
            o.set("data.tokenizer.vocab_file", vocab, "vocab-file" if vocab else "set it (GPT-2's vocab.json)")
            o.set("data.tokenizer.merge_file", merge, "merge-file" if merge else "set it (GPT-2's merges.txt)")
            return
        if merge is not None:
            self.list_key("inert", "merge_file", f"tokenizer-type {kind} has no merges file")
        if kind in ("HFTokenizer", "HFGPT2Tokenizer"):
            o.set("data.tokenizer.library", "huggingface", f"tokenizer-type {kind}")
            if vocab:
                folder = os.path.dirname(vocab) or "."
                note = f"the folder of vocab-file {vocab}"
                if os.path.basename(vocab) != "tokenizer.json":
                    note += (f" (nxdt loads <folder>/tokenizer.json: save {os.path.basename(vocab)} there under "
                             "that name)")
                o.set("data.tokenizer.type", folder, note)
            else:
                o.set("data.tokenizer.type", None, "no vocab-file in the NeoX files: set the tokenizer folder "
                      "(null = nxdt's bundled tokenizer)")
        elif kind == "SPMTokenizer":
            o.set("data.tokenizer.library", "sentencepiece", "tokenizer-type SPMTokenizer")
            o.set("data.tokenizer.model", vocab, "vocab-file")
        else:
            self.list_key("not mapped", "tokenizer_type", "nxdt loads huggingface, GPT-2 BPE and sentencepiece "
                          "tokenizers; the output uses nxdt's bundled tokenizer")
            if vocab:
                self.list_key("inert", "vocab_file", f"tokenizer-type {kind} is not mapped")

    # ------------------------------------------------------------------ checkpoints, evaluation, logging
    def checkpoints_and_eval(self) -> None:
        o = self.out
        o.set("trainer.log_every_n_steps", self.integer("log_interval"), self.c("log_interval"))
        o.set("trainer.val_check_interval", self.integer("eval_interval"), self.c("eval_interval"))
        iters = self.integer("eval_iters")
        o.set("trainer.limit_val_batches", iters, self.c("eval_iters"))
        o.set("trainer.limit_test_batches", iters, self.c("eval_iters"))
        clip = self.number("gradient_clipping")
        o.set("trainer.gradient_clip_val", clip, self.c("gradient_clipping", " (0 = off)" if not clip else ""))
        save = self.text("save") if self.has("save") else None
        load = self.text("load") if self.has("load") else None
        o.set("exp_manager.create_tensorboard_logger", True)
        if save:
            o.set("exp_manager.explicit_log_dir", save, "save: checkpoints go to <save>/checkpoints")
        o.set("exp_manager.resume_if_exists", bool(load and load == save), "load = save: resume from the newest"
              if load and load == save else None)
        o.set("exp_manager.resume_ignore_no_checkpoint", True, "start fresh when there is none (as NeoX)")
        if load and load != save:
            self.list_key("not mapped", "load", "a NeoX/DeepSpeed checkpoint folder: convert it (nxdt convert, "
                          "via transformers' GPTNeoX) and set exp_manager.resume_from_checkpoint")
        o.set("exp_manager.create_checkpoint_callback", bool(save), "save" if save else "no save in the NeoX files")
        every, src = None, None
        if self.has("save_interval"):
            every, src = self.integer("save_interval"), "save-interval"
            if self.has("checkpoint_factor"):
                self.list_key("inert", "checkpoint_factor", "save-interval wins")
        elif self.has("checkpoint_factor") and self.text("checkpoint_scale") == "linear":
            every, src = self.integer("checkpoint_factor"), "checkpoint-factor (linear scale)"
        if self.has("checkpoint_scale") and self.cfg["checkpoint_scale"] == "linear":
            self.list_key("inert", "checkpoint_scale", "linear is nxdt's spacing")
        elif self.has("checkpoint_scale") and self.has("checkpoint_factor") and not self.has("save_interval"):
            self.list_key("not mapped", "checkpoint_factor", "only linear checkpoint spacing (every_n_train_steps)")
        cb = "exp_manager.checkpoint_callback_params"
        o.set(f"{cb}.monitor", "step")
        o.set(f"{cb}.mode", "max")
        keep = self.integer("keep_last_n_checkpoints") if self.has("keep_last_n_checkpoints") else None
        o.set(f"{cb}.save_top_k", keep if keep else -1,
              "keep-last-n-checkpoints" if keep else "NeoX keeps every checkpoint")
        o.set(f"{cb}.every_n_train_steps", every, src or "no save-interval: only at the end")
        if self.has("log_param_norm"):
            o.set("exp_manager.log_parameter_norm", self.flag("log_param_norm"), "log-param-norm")
        if self.has("log_grad_norm"):
            o.set("exp_manager.log_gradient_norm", self.flag("log_grad_norm"), "log-grad-norm")
