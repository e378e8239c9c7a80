"""Train a Llama from an NxDT-shaped YAML.

    torchrun --nproc_per_node 2 examples/train.py --config-name tiny_llama_cpu trainer.max_steps=100
    python examples/train.py --config-path /my/confs --config-name my_run model.num_layers=2

The command line is Hydra's: `--config-path/-cp`, `--config-name/-cn`, then `key=value`,
`+key=value` and `~key` overrides. Configs come from this repo's `conf/` unless
`--config-path` names another folder. Nothing heavy is imported before the config is valid and
its environment variables (Neuron runtime, precision) are set.
"""

import sys
from pathlib import Path

try:
    import nxdt  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from nxdt.tools.train import entry

if __name__ == "__main__":
    entry()
