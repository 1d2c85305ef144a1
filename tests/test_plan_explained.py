"""``lightning-mm plan`` explains itself: why it proposes fewer devices than given; and it writes to a folder of its
own, beside the runs' ``version_N`` folders, a new one each time."""

from types import SimpleNamespace

from lightning_mm.planner.plan_cli import default_out, fewer_devices_reason


def plan(devices, dp, time):
    return SimpleNamespace(devices=devices, dp=dp, module_dp={}, iteration_time=time, tp=1, placement="parallel",
                           pp=lambda: {"vision": 1, "language_model": 2})


def test_fewer_devices_are_explained():
    best = plan(6, 2, 1.0)
    why = fewer_devices_reason(best, [best, plan(8, 2, 1.25), plan(8, 4, 1.5)], 8)
    assert why.startswith("why 6 of 8 devices: a replica of this layout spans 3 ranks")
    assert "predicted to take 1.250x this plan's iteration time" in why
    assert "no layout searched fills all 8" in fewer_devices_reason(best, [best], 8)
    assert fewer_devices_reason(plan(8, 2, 1.0), [], 8) == ""


def test_plan_folder_is_a_new_plan_folder_beside_the_runs(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logged = SimpleNamespace(logger=CSVLogger(save_dir=tmp_path / "root", name="lightning_logs"), default_root_dir="x")
    assert default_out(logged) == tmp_path / "root" / "lightning_logs" / "plan_0"
    unlogged = SimpleNamespace(logger=None, default_root_dir=str(tmp_path))
    assert default_out(unlogged) == tmp_path / "lightning_logs" / "plan_0"
    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)  # a run's folder counts for nothing
    (tmp_path / "lightning_logs" / "plan_0").mkdir()
    assert default_out(unlogged) == tmp_path / "lightning_logs" / "plan_1"  # the first plan stays
