from .engine import Engine, GenerationResult, StreamEvent
from .params import SamplingParams, param_default
from .plan import RequestPlan, plan_request

__all__ = ["Engine", "GenerationResult", "RequestPlan", "SamplingParams", "StreamEvent", "param_default",
           "plan_request"]
