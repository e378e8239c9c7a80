"""Checkpoints: the one package that writes, reads, keeps and resumes them.

    checkpointer  Checkpointer (sharded DCP write, atomic rename, async), load_checkpoint, export weights
    state         the state codec: model/optimizer tensors (ZeRO-1, pipeline stages), JSON, RNG, safe reading
    dtype         save_bf16 / fp32 master weights in checkpoints
    lora_state    what a LoRA run's checkpoint holds and which keys each kind of load reads
    lora_merge    the merged model (merge_lora); an adapter-only checkpoint read over its base
    retention     checkpoint names, listing, completeness, save_top_k by step or by a metric
    callbacks     NxdtCheckpoint (Lightning callback: when to save, what to prune)
    resume        which checkpoint a run starts from; ResumeHelper (weights-only start, RNG states)
    locate        what a --checkpoint names (a run folder's newest complete checkpoint); transformers folders
"""
