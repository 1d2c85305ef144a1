"""The Lightning-facing layer: ``MultimodalParallelStrategy``, ``MultimodalLightningModule``, the ``lightning-mm``
CLI, the launcher, the model summary and the callbacks. It drives ``parallel/`` (a rank's stage and its step) and
``fault_tolerance/``; nothing below imports it."""
