"""Models: nxdt's own Llama (model_source megatron) and transformers models (model_source hf).

The native model shares transformers' LlamaForCausalLM module tree and parameter names (and so
Llama / Mixtral checkpoints). GPT-NeoX / Pythia is the native model with other options;
transformers' GPTNeoXForCausalLM (model_source hf) keeps its own names (`gpt_neox.layers.<i>`,
a fused QKV), which nxdt.models.neox maps. nxdt.models.hf_export gives the transformers
config.json of a native model.
"""

from nxdt.models.builder import build_model, count_parameters, init_model_weights, logits_of, padded_vocab_size
from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM

__all__ = [
    "LlamaArgs",
    "NxdtLlamaForCausalLM",
    "build_model",
    "count_parameters",
    "init_model_weights",
    "logits_of",
    "padded_vocab_size",
]
