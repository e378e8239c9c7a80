"""The entry sets config-derived environment variables before torch is imported, keeping the user's."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

PROBE = r"""
import json, os, sys
import nxdt.config.env as nenv
import nxdt.tools.train as run
seen = {}
real_apply_env = nenv.apply_env
def recording_apply_env(cfg, *args, **kwargs):
    seen["torch_imported"] = "torch" in sys.modules  # at the moment the env vars are set
    return real_apply_env(cfg, *args, **kwargs)
nenv.apply_env = run.apply_env = recording_apply_env
def fake_train(cfg, **kwargs):
    seen["env"] = {k: os.environ.get(k) for k in (
        "NEURON_CC_FLAGS", "XLA_USE_BF16", "XLA_DOWNCAST_BF16", "NEURON_RT_STOCHASTIC_ROUNDING_EN",
        "NEURON_RT_EXEC_TIMEOUT", "NEURON_FUSE_SOFTMAX")}
run.train = fake_train
run.main(sys.argv[1:])
print(json.dumps(seen))
"""


def _probe(args, env=None):
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_", "XLA_"))}
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=REPO, env=full_env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_xla_env_is_set_before_torch_and_user_values_win(kjv_prefix):
    seen, _ = _probe(
        ["--config-name", "tiny_llama_cpu", f"data.data_prefix=[1.0,{kjv_prefix}]", "trainer.accelerator=xla", "trainer.devices=1",
         "precision.type=fp32", "neuron_rt_exec_timeout=600", "compiler_flags=--model-type transformer"],
        env={"XLA_USE_BF16": "1", "NEURON_CC_FLAGS": "--retry_failed_compilation"},
    )
    assert seen["torch_imported"] is False
    env = seen["env"]
    assert env["XLA_USE_BF16"] == "1"  # the user's value is kept, not the fp32 preset's "0"
    assert env["XLA_DOWNCAST_BF16"] == "0"
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] is None  # fp32: unset
    assert env["NEURON_RT_EXEC_TIMEOUT"] == "600"
    flags = env["NEURON_CC_FLAGS"].split()
    assert flags[0] == "--retry_failed_compilation"  # appended to, never replaced
    assert "--model-type" in flags and "--auto-cast" in flags


def test_neuron_keys_are_inert_on_cpu_and_reported_once(kjv_prefix):
    seen, stderr = _probe(
        ["--config-name", "tiny_llama_cpu", f"data.data_prefix=[1.0,{kjv_prefix}]", "trainer.accelerator=cpu",
         "neuron_rt_exec_timeout=600", "compiler_flags=--model-type transformer"],
    )
    assert seen["torch_imported"] is False
    assert seen["env"]["NEURON_RT_EXEC_TIMEOUT"] is None and seen["env"]["NEURON_CC_FLAGS"] is None
    notes = [line for line in stderr.splitlines() if "no effect" in line or "inert" in line]
    assert len(notes) == 1 and "neuron_rt_exec_timeout" in notes[0] and "compiler_flags" in notes[0], stderr
