"""tests/helpers/trainer_case.py with the synthetic data behind a plain ``torch.utils.data.Dataset`` that has no
``sample_metadata(i)``: batch balancing must read the metadata from the collator-format samples themselves.
Rank 0 also writes the info lines it logged (``info.txt``)."""

import logging
import os
import sys

import trainer_case
from plain_dataset import PlainDataset

_dataset = trainer_case.Data._dataset
trainer_case.Data._dataset = lambda self, n, seed: PlainDataset(_dataset(self, n, seed))

if __name__ == "__main__":
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("lightning.pytorch").addHandler(handler)
    trainer_case.main(*sys.argv[1:])
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
        with open(os.path.join(sys.argv[2], "info.txt"), "w") as f:
            f.write("\n".join(lines))
