"""Bad input through the real entry point: one clear line on stderr, exit code 2, no traceback.

The entry examples/train.py calls (`main_guard(main)`, whose status is the process's exit code) runs
in the pytest process (conftest.run_cli_here): a process of its own would spend its ~1 CPU-s starting Python
and importing the config side (~4 s more where the error is found after torch and Lightning are
imported). Real processes remain where the process is the point: a torchrun launch whose ranks
refuse their world size, `nxdt train`'s launch of two workers, and nxdt's command line's exit status.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import REPO, run_cli, run_cli_here

BASE = ["--config-name", "tiny_llama_cpu"]


def _assert_one_line_error(proc, *fragments: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture()
def data_args(kjv_prefix):
    return [f"data.data_prefix=[1.0,{kjv_prefix}]"]


def test_unknown_key_names_dotted_path_and_suggestion(data_args):
    proc = run_cli_here([*BASE, *data_args, "model.hiden_size=64"])
    _assert_one_line_error(proc, "model.hiden_size", "model.hidden_size")


def test_wrong_type_names_key_and_expected_type(data_args):
    proc = run_cli_here([*BASE, *data_args, "model.num_layers=abc"])
    _assert_one_line_error(proc, "model.num_layers", "int", "abc")


def test_a_value_given_to_a_section_names_the_key_meant():
    """`precision=bf16` (Lightning's Trainer argument): precision is a section; the line names
    precision.type, its closest choice and every choice (in this process: no launch needed)."""
    from nxdt.config.errors import ConfigError
    from nxdt.spec import load_config

    with pytest.raises(ConfigError) as err:
        load_config(["--config-name", "tiny_llama_cpu", "precision=bf16"], check_paths=False, quiet=True)
    assert str(err.value) == ("precision: expected a mapping, got 'bf16' (str); precision is a section: did you "
                              "mean precision.type=bf16SR? precision.type is one of fp32, autocast, mixed_precision, "
                              "mixed_precisionSR, mixed_precision_SR, bf16SR, manual")


def test_malformed_yaml_names_the_file(tmp_path):
    (tmp_path / "broken.yaml").write_text("name: x\nmodel:\n  hidden_size: [1, 2\n")
    proc = run_cli_here(["--config-path", str(tmp_path), "--config-name", "broken"])
    _assert_one_line_error(proc, "broken.yaml")


def test_missing_config_name_lists_available():
    proc = run_cli_here(["--config-name", "no_such_config"])
    _assert_one_line_error(proc, "no_such_config", "tiny_llama_cpu")


def test_missing_data_prefix_names_the_path(tmp_path):
    missing = tmp_path / "nothing_here"
    proc = run_cli_here([*BASE, f"data.data_prefix=[1.0,{missing}]"])
    _assert_one_line_error(proc, "data.data_prefix", str(missing))


def test_missing_tokenizer_dir_names_the_path(data_args, tmp_path):
    missing = tmp_path / "no_tokenizer"
    proc = run_cli_here([*BASE, *data_args, f"data.tokenizer.type={missing}"])
    _assert_one_line_error(proc, "data.tokenizer.type", str(missing))


def test_world_size_must_match_devices_times_nodes(data_args):
    proc = run_cli_here([*BASE, *data_args, "trainer.devices=2"], env={"WORLD_SIZE": "3", "RANK": "0"})
    _assert_one_line_error(proc, "trainer.devices", "3")


def test_batch_sizes_that_do_not_divide(data_args):
    # dp = 2 (devices 2), micro 4 → global must be a multiple of 8
    proc = run_cli_here([*BASE, *data_args, "data.global_batch_size=12"])
    _assert_one_line_error(proc, "data.global_batch_size", "12", "8")


def test_accumulate_grad_batches_is_rejected_with_the_reason(data_args):
    proc = run_cli_here([*BASE, *data_args, "trainer.accumulate_grad_batches=4"])
    _assert_one_line_error(proc, "trainer.accumulate_grad_batches", "global_batch_size")


def test_feature_not_built_yet_is_refused_not_ignored(data_args):
    proc = run_cli_here([*BASE, *data_args, "+model_alignment_strategy.dpo.precompute_ref_log_probs=false"])
    _assert_one_line_error(proc, "model_alignment_strategy.dpo.precompute_ref_log_probs", "not supported yet")


@pytest.mark.slow
def test_world_size_mismatch_under_torchrun(data_args):
    """A real 2-rank torchrun launch of a config that says devices=1: every rank exits 2, rank 0 says why."""
    proc = run_cli([*BASE, *data_args, "trainer.devices=1"], nproc=2)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trainer.devices" in errors[0], proc.stderr[-3000:]


def test_nxdt_cli_unknown_command():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "nxdt.cli", "trian"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "did you mean 'train'" in proc.stderr


def test_bad_fine_tuning_inputs_stop_before_training(data_args, tmp_path):
    """A LoRA target the model lacks (checked on a meta-device build, before any process group), and
    a preference row without 'rejected' (read when the data module sets up): one line, exit 2."""
    proc = run_cli_here([*BASE, *data_args, "trainer.devices=1", "+model_alignment_strategy.peft.target_modules=[qkv]"])
    line = _assert_one_line_error(proc, "model_alignment_strategy.peft.target_modules: 'qkv' is not a linear layer")
    assert "qkv_proj" in line and "down_proj" in line  # the valid names are listed
    rows = tmp_path / "pref.jsonl"
    rows.write_text('{"prompt": "a", "chosen": " b", "rejected": " c"}\n{"prompt": "a", "chosen": " b"}\n')
    proc = run_cli_here([*BASE, "trainer.devices=1", "data.data_prefix=null", f"data.train_dir={rows}",
                    "+model_alignment_strategy.orpo.beta=0.1"])
    _assert_one_line_error(proc, f"{rows}:2", "rejected")


def test_nxdt_evaluate_bad_input(data_args, tmp_path, capsys):
    """`nxdt evaluate` of a directory that is not there, and evaluate-only training (trainer.max_epochs=0)
    with no checkpoint to evaluate: one line, exit 2 (tests/test_evaluate.py has the other cases)."""
    from nxdt.cli import main

    missing = tmp_path / "no_checkpoint"
    with pytest.raises(SystemExit) as stop:  # nxdt evaluate's main_guard ends the process: its exit status
        main(["evaluate", "--checkpoint", str(missing)])
    rc, said = stop.value.code, capsys.readouterr()
    _assert_one_line_error(SimpleNamespace(returncode=rc, stdout=said.out, stderr=said.err), str(missing), "does not exist")
    proc = run_cli_here([*BASE, *data_args, "trainer.devices=1", "trainer.max_epochs=0"])
    _assert_one_line_error(proc, "trainer.max_epochs=0", "no weights to evaluate", "exp_manager.resume_from_checkpoint")



def test_a_hub_id_as_tokenizer_says_how_to_download(data_args, capsys):
    """In the training process (validation stops before torch): the folder, and how to get it."""
    from nxdt.cli import main

    assert main(["train", *BASE, *data_args, "data.tokenizer.type=meta-llama/Llama-2-7b-hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: data.tokenizer.type: tokenizer directory not found")
    assert "hf download meta-llama/Llama-2-7b-hf --local-dir DIR" in err and "pass the folder" in err


def test_nxdt_train_launcher_validates_before_any_worker_starts(data_args, capsys, monkeypatch):
    """`nxdt train --standalone --nproc-per-node N ...`: a bad key, or a layout that does not fit the
    launch's world size, is one line and exit 2 from the launching process; torchrun never runs."""
    import torch.distributed.run

    from nxdt.cli import main

    def no_launch(args):
        raise AssertionError("workers were started")

    monkeypatch.setattr(torch.distributed.run, "run", no_launch)
    launch = ["train", "--standalone", "--nproc-per-node", "2", *BASE, *data_args]
    assert main([*launch, "trainer.max_step=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: unknown key 'trainer.max_step' (did you mean 'trainer.max_steps'?)"
    assert main([*launch[:3], "3", *launch[4:], "trainer.devices=3",
                 "distributed_strategy.tensor_model_parallel_size=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not divide the world size 3" in err, err


def test_nxdt_train_launcher_a_workers_error_is_one_line_exit_2(data_args, tmp_path):
    """One real launch: an error only the workers find (the checkpoint to resume is incomplete) is rank 0's
    one line and exit 2, without torchrun's ChildFailedError report (35 lines under plain torchrun)."""
    import os
    import subprocess
    import sys

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "meta.json").write_text("{}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "nxdt.cli", "train", "--standalone", "--nproc-per-node", "2", *BASE, *data_args,
           f"exp_manager.resume_from_checkpoint={partial}", f"exp_manager.explicit_log_dir={tmp_path / 'log'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    _assert_one_line_error(proc, f"checkpoint {partial} is incomplete")
    assert "ChildFailedError" not in proc.stderr and "exitcode" not in proc.stderr, proc.stderr


def test_a_launched_runs_resume_command_is_the_launcher(monkeypatch, tmp_path, capsys):
    """The workers of `nxdt train --nproc-per-node 2` run `python -m nxdt.cli train`: the closing resume
    command is `nxdt train --standalone --nproc-per-node 2 ...` (not `torchrun ... nxdt/cli.py`, which
    would lack the command name)."""
    import shlex
    import sys

    from nxdt.tools.launch import is_launch
    from nxdt.tools.next_steps import format_next_steps

    monkeypatch.setattr(sys, "argv", [str(REPO / "src" / "nxdt" / "cli.py"), "train", *BASE])
    text = format_next_steps(tmp_path / "ckpt", tmp_path, BASE, 3, environ={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    resume = shlex.split(next(line for line in text.splitlines() if line.startswith("resume"))[len("resume"):])
    assert resume[0].endswith("nxdt") and resume[1:5] == ["train", "--standalone", "--nproc-per-node", "2"]
    assert is_launch(resume[2:]) and resume[5:7] == BASE
    assert "--prompt 'And God said'" in text  # the bundled corpus; a run on other data: a word to fill in
    from types import SimpleNamespace

    from nxdt.spec import load_config
    from nxdt.tools.train import REPO_CONF_DIR, print_next_steps

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "meta.json").write_text("{}")  # a checkpoint's metadata (no LoRA: not adapter-only)
    for extra, prompt in (([], "'And God said'"), ([f"data.tokenizer.type={tmp_path}"], "PROMPT")):
        cfg = load_config([*BASE, *extra], default_config_dir=REPO_CONF_DIR, check_paths=False, quiet=True)
        print_next_steps(cfg, SimpleNamespace(log_dir=tmp_path), SimpleNamespace(argv=BASE, multirun=False),
                         [(3, tmp_path / "ckpt")])
        assert f"--prompt {prompt} --stream" in capsys.readouterr().out  # a code corpus is not asked about God


@pytest.mark.parametrize("code, line", [(2, ""), (3, ""), (130, ""), (1, "error: rank 1 exited with code 1 (pid 4242); its output "
                                                             "is above"), (-9, "error: rank 1 was killed by SIGKILL")])
def test_nxdt_train_launcher_reports_a_failed_worker_in_one_line(data_args, capsys, monkeypatch, code, line):
    """torchrun's ChildFailedError becomes the exit code: 2 and 3 silently (rank 0 said why), any other
    failure one line naming the rank (its traceback is in its output above)."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from nxdt.cli import main

    def failed(args):
        raise ChildFailedError("nxdt.cli", {1: ProcessFailure(local_rank=1, pid=4242, exitcode=code, error_file="")})

    monkeypatch.setattr(torch.distributed.run, "run", failed)
    assert main(["train", "--standalone", "--nproc-per-node", "2", *BASE, *data_args]) == (
        1 if code not in (2, 3, 130) else code)
    err = capsys.readouterr().err.strip()
    assert err.startswith(line) and len(err.splitlines()) <= 1, err


def test_nxdt_train_launcher_passes_ctrl_c_on_to_the_ranks_groups_with_one_line(capfd):
    """While torchrun's launch runs, SIGINT and SIGTERM are the launcher's, not torchrun's (its
    --signals-to-handle loses them): each is passed on to every rank's process group with one line;
    a second Ctrl-C says the ranks stop at once. The handlers before it are back afterwards."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from nxdt.tools.launch import forwarded_stop_signals

    # a stand-in rank (its command line names nxdt.cli, as torchrun's workers' do), in a session of its
    # own as torchrun starts them: it counts the SIGINTs it gets and exits 0 after two
    code = ("import signal, sys, time  # nxdt.cli\nn = []\nsignal.signal(signal.SIGINT, lambda *a: n.append(1))\n"
            "print('ready', flush=True)\nwhile len(n) < 2: time.sleep(0.01)\nprint('got', len(n), flush=True)")
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert rank.stdout.readline() == "ready\n"
    args = SimpleNamespace(signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        with forwarded_stop_signals(args):
            assert args.signals_to_handle == "SIGHUP,SIGQUIT"
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
    finally:
        out, _ = rank.communicate(timeout=20)
    assert rank.returncode == 0 and out == "got 2\n"
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert capfd.readouterr().err.splitlines() == [
        "nxdt train: Ctrl-C passed on to the 1 rank(s): they save at the end of the current step and exit",
        "nxdt train: again: Ctrl-C passed on to the 1 rank(s): they stop at once, without saving"]
