"""Precision: what `precision.*` means in PyTorch terms, below both the parallel engine and the loop.

    precision            Precision (the object the training step calls), PrecisionSettings, the
                         FSDP2 MixedPrecisionPolicy of a preset
    overflow             one finite/non-finite verdict for all ranks
    stochastic_rounding  fp32 → bf16 with stochastic rounding
    sr_fsdp              FSDP2 all-gather extension that rounds the bf16 copy stochastically
"""
