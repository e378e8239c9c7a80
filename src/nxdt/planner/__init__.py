"""What a config will cost per rank, without training: the one estimator behind `nxdt plan`
(nxdt.tools.plan, its command line) and a run's start summary (nxdt.observability.callbacks)."""
