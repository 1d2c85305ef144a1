"""The README's examples run through the installed console script."""

import re
import shutil
import subprocess

import pytest

# Lightning's note when a LightningModule has a validation_step and the data no validation set (val_samples=0)
ABOUT_THE_CONFIG = "You defined a `validation_step` but have no `val_dataloader`. Skipping val loop."


@pytest.mark.parametrize("config", [pytest.param("examples/tiny_vlm.yaml", marks=pytest.mark.slow),
                                    pytest.param("examples/tiny_valm.yaml", marks=pytest.mark.slow),
                                    "examples/tiny_valm_pp.yaml"])
def test_cli_example_trains(config, tmp_path):
    exe = shutil.which("lightning-mm")
    assert exe, "the console script is not installed: pip install -e ."
    proc = subprocess.run([exe, "fit", "--config", config, "--trainer.max_steps=6",
                           f"--trainer.default_root_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max_steps=6" in proc.stderr + proc.stdout
    assert [p.parent.name for p in tmp_path.rglob("loss.png")] == ["version_0"]  # beside metrics.csv
    assert (next(tmp_path.rglob("loss.png")).parent / "metrics.csv").exists()
    # the only warning is about the configuration (no validation data); the bar shows steps of max_steps
    warned = [line for line in proc.stderr.splitlines() if re.match(r"\S+\.py:\d+: ", line)]
    assert all(ABOUT_THE_CONFIG in line for line in warned), warned
    assert "Epoch 0 · steps" in proc.stdout and "6/6" in proc.stdout and "/-" not in proc.stdout, proc.stdout
    assert "v_num: 0 " in proc.stdout and "v_num: 0.000" not in proc.stdout, proc.stdout
    # the last line says where the outputs went
    assert proc.stdout.rstrip().splitlines()[-1].startswith(f"logs: {tmp_path / 'lightning_logs' / 'version_0'}/ ("), \
        proc.stdout[-500:]
    assert all(f in proc.stdout.splitlines()[-1] for f in ("metrics.csv", "loss.png", "config.yaml"))


def test_gpu_examples_parse_to_the_model_and_layout_they_describe():
    """examples/gpu_vlm.yaml (+ the shared-GPU overlay) is the ~0.6B VLM it says, and the overlay's strategy puts 3
    ranks (vision 1 stage, LLM 2 stages) on one device over gloo. Built on meta: nothing allocated, no GPU needed."""
    import torch

    from lightning_mm import MultimodalParallelStrategy, ParallelSpec
    from lightning_mm.trainer.cli import MultimodalCLI

    cpu = ["--trainer.accelerator=cpu", "--trainer.precision=32-true"]
    with torch.device("meta"):
        whole = MultimodalCLI(args=["--config", "examples/gpu_vlm.yaml", *cpu], run=False, save_config_callback=None)
        overlay = ["--config", "examples/gpu_vlm_shared_gpu.yaml",
                   '--trainer.strategy.init_args.parallel_devices=["cpu","cpu","cpu"]']
        shared = MultimodalCLI(args=["--config", "examples/gpu_vlm.yaml", *overlay, *cpu], run=False,
                               save_config_callback=None)
    params = {id(p): p for p in whole.model.model.parameters()}.values()
    assert 0.5e9 < sum(p.numel() for p in params) < 0.7e9
    assert whole.trainer.strategy.num_processes == 1 and whole.trainer.precision == "32-true"
    strategy = shared.trainer.strategy
    assert isinstance(strategy, MultimodalParallelStrategy) and strategy.num_processes == 3
    assert strategy._process_group_backend == "gloo" and strategy.parallel_devices == [torch.device("cpu")] * 3
    assert strategy.encoder_specs == {"vision": ParallelSpec(pp=1)}
    assert strategy.language_model_spec == ParallelSpec(pp=2)


def _empty_init_fit(tmp_path, *extra):
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-m", "lightning_mm.trainer.cli", "fit", "--config", "examples/tiny_vlm.yaml",
                           "--empty_init=true", "--trainer.max_steps=3", f"--trainer.default_root_dir={tmp_path}",
                           *extra], capture_output=True, text=True, timeout=300, cwd=root)


