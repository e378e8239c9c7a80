"""GPT-NeoX's MoE keys -> nxdt's `model.moe`: the mixin behind `nxdt import-config neox` for NeoX's
dropless MoE (megablocks), read from EleutherAI/gpt-neox at ea7aefd8:

    moe-num-experts > 1    every moe-expert-interval-th layer (0-based index % interval == 0,
                           megatron/model/transformer.py) is a ParallelDroplessMoE
    experts                ParallelGroupedMLP (megatron/model/moe_mlp.py), whatever the activation:
                           two matrices w1, w2 [F, H] per expert, no bias, act = get_activation's
                           function (gelu: F.gelu; swiglu: swish = silu, not gated there);
                           F = intermediate-size, else 4 x hidden-size rounded up to 256
    moe-router-type        topk: softmax, the k best, not renormalised; sinkhorn (NeoX's default):
                           NeoX's SinkhornRouter (nxdt's neox_sinkhorn)
    moe-top-k              top_k
    no capacity            dropless; no load-balancing loss (ParallelDroplessMoE returns none)

Older NeoX versions' MoE keys (moe-type, moe-aux-loss-coeff, the DeepSpeed MoE's capacity settings)
are not in NeoX's argument list at that commit: they are listed as unknown keys.
"""

from __future__ import annotations

from typing import Any

EXPERT_ACTIVATION = {"gelu": "gelu", "swiglu": "silu"}
"""NeoX's activation -> the experts' (its ParallelGroupedMLP applies the plain function)."""


class MoEKeys:
    """`moe()` of NeoxMapper (nxdt.tools.neox_mapping): reads its cfg, writes its out."""

    cfg: dict[str, Any]
    out: Any

    def moe(self) -> None:
        experts = self.integer("moe_num_experts") if self.has("moe_num_experts") else 1
        others = [k for k in self.cfg if k.startswith("moe_") and k != "moe_num_experts"]
        if experts <= 1:
            for key in others + (["moe_num_experts"] if "moe_num_experts" in self.cfg else []):
                self.list_key("inert", key, "a dense model" if key != "moe_num_experts" else "off (NeoX's default)")
            return
        o, hidden = self.out, self.out.get("model.hidden_size")
        o.set("model.moe.num_experts", experts, "moe-num-experts")
        o.set("model.moe.frequency", max(1, self.integer("moe_expert_interval")), self.c("moe_expert_interval"))
        top_k = self.integer("moe_top_k")
        if not 1 <= top_k <= experts:
            raise self.bad("moe_top_k", f"1 to moe-num-experts ({experts})", top_k)
        o.set("model.moe.top_k", top_k, self.c("moe_top_k"))
        self.router(top_k)
        self.experts(hidden)
        o.set("model.moe.dropless", True, "NeoX's MoE is dropless (megablocks): no capacity")
        o.set("model.moe.capacity_factor", None, "dropless")
        o.set("model.moe.output_router_logits", False, "NeoX's dropless MoE adds no load-balancing loss")
        if self.has("moe_jitter_eps"):
            self.list_key("not mapped", "moe_jitter_eps", "NeoX multiplies the router's input by uniform noise in "
                                                          "[1 - eps, 1 + eps] in training; nxdt's router has none")
        if "moe_lbl_in_fp32" in self.cfg:
            self.list_key("inert", "moe_lbl_in_fp32", "NeoX's dropless MoE computes no load-balancing loss")

    def router(self, top_k: int) -> None:
        o, kind = self.out, self.text("moe_router_type")
        if kind == "topk":
            o.set("model.moe.routing_algorithm", "top_k", "moe-router-type topk")
            o.set("model.moe.router_activation", "softmax", "TopKTokenChoiceRouter: softmax scores")
            o.set("model.moe.normalize_top_k_affinities", False, "NeoX does not renormalise the k scores")
        elif kind == "sinkhorn":
            o.set("model.moe.routing_algorithm", "neox_sinkhorn", self.c("moe_router_type", ": NeoX's SinkhornRouter, "
                  + ("sigmoid scores" if top_k == 1 else "softmax scores")))
            o.set("model.moe.sinkhorn_iterations", 3, "SinkhornRouter.sinkhorn's max_iter")
            o.set("model.moe.sinkhorn_tol", 1e-4, "SinkhornRouter.sinkhorn's tol")
        else:
            raise self.bad("moe_router_type", "sinkhorn or topk", kind)

    def experts(self, hidden: int) -> None:
        act = self.text("activation")
        onnx_safe = str(self.cfg.get("onnx_safe")).lower() == "true"
        if act == "gelu" and self.flag("bias_gelu_fusion", False) and not onnx_safe:
            self.refuse("bias_gelu_fusion", "with moe-num-experts, NeoX's experts call its fused bias-GELU without "
                                            "a bias (megatron/model/moe_mlp.py ParallelGroupedMLP.forward), which "
                                            "fails: no model to import (set bias-gelu-fusion false)")
        self.out.set("model.moe.expert_activation", EXPERT_ACTIVATION.get(act, "gelu"),
                     self.c("activation", ": NeoX's experts are two matrices with its plain function "
                                          "(ParallelGroupedMLP), no bias"))
        if self.has("intermediate_size"):
            width, note = self.integer("intermediate_size"), "intermediate-size"
        else:
            width, note = 256 * -(-4 * hidden // 256), "4 x hidden-size, rounded up to a multiple of 256"
        self.out.set("model.moe.ffn_hidden_size", width, f"each expert's width: {note} (ParallelGroupedMLP)")
