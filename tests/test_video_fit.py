"""Conversations with videos train under ``lightning-mm fit`` as a user runs it: a tiny Qwen2-VL (and Qwen3-VL)
composite folder (its tokenizer, image processor and video processor saved into it, as in an HF folder), a JSON
mixing an image sample, a video sample and a sample with both, and a YAML putting the vision tower on 1 pipeline
stage and the LLM on 2 (3 CPU ranks, gloo). A broken video (random bytes) fails the run naming the file and its record
(on_bad_record="raise", the default), or is skipped with a warning naming them (on_bad_record="skip").

Everything is written offline by the helpers of tests/test_video_data.py and tests/test_hf_composites.py."""

import math
import re
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("av")

from tests.helpers.launch import run_cli  # noqa: E402
from tests.test_conversation_data import conv, write_data  # noqa: E402
from tests.test_video_data import MIXED, video_processor_folder, write_videos  # noqa: E402

TIMEOUT = 540  # s: three ranks on a loaded 2-core machine

# image only, video only, both (two videos of different lengths and sizes around an image), and a video without a
# marker (prepended): clip.mp4 2 s 48x32, long.mkv 3 s 40x40, wide.mp4 1 s 96x16; at fps 2, max_frames 4 they take
# 48, 50 and 24 tokens (the images 12): samples of 22, 58, 104 and 33 LLM tokens
RECORDS = MIXED

YAML = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 3
  strategy:
    class_path: lightning_mm.MultimodalParallelStrategy
    init_args:
      encoders:
        vision: {{class_path: lightning_mm.ParallelSpec, init_args: {{pp: 1}}}}
      language_model: {{class_path: lightning_mm.ParallelSpec, init_args: {{pp: 2}}}}
      num_microbatches: 2
  max_steps: 3
  log_every_n_steps: 1
  logger: false
  enable_checkpointing: false
  callbacks:
    - class_path: lightning_mm.callbacks.StepProgressBar
model:
  lr: 0.003
  nan_guard: stop   # a step whose loss is not finite ends the run
  model: {folder}
data:
  class_path: lightning_mm.data.ConversationDataModule
  init_args:
    data_path: {data}
    media_root: {media}
    processor: {folder}
    batch_size: 2
    cache_dir: {cache}
    video: {{fps: 2.0, max_frames: 4}}
"""


QWEN3_VIDEO = {"video_processor_type": "Qwen3VLVideoProcessor", "size": {"shortest_edge": 8 * 8 * 2,
                                                                         "longest_edge": 4 * 48 * 48}}


def write_case(tmp_path: Path, records: list[dict], kind: str = "qwen2_vl") -> Path:
    """The composite folder (model + processor files), the data and its media, and the fit YAML."""
    from tests.test_hf_composites import save_composite

    folder = tmp_path / kind
    if not folder.is_dir():
        save_composite(kind, folder)
        # tokenizer (chat template), image processor, video_preprocessor_config.json
        video_processor_folder(folder, **(QWEN3_VIDEO if kind == "qwen3_vl" else {}))
    data = write_data(tmp_path / "data", records)  # red.png, blue.png
    write_videos(tmp_path / "data" / "media")       # clip.mp4, long.mkv, wide.mp4, broken.mp4
    config = tmp_path / "fit.yaml"
    config.write_text(YAML.format(folder=folder, data=data, media=data.parent / "media", cache=tmp_path / "cache"))
    return config


def fit(config: Path, cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """``lightning-mm fit --config <config>`` as a user runs it, and its wall time."""
    start = time.monotonic()
    proc = run_cli("fit", config, *args, cwd=cwd, timeout=TIMEOUT)
    return proc, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_videos_train_under_fit_on_vision_pp1_llm_pp2(kind, tmp_path):
    """Every step's loss is finite (``nan_guard: stop`` ends the run otherwise); the bar shows the last one.
    Qwen3-VL's videos decode through its own frame-size rule and are laid out frame by frame after timestamps."""
    proc, wall = fit(write_case(tmp_path, RECORDS, kind), tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert "`max_steps=3` reached" in text and "3/3" in proc.stdout, text[-3000:]
    table = text.split("Whole model across 3 ranks (3 pipeline stages, data-parallel size 1)")[1]
    # the video modality runs on the tower's stage (rank 0), whose one copy of the tower is listed once
    assert "encoders.vision" in table and "encoders.video" not in table
    losses = [float(v) for v in re.findall(r"train/loss: (\S+)", proc.stdout)]
    assert losses and all(math.isfinite(v) and v > 0 for v in losses), (losses, proc.stdout[-3000:])
    print(f"lightning-mm fit: {wall:.0f} s, last loss {losses[-1]}")


BROKEN = RECORDS[:2] + [{"id": "broken", "video": "broken.mp4",  # random bytes
                         "conversations": conv("<video> what is this", "a square")}]


@pytest.mark.slow
def test_a_broken_video_fails_the_run_naming_its_file_and_record(tmp_path):
    """on_bad_record="raise" (the default): the batch planner reads every record's header, so the run stops at the
    first batch with the record and the file named (every rank stopped, not left waiting)."""
    proc, _ = fit(write_case(tmp_path, BROKEN), tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    named = (rf"record 2 of {re.escape(str(tmp_path / 'data' / 'train.json'))}: cannot read (video file|the video "
             rf"header of) {re.escape(str(tmp_path / 'data' / 'media' / 'broken.mp4'))}")
    assert re.search(r"lightning-mm fault: rank \d raised BadRecordError: " + named, text), text[-6000:]


@pytest.mark.slow
def test_a_broken_video_is_skipped_with_on_bad_record_skip(tmp_path):
    """on_bad_record="skip": the record is skipped with a warning naming it, and the run trains its steps."""
    proc, _ = fit(write_case(tmp_path, BROKEN), tmp_path, "--data.init_args.on_bad_record=skip")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert "`max_steps=3` reached" in text, text[-3000:]
    assert re.search(r"skipping record 2 of \S*train\.json: cannot read (video file|the video header of) "
                     r"\S*broken\.mp4", text), text[-6000:]
