"""What a person sees of a run: the start summary, throughput / TFLOP/s / MFU and measured memory
(callbacks.py, memory.py), the progress bar (progress.py) and time estimate (eta.py), the per-step
scalars written to the loggers (step_scalars.py), the profiler (profiler.py), samples generated
during training (samples.py), and the callbacks a config adds (user_callbacks.py)."""
