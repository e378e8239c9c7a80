"""Using a trained model: the generation loop (KV cache, sampling, left-padded batches) and loading
a checkpoint of any training layout for it (nxdt.inference.load)."""
