"""``lightning-mm plan`` explains itself: why it proposes fewer devices than given, and it shares its log folder
with the ``fit`` that follows it."""

from types import SimpleNamespace

from lightning_mm.trainer.cli import planned_version
from lightning_mm.planner.plan_cli import fewer_devices_reason


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


def test_plan_folder_is_the_next_fit_folder(tmp_path):
    assert planned_version(str(tmp_path / "missing")) is None
    (tmp_path / "version_0").mkdir()
    (tmp_path / "version_0" / "metrics.csv").write_text("")
    assert planned_version(str(tmp_path)) is None  # a finished run: fit takes a new version
    (tmp_path / "version_1" / "plan").mkdir(parents=True)
    assert planned_version(str(tmp_path)) == 1  # written by plan for the run to come
