"""Pipeline parallelism: a built model cut into stages (``stages``) and run by a
``torch.distributed.pipelining`` schedule (``schedule``)."""

from engine.pipeline.schedule import SCHEDULES, PipelineRunner, pipeline_runner
from engine.pipeline.split import layer_split
from engine.pipeline.stages import PipelineModel

__all__ = ["SCHEDULES", "PipelineModel", "PipelineRunner", "layer_split", "pipeline_runner"]
