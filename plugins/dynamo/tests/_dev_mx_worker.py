"""The vLLM plugin's test worker, in a process where Dynamo's development-branch ``mx`` engine
(its stand-in, ``_dev_branch_engine.DevMxEngine``) registered first: the worker's backend
``mx`` is then not mx-refit's. Same protocol as ``_vllm_worker.py``."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent / "vllm_engine" / "tests")]

import _vllm_worker  # noqa: E402  (first: it selects vLLM's CPU platform before vLLM loads)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: E402

from _dev_branch_engine import DevMxEngine  # noqa: E402

WeightTransferEngineFactory.register_engine("mx", DevMxEngine)

if __name__ == "__main__":
    _vllm_worker.main()
