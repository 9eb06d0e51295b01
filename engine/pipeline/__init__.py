"""Pipeline parallelism: a built model cut into stages (``stages``) and run by a
``torch.distributed.pipelining`` schedule (``schedule``)."""

from engine.pipeline.schedule import SCHEDULES, PipelineRunner
from engine.pipeline.stages import PipelineModel, layer_split

__all__ = ["SCHEDULES", "PipelineModel", "PipelineRunner", "layer_split"]
