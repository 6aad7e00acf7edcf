"""engines"""
# Importing the engine modules registers them. They import vllm/transformers only when an engine is
# built, so this stays fast; a module runs once per process, so the registry never sees a duplicate.
from rollplex.engines import (  # noqa: F401
    deepspeed_train,
    graph_decode,
    hf_score,
    replay_decode,
    torch_decode,
    torch_train,
    vllm_decode,
)
