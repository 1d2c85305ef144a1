"""Wall times of the README's first commands, and the conversation data scan rate (README.md, docs/data.md)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import harness

MAIN_JOB = ["lightning-mm", "fit", "--config", "examples/tiny_valm_pp.yaml"]


def wall(cmd: list[str], cwd: Path) -> float:
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t


def scan_rate(folder: Path, records: int, repeats: int) -> dict:
    """Records per second of the dataset's up-front scan on ``records`` copies of the example's records."""
    import lightning_mm as lmm
    from lightning_mm.data.conversation import ConversationDataset, load_processor
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.set_num_threads(1)
    base = json.loads((folder / "train.json").read_text())
    data = folder / "scan.json"
    data.write_text(json.dumps([base[i % len(base)] for i in range(records)]))
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp")},
                                tiny_language_model("llama", vocab_size=128))
    processor = load_processor(folder / "processor", model)

    def dataset(scan: bool):
        return ConversationDataset(data, processor, media_root=folder / "images", scan=scan)

    dataset(False)  # builds the records' Arrow cache
    with_scan, without = (statistics.median(harness.repeat(lambda: dataset(scan), repeats)[0])
                          for scan in (True, False))
    return dict(records=records, repeats=repeats, construct_with_scan_s=with_scan, construct_without_scan_s=without,
                records_per_s=records / (with_scan - without))


def main(argv=None) -> None:
    args = harness.cli(__doc__, argv, records=20000, repeats=3)
    start, out = harness.record(), harness.RESULTS / "quickstart_cpu.json"
    doc = harness.read(out)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "conversation_data"
        doc["make_conversation_data_s"] = wall([sys.executable, "examples/make_conversation_data.py", str(folder)],
                                               harness.ROOT)
        doc["scan"] = scan_rate(folder, args.records, args.repeats)
        shutil.copytree(harness.ROOT / "examples", Path(tmp) / "examples")
        doc["main_job_s"] = wall([*MAIN_JOB, f"--trainer.default_root_dir={Path(tmp) / 'logs'}"], Path(tmp))
        doc["main_job_command"] = " ".join(MAIN_JOB)
    harness.write(out, doc, start)


if __name__ == "__main__":
    main()
