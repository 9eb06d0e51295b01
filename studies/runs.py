"""What the studies share when they start ``engine.pretrain``."""

from __future__ import annotations

# Only the training steps run: no evaluation, no text samples, no TensorBoard or progress
# bar, no checkpoints; so a timed run times the steps and writes nothing else.
STEPS_ONLY = (
    "trainer.eval_every=0",
    "trainer.sample_tokens=0",
    "trainer.tensorboard=false",
    "trainer.progress=false",
    "checkpoint.every=0",
    "checkpoint.save_final=false",
)
