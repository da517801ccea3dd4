"""Every message that crosses a process boundary, as tagged msgspec Structs, declared once here.

One union per channel (shared/channels.py), one module per pair of processes: `tokenizer_scheduler`
(ToScheduler, ToTokenizer, UnloadLoraReq), `scheduler_worker` (ToWorker, ToSchedulerFromWorker), `to_launcher`
(ToLauncher); `sampling` and `server_info` hold the parts several messages carry. Decoding is typed: a
message of the wrong shape raises `msgspec.ValidationError` at the receiver instead of being accepted
silently. Token ids travel as msgpack integer arrays (compact varints), never as pickles. This face
only re-exports: `from shared.messages import X` for every message type.
"""

# wrapped by hand, so that the face stays one short page (isort would set one name a line)
# isort: off
from shared.messages.images import ImageInput
from shared.messages.lora import LoraAdapter
from shared.messages.sampling import GrammarSpec, SamplingParams, ThinkingBudget
from shared.messages.scheduler_worker import (CopyOp, ForwardBatch, Heartbeat, LoraLoad, ReqSlice, Shutdown,
                                              StepResult, StoreLoad, StoreWrite, ToSchedulerFromWorker, ToWorker,
                                              WorkerReady, WorkerStarting)
from shared.messages.server_info import LoopInfo, MetricName, MetricRecord, SchedulerInfo, ServerState, StoreStats
from shared.messages.to_launcher import ProcFailed, ProcReady, ProcStarting, ToLauncher
from shared.messages.tokenizer_scheduler import (AbortReq, FinishReason, FlushCacheReq, FlushCacheResp, GenerateReq,
                                                 GetInfoReq, InfoResp, LoadLoraReq, LoraResp, SchedulerDead, TokenOut,
                                                 TokenOutBatch, ToScheduler, ToTokenizer, UnloadLoraReq)
# isort: on

__all__ = [
    "AbortReq", "CopyOp", "FinishReason", "FlushCacheReq", "FlushCacheResp", "ForwardBatch", "GenerateReq",
    "GetInfoReq", "GrammarSpec", "Heartbeat", "ImageInput", "InfoResp", "LoadLoraReq", "LoraAdapter", "LoraLoad",
    "LoraResp", "LoopInfo", "MetricName", "MetricRecord", "ProcFailed", "ProcReady", "ProcStarting", "ReqSlice",
    "SamplingParams", "SchedulerDead", "SchedulerInfo", "ServerState", "Shutdown", "StepResult", "StoreLoad",
    "StoreStats", "StoreWrite", "ThinkingBudget", "ToLauncher", "ToScheduler", "ToSchedulerFromWorker",
    "ToTokenizer", "ToWorker", "TokenOut", "TokenOutBatch", "UnloadLoraReq", "WorkerReady", "WorkerStarting",
]  # fmt: skip
