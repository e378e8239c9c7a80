"""Optimizers and learning-rate schedules named by `model.optim` (NeMo / NxDT / GPT-NeoX names):
`build_optimizer` (optimizers.py), GPT-NeoX's Lion and SM3 (neox.py), what nxdt's own optimizers
share (base.py), and the NeMo schedulers (`build_scheduler`, schedulers.py). ZeRO-1 is a parallel
concern (nxdt.parallel.data_parallel) and wraps the optimizer built here."""