@pytest.mark.slow
def test_empty_init_builds_on_meta_and_trains_under_the_strategy(tmp_path):
    """``--empty_init true`` builds the YAML's model on the meta device (the MFU warning says so) and trains under
    MultimodalParallelStrategy."""
    proc = _empty_init_fit(tmp_path, "--trainer.strategy=multimodal", "--model.peak_flops=1e12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the model was built on the meta device" in proc.stderr and "max_steps=3" in proc.stderr + proc.stdout


def test_empty_init_needs_the_strategy(tmp_path):
    proc = _empty_init_fit(tmp_path)
    assert proc.returncode != 0 and "only MultimodalParallelStrategy materialises" in proc.stderr


def test_fault_tolerance_is_set_from_the_command_line(monkeypatch):
    """The strategy's ``fault_tolerance`` fields as dotted flags (docs/fault_tolerance.md), parsed only; a YAML's
    ``fault_tolerance`` mapping and the environment fill the rest."""
    import torch

    from lightning_mm.trainer.cli import MultimodalCLI
    from lightning_mm.fault_tolerance import FaultTolerance

    monkeypatch.setenv("LMM_REPLICA_GROUP", "1")
    ft = "--trainer.strategy.init_args.fault_tolerance"
    with torch.device("meta"):
        cli = MultimodalCLI(args=["--config", "examples/tiny_valm_pp.yaml", "--trainer.logger=false",
                                  f"{ft}.lighthouse=127.0.0.1:29510", f"{ft}.num_replica_groups=2",
                                  f"{ft}.min_replicas=1", f"{ft}.timeout=12"], run=False, save_config_callback=None)
    got = cli.trainer.strategy.fault_tolerance
    assert isinstance(got, FaultTolerance) and cli.trainer.strategy.ft is not None
    assert (got.lighthouse, got.replica_group, got.num_replica_groups, got.timeout) == ("127.0.0.1:29510", 1, 2, 12.0)
    with torch.device("meta"):  # the top-level shortcut sets the same argument
        cli = MultimodalCLI(args=["--config", "examples/tiny_valm_pp.yaml", "--trainer.logger=false",
                                  "--fault_tolerance.lighthouse=127.0.0.1:29511", "--fault_tolerance.num_replica_groups=2"],
                            run=False, save_config_callback=None)
    got = cli.trainer.strategy.fault_tolerance
    assert (got.lighthouse, got.replica_group, got.num_replica_groups) == ("127.0.0.1:29511", 1, 2)
    with pytest.raises(ValueError, match="give --trainer.strategy lightning_mm.MultimodalParallelStrategy"), \
            torch.device("meta"):
        MultimodalCLI(args=["--config", "examples/tiny_vlm.yaml", "--trainer.logger=false",
                            "--fault_tolerance.lighthouse=127.0.0.1:29511"], run=False, save_config_callback=None)


def test_under_torchrun_num_nodes_follows_the_nodes_of_this_start(monkeypatch):
    """``torchrun --nnodes MIN:MAX`` may restart a group on fewer nodes: the CLI's default ``trainer.num_nodes`` is
    the current world size over the ranks per node, so the same command serves every (re)start."""
    import torch

    from lightning_mm.trainer.cli import MultimodalCLI

    for key, value in dict(TORCHELASTIC_RUN_ID="job", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
                           GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555").items():
        monkeypatch.setenv(key, value)
    with torch.device("meta"):
        cli = MultimodalCLI(args=["--config", "examples/tiny_valm_pp.yaml", "--trainer.logger=false",
                                  "--trainer.devices=1"], run=False, save_config_callback=None)
    assert cli.trainer.num_nodes == 2 and cli.trainer.world_size == 2


# ------------------------------------------------------------------------------------------------ bad input
def test_missing_model_folder_is_one_message_naming_the_path(tmp_path):
    """The real console script, a model folder that does not exist: a few lines on stderr (jsonargparse's wrapping
    printed over 80, with Namespace dumps), the path and the fix, no traceback, exit status 1."""
    missing = tmp_path / "weights" / "nope"
    proc = subprocess.run([shutil.which("lightning-mm"), "fit", "--config", "examples/tiny_vlm.yaml",
                           f"--model.model={missing}", f"--trainer.default_root_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1 and len(lines) <= 20, proc.stderr
    assert f"lightning-mm fit: error: model folder {missing} does not exist (pass a folder written by " \
           "save_pretrained" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Namespace(" not in proc.stderr
    assert "--verbose or LMM_VERBOSE=1 prints the traceback" in lines[-1]


def _main_from_argv(monkeypatch, *args):
    """``lightning-mm <args>`` in this process, as the console script calls it (arguments from sys.argv)."""
    from lightning_mm.trainer.cli import main

    monkeypatch.setattr("sys.argv", ["lightning-mm", *args])
    return main()


def test_verbose_keeps_the_traceback(monkeypatch, tmp_path):
    from lightning_mm.model.loading import ModelFolderError

    args = ["fit", "--config", "examples/tiny_vlm.yaml", f"--model.model={tmp_path / 'nope'}"]
    monkeypatch.setenv("LMM_VERBOSE", "1")
    with pytest.raises(ValueError) as caught:  # jsonargparse's error, the folder's as its cause
        _main_from_argv(monkeypatch, *args)
    assert isinstance(caught.value.__cause__, ModelFolderError)
    monkeypatch.delenv("LMM_VERBOSE")
    with pytest.raises(ValueError):
        _main_from_argv(monkeypatch, *args, "--verbose")  # the flag, anywhere, does the same


def test_devices_that_cannot_hold_the_layout_are_one_message(monkeypatch, capsys, tmp_path):
    """3 devices for a 4-rank replica: the layout's message alone (it was the last line of a 28-line traceback),
    raised in the launching process before any rank starts."""
    with pytest.raises(SystemExit) as caught:
        _main_from_argv(monkeypatch, "fit", "--config", "examples/tiny_valm_pp.yaml", "--trainer.devices=3",
                        f"--trainer.default_root_dir={tmp_path}")
    err = capsys.readouterr().err
    assert caught.value.code == 1 and "Traceback" not in err
    assert ("lightning-mm fit: error: 3 devices cannot hold whole replicas of 4 ranks (vision.0x1 + audio.0x1 + "
            "language_model.0x1 + language_model.1x1); use a multiple of 4 devices or change the ParallelSpecs") in err


def test_the_error_reported_is_the_cause_not_an_error_met_while_handling_it():
    from lightning_mm.plan.layout import LayoutError
    from lightning_mm.trainer.cli import input_error

    def raised(make):
        try:
            make()
        except Exception as err:  # noqa: BLE001  (the test inspects whatever was raised)
            return err

    def wrapped():  # as jsonargparse wraps an error of the objects it builds
        try:
            raise LayoutError("3 devices cannot hold whole replicas of 4 ranks")
        except LayoutError as err:
            raise ValueError("Does not validate against any of the Union subtypes") from err

    def while_handling():  # a failure of its own, met while handling the layout's error
        try:
            raise LayoutError("3 devices cannot hold whole replicas of 4 ranks")
        except LayoutError:
            raise RuntimeError("teardown failed")

    err = raised(wrapped)
    assert isinstance(input_error(err), LayoutError) and input_error(err) is err.__cause__
    assert input_error(raised(while_handling)) is None
    assert input_error(raised(lambda: 1 / 0)) is None
