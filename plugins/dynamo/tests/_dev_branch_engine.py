"""Stands in for Dynamo's development-branch ``mx`` engine (unreleased, not installable): a
``WeightTransferEngine`` registered as ``mx`` whose init info has that branch's native-path
keys. Only its name and init-info shape matter to the backend-name rule under test.

``python _dev_branch_engine.py ORDER...`` prints a JSON report, per ORDER (``dynamo-first`` or
``mx-refit-first``), of what each backend name resolves to after registering in that order.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class DevMxInitInfo(WeightTransferInitInfo):
    mx_server_url: str
    model_name: str
    same_rank_only: bool = False
    tree_scale_out: bool = False


@dataclass
class DevMxUpdateInfo(WeightTransferUpdateInfo):
    version: int
    min_version: int = 0


class DevMxEngine(WeightTransferEngine[DevMxInitInfo, DevMxUpdateInfo]):
    init_info_cls = DevMxInitInfo
    update_info_cls = DevMxUpdateInfo

    def init_transfer_engine(self, init_info): ...
    def start_weight_update(self): ...
    def finish_weight_update(self): ...
    def receive_weights(self, update_info): ...
    def shutdown(self): ...


def resolve(order: str) -> dict:
    """Register in ``order`` (``dynamo-first`` or ``mx-refit-first``) on empty-of-mx registries
    and report what each name resolves to. Runs every ``vllm.general_plugins`` entry point, as
    vLLM does in each of its processes."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as Factory
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as Trainers
    from vllm.plugins import load_plugins_by_group

    from _dev_branch_engine import DevMxEngine  # by its module name, not __main__

    for factory in (Factory, Trainers):  # start each order from vLLM's built-ins only
        for name in ("mx", "mx_refit"):
            factory._registry.pop(name, None)
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    collect = Collect()
    for name in ("mx_refit_dynamo", "mx_refit_vllm"):
        logging.getLogger(name).addHandler(collect)

    def load_plugins() -> None:
        for plugin in load_plugins_by_group("vllm.general_plugins").values():
            plugin()

    report: dict = {}
    if order == "dynamo-first":
        Factory.register_engine("mx", DevMxEngine)
        load_plugins()
    else:
        load_plugins()
        try:
            Factory.register_engine("mx", DevMxEngine)
        except ValueError as exc:
            report["dynamo_registration_error"] = str(exc)
    from mx_refit_dynamo import backend_owner
    from mx_refit_vllm.infos import MxInitInfo

    report["owner"] = {name: backend_owner(name) for name in ("mx", "mx_refit")}
    report["trainer_owner"] = backend_owner("mx_refit", "WeightTransferTrainerFactory")
    report["classes"] = {name: Factory._registry[name]().__name__ for name in ("mx", "mx_refit")}
    report["warnings"] = warnings
    if report["classes"]["mx"] == "DevMxEngine":
        try:
            object.__new__(DevMxEngine).parse_init_info(MxInitInfo(catalog="h:1", model="m").to_dict())
        except ValueError as exc:
            report["foreign_init_error"] = str(exc)
    for name in ("mx_refit_dynamo", "mx_refit_vllm"):
        logging.getLogger(name).removeHandler(collect)
    return report


if __name__ == "__main__":
    print(json.dumps({order: resolve(order) for order in sys.argv[1:]}))
